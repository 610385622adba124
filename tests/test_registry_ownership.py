"""Registry tokens cannot take over, remove or fake the load of a worker they do not own.

A registry-scoped token (an engine plugin's) used to ``Register`` a configured worker's id at
another URL (its traffic went there), ``Deregister`` it, or ``Heartbeat`` a load of 999 into
it. Here, against a real control plane on loopback with a configured worker (a simulator
process), an operator's worker and registered engines: every such call is refused and the
worker is unchanged; an engine's id belongs to its first registration (its owner key and
token), shared by replicas through Redis; the owner itself registers, heartbeats and
deregisters as before.
"""

from __future__ import annotations

import logging
import uuid

import grpc
import pytest

from controlplane.auth import AuthConfig
from controlplane.config import ControlPlaneConfig, WorkerSpec as WorkerConfig
from controlplane.server import ControlPlane
from controlplane.workers import Role
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.redis_fixtures import redis_replicas

ADMIN = "adm-secret-123"
ENGINE_1 = "eng1-secret-456"
ENGINE_2 = "eng2-secret-789"
OTHER_URL = "http://127.0.0.1:9"


def md(token: str):
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
async def plane(sim_both):
    config = ControlPlaneConfig(listen="127.0.0.1:0", http_port=0, heartbeat_ttl_s=30.0,
                                workers=[WorkerConfig(url=sim_both.url, role=Role.BOTH, id="w"),
                                         WorkerConfig(url="http://127.0.0.1:7", role=Role.BOTH)],
                                auth=AuthConfig(admin_tokens={"ops": ADMIN},
                                                registry_tokens={"e1": ENGINE_1, "e2": ENGINE_2}))
    cp = ControlPlane(config)
    await cp.start()
    try:
        yield cp
    finally:
        await cp.stop()


async def _refused(call, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    for word in words:
        assert word in err.value.details()
    return err.value.details()


async def test_registry_token_cannot_touch_configured_or_admin_workers(plane, caplog):
    caplog.set_level(logging.WARNING, logger="controlplane.services")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.grpc_port}") as ch:
        reg, admin = pb_grpc.RegistryStub(ch), pb_grpc.AdminStub(ch)
        await admin.AddWorker(pb.RegisterRequest(url="http://127.0.0.1:8", role=pb.ROLE_BOTH, worker_id="ops-1"),
                              timeout=10, metadata=md(ADMIN))
        derived = next(s.id for s in plane.fleet.specs() if s.url == "http://127.0.0.1:7")
        before = {wid: plane.fleet.get(wid) for wid in ("w", "ops-1", derived)}
        engine_before = plane.fleet.engine("w")
        for wid in ("w", "ops-1"):
            for token in (ENGINE_1, ADMIN):     # not even an admin token through the Registry service
                await _refused(reg.Register(pb.RegisterRequest(url=OTHER_URL, role=pb.ROLE_BOTH, worker_id=wid),
                                            timeout=5, metadata=md(token)),
                               grpc.StatusCode.PERMISSION_DENIED, wid, "admin calls")
                await _refused(reg.Heartbeat(pb.HeartbeatRequest(worker_id=wid, running=999, waiting=999),
                                             timeout=5, metadata=md(token)),
                               grpc.StatusCode.PERMISSION_DENIED, wid)
                await _refused(reg.Deregister(pb.DeregisterRequest(worker_id=wid), timeout=5, metadata=md(token)),
                               grpc.StatusCode.PERMISSION_DENIED, wid)
        # no id: the id derived from the URL is a configured worker's
        await _refused(reg.Register(pb.RegisterRequest(url="http://127.0.0.1:7", role=pb.ROLE_BOTH),
                                    timeout=5, metadata=md(ENGINE_1)),
                       grpc.StatusCode.PERMISSION_DENIED, derived)
        after = {wid: plane.fleet.get(wid) for wid in before}
        assert after == before, "a refused call changed a worker"
        assert plane.fleet.engine("w") == engine_before and plane.fleet.engine("w").running != 999
        workers = {w.id: w for w in (await admin.ListWorkers(pb.ListWorkersRequest(), timeout=5,
                                                             metadata=md(ADMIN))).workers}
        assert workers["w"].url != OTHER_URL and workers["w"].source == "config"
        assert workers["ops-1"].source == "admin"
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("registry: ")]
    assert any("registration of w" in m and "token e1" in m for m in refusals)
    assert not any(ENGINE_1 in r.getMessage() or ADMIN in r.getMessage() for r in caplog.records)


async def test_an_engine_owns_its_id(plane):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.grpc_port}") as ch:
        reg = pb_grpc.RegistryStub(ch)
        mine = pb.RegisterRequest(url="http://127.0.0.1:11", role=pb.ROLE_BOTH, worker_id="eng-a",
                                  owner_key="key-of-a")
        r = await reg.Register(mine, timeout=5, metadata=md(ENGINE_1))
        assert r.worker_id == "eng-a" and r.owner_key == "key-of-a"
        spec = plane.fleet.get("eng-a")
        assert spec.owner == "e1" and spec.owner_key and "key-of-a" not in spec.owner_key   # a hash
        assert "key-of-a" not in repr(spec)

        # Another engine, same token, with no key or a wrong one: refused, nothing changes.
        for key in ("", "guess"):
            await _refused(reg.Register(pb.RegisterRequest(url=OTHER_URL, role=pb.ROLE_BOTH, worker_id="eng-a",
                                                           owner_key=key), timeout=5, metadata=md(ENGINE_1)),
                           grpc.StatusCode.ALREADY_EXISTS, "eng-a", "registered by another engine", "deregisters")
            await _refused(reg.Heartbeat(pb.HeartbeatRequest(worker_id="eng-a", running=999, waiting=999,
                                                             owner_key=key), timeout=5, metadata=md(ENGINE_1)),
                           grpc.StatusCode.PERMISSION_DENIED, "eng-a", "owner key")
            await _refused(reg.Deregister(pb.DeregisterRequest(worker_id="eng-a", owner_key=key), timeout=5,
                                          metadata=md(ENGINE_1)),
                           grpc.StatusCode.PERMISSION_DENIED, "eng-a")
        # The right key with another engine's token: still not the owner.
        await _refused(reg.Register(pb.RegisterRequest(url=OTHER_URL, role=pb.ROLE_BOTH, worker_id="eng-a",
                                                       owner_key="key-of-a"), timeout=5, metadata=md(ENGINE_2)),
                       grpc.StatusCode.ALREADY_EXISTS)
        await _refused(reg.Heartbeat(pb.HeartbeatRequest(worker_id="eng-a", running=999, owner_key="key-of-a"),
                                     timeout=5, metadata=md(ENGINE_2)), grpc.StatusCode.PERMISSION_DENIED)
        assert plane.fleet.get("eng-a") == spec and plane.fleet.engine("eng-a").running != 999

        # The owner: heartbeats, registers again (a new URL too), deregisters.
        assert (await reg.Heartbeat(pb.HeartbeatRequest(worker_id="eng-a", running=4, waiting=2,
                                                        owner_key="key-of-a"), timeout=5, metadata=md(ENGINE_1))).known
        assert (plane.fleet.engine("eng-a").running, plane.fleet.engine("eng-a").waiting) == (4, 2)
        mine.url = "http://127.0.0.1:13"
        assert (await reg.Register(mine, timeout=5, metadata=md(ENGINE_1))).owner_key == "key-of-a"
        assert plane.fleet.get("eng-a").url == "http://127.0.0.1:13"
        await reg.Deregister(pb.DeregisterRequest(worker_id="eng-a", owner_key="key-of-a"), timeout=5,
                             metadata=md(ENGINE_1))
        assert "eng-a" not in plane.fleet
        # Freed: another engine may have the id now. Without a key (a plugin older than owner
        # keys) the registration is bound to its token alone.
        keyless = pb.RegisterRequest(url=OTHER_URL, role=pb.ROLE_BOTH, worker_id="eng-a")
        r = await reg.Register(keyless, timeout=5, metadata=md(ENGINE_2))
        assert r.owner_key == "" and plane.fleet.get("eng-a").owner == "e2"
        await _refused(reg.Heartbeat(pb.HeartbeatRequest(worker_id="eng-a", running=999), timeout=5,
                                     metadata=md(ENGINE_1)),
                       grpc.StatusCode.PERMISSION_DENIED, "the token it registered with")
        await _refused(reg.Register(keyless, timeout=5, metadata=md(ENGINE_1)), grpc.StatusCode.ALREADY_EXISTS)
        moved = pb.RegisterRequest(url="http://127.0.0.1:14", role=pb.ROLE_BOTH, worker_id="eng-a")
        await _refused(reg.Register(moved, timeout=5, metadata=md(ENGINE_2)), grpc.StatusCode.ALREADY_EXISTS)
        assert (await reg.Heartbeat(pb.HeartbeatRequest(worker_id="eng-a", running=1), timeout=5,
                                    metadata=md(ENGINE_2))).known
        await reg.Register(keyless, timeout=5, metadata=md(ENGINE_2))          # the same engine again
        await reg.Deregister(pb.DeregisterRequest(worker_id="eng-a"), timeout=5, metadata=md(ENGINE_2))
        assert "eng-a" not in plane.fleet


def test_a_spec_from_before_owner_keys_stays_usable_by_its_engine():
    """Specs in Redis written by an older replica have no owner: their engine's heartbeats
    keep working, and it may claim the id again at the same URL, not from elsewhere."""
    from controlplane import ownership
    from controlplane.workers import WorkerSpec

    old = WorkerSpec(id="old", url="http://127.0.0.1:15", role=Role.BOTH, source="registry")
    assert ownership.may_change(old, "", "e1", "a heartbeat") is None
    assert ownership.may_register(old, "new-key", "e1", "http://127.0.0.1:15") is None
    refused = ownership.may_register(old, "new-key", "e1", OTHER_URL)
    assert refused is not None and refused.code == grpc.StatusCode.ALREADY_EXISTS
    configured = WorkerSpec(id="c", url="http://127.0.0.1:16", role=Role.BOTH)
    assert ownership.may_change(configured, "", "", "a heartbeat").code == grpc.StatusCode.PERMISSION_DENIED



async def test_ownership_is_shared_by_replicas_through_redis(redis_server):  # noqa: F811
    """The owner key lives in the spec: a replica that did not see the registration still
    knows the owner (heartbeats go to whichever replica answers)."""
    async with redis_replicas(redis_server.url, f"own-{uuid.uuid4().hex[:8]}:", heartbeat_ttl_s=30.0) as planes:
        a, b = planes
        async with grpc.aio.insecure_channel(f"127.0.0.1:{a.grpc_port}") as ca, \
                grpc.aio.insecure_channel(f"127.0.0.1:{b.grpc_port}") as cb:
            reg_a, reg_b = pb_grpc.RegistryStub(ca), pb_grpc.RegistryStub(cb)
            await reg_a.Register(pb.RegisterRequest(url="http://127.0.0.1:21", role=pb.ROLE_BOTH, worker_id="eng-r",
                                                    owner_key="key-r"), timeout=5)

            async def seen_by_b():
                return b.fleet.get("eng-r") is not None
            await wait_until(seen_by_b, what="the registration to reach the other replica")
            await _refused(reg_b.Register(pb.RegisterRequest(url=OTHER_URL, role=pb.ROLE_BOTH, worker_id="eng-r"),
                                          timeout=5), grpc.StatusCode.ALREADY_EXISTS, "eng-r")
            await _refused(reg_b.Heartbeat(pb.HeartbeatRequest(worker_id="eng-r", running=999), timeout=5),
                           grpc.StatusCode.PERMISSION_DENIED)
            assert (await reg_b.Heartbeat(pb.HeartbeatRequest(worker_id="eng-r", running=1, owner_key="key-r"),
                                          timeout=5)).known
            assert b.fleet.get("eng-r").url == "http://127.0.0.1:21"
            await reg_b.Deregister(pb.DeregisterRequest(worker_id="eng-r", owner_key="key-r"), timeout=5)
