"""Access control on the control plane's gRPC API (tokens) and the data plane (client API keys)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import grpc
import pytest

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import start_cluster, wait_until

ADMIN = "adm-secret-123"
REGISTRY = "reg-secret-456"


@pytest.fixture
async def secured_cp(sim_both):
    from controlplane.auth import AuthConfig
    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.server import ControlPlane
    from controlplane.workers import Role

    config = ControlPlaneConfig(
        http_port=0, listen="127.0.0.1:0", workers=[WorkerSpec(url=sim_both.url, role=Role.BOTH, id="w")],
        auth=AuthConfig(admin_tokens={"ops": ADMIN}, registry_tokens={"plugin": REGISTRY}))
    plane = ControlPlane(config)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


def _admin_calls():
    return [
        ("ListWorkers", pb.ListWorkersRequest()),
        ("AddWorker", pb.RegisterRequest(url="http://127.0.0.1:9", role=pb.ROLE_BOTH, worker_id="intruder")),
        ("Drain", pb.WorkerRef(worker_id="w")),
        ("Undrain", pb.WorkerRef(worker_id="w")),
        ("SetWeight", pb.SetWeightRequest(worker_id="w", weight=0.0)),
        ("RemoveWorker", pb.WorkerRef(worker_id="w")),
        ("Explain", pb.PlaceRequest(leg=pb.LEG_ENTRY, explain=True)),
        ("Stats", pb.StatsRequest()),
    ]


def test_every_admin_rpc_is_covered():
    names = {m.name for m in pb.DESCRIPTOR.services_by_name["Admin"].methods}
    assert names == {name for name, _ in _admin_calls()}


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", ADMIN),),
                                      (("authorization", f"Bearer {REGISTRY}"),)],
                         ids=["none", "wrong", "no-scheme", "registry-token"])
async def test_admin_rpcs_refuse_without_a_valid_token_and_change_nothing(secured_cp, metadata):
    spec_before = secured_cp.fleet.get("w")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{secured_cp.grpc_port}") as ch:
        admin = pb_grpc.AdminStub(ch)
        for name, req in _admin_calls():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(admin, name)(req, timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert ADMIN not in err.value.details()
    assert secured_cp.fleet.get("w") == spec_before and "intruder" not in secured_cp.fleet


async def test_admin_token_works_and_the_change_is_logged_with_its_name(secured_cp, caplog):
    caplog.set_level(logging.INFO, logger="controlplane.services")
    md = (("authorization", f"Bearer {ADMIN}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{secured_cp.grpc_port}") as ch:
        admin = pb_grpc.AdminStub(ch)
        resp = await admin.SetWeight(pb.SetWeightRequest(worker_id="w", weight=2.0), timeout=5, metadata=md)
        assert resp.worker.weight == 2.0
        stats = await admin.Stats(pb.StatsRequest(), timeout=5, metadata=md)
        assert stats.workers == 1
    lines = [r.getMessage() for r in caplog.records if "weight=2.0" in r.getMessage()]
    assert lines and "token ops" in lines[0] and "127.0.0.1" in lines[0]
    assert not any(ADMIN in r.getMessage() for r in caplog.records)


async def test_registry_needs_its_token(secured_cp):
    req = pb.RegisterRequest(url="http://127.0.0.1:9", role=pb.ROLE_DECODE, worker_id="plugged")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{secured_cp.grpc_port}") as ch:
        reg = pb_grpc.RegistryStub(ch)
        for call, r in ((reg.Register, req), (reg.Heartbeat, pb.HeartbeatRequest(worker_id="w")),
                        (reg.Deregister, pb.DeregisterRequest(worker_id="w"))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(r, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "plugged" not in secured_cp.fleet and "w" in secured_cp.fleet
        for token, wid in ((REGISTRY, "plugged"), (ADMIN, "plugged-by-ops")):   # admin tokens are valid everywhere
            req.worker_id = wid      # one id per token: a registration belongs to its token
            resp = await reg.Register(req, timeout=5, metadata=(("authorization", f"Bearer {token}"),))
            assert resp.worker_id == wid
        # the data planes' Scheduler stays open without dataplane_tokens
        models = await pb_grpc.SchedulerStub(ch).ListModels(pb.ListModelsRequest(), timeout=5)
        assert models is not None


async def test_dataplane_tokens_close_the_scheduler(sim_both):
    from controlplane.auth import AuthConfig
    from controlplane.config import ControlPlaneConfig
    from controlplane.server import ControlPlane

    plane = ControlPlane(ControlPlaneConfig(
        http_port=0, listen="127.0.0.1:0", auth=AuthConfig(dataplane_tokens={"dp": "dp-tok"})))
    await plane.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.grpc_port}") as ch:
            sched = pb_grpc.SchedulerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sched.ListModels(pb.ListModelsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await sched.ListModels(pb.ListModelsRequest(), timeout=5, metadata=(("authorization", "Bearer dp-tok"),))
            # admin stays open: only dataplane tokens are configured
            await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    finally:
        await plane.stop()


def test_tokens_from_file_and_environment(tmp_path):
    from controlplane.auth import AuthConfig
    from controlplane.config import ControlPlaneConfig

    f = tmp_path / "tokens"
    f.write_text("# scope name token\nadmin alice a-tok\nregistry vllm r-tok\n")
    cfg = ControlPlaneConfig.from_dict({"auth": {"tokens_file": str(f), "admin_tokens": ["bob:b-tok"]}})
    tokens = cfg.auth.resolved({"OMNI_DATAPLANE_TOKENS": "edge:d-tok"})
    assert tokens.who("admin", "a-tok") == "alice" and tokens.who("admin", "b-tok") == "bob"
    assert tokens.who("registry", "r-tok") == "vllm" and tokens.who("registry", "a-tok") == "alice"
    assert tokens.who("dataplane", "d-tok") == "edge" and tokens.who("admin", "r-tok") is None
    f.write_text("operator alice a-tok\n")
    with pytest.raises(ValueError, match="SCOPE NAME TOKEN"):
        AuthConfig(tokens_file=str(f)).resolved({})
    with pytest.raises(ValueError) as err:
        ControlPlaneConfig.from_dict({"auth": {"admin_tokens": ["has space-secret x"]}})
    assert "secret" not in str(err.value)


async def test_omni_ctl_sends_its_token(secured_cp):
    argv = [sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", f"127.0.0.1:{secured_cp.grpc_port}",
            "workers", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TOKEN"}
    import asyncio

    proc = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 7 and "UNAUTHENTICATED" in proc.stderr
    proc = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True,
                                   env={**env, "OMNI_TOKEN": ADMIN}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = await asyncio.to_thread(subprocess.run, argv[:6] + ["--token", ADMIN] + argv[6:], capture_output=True,
                                   text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ data plane: client API keys


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("# clients\nteam-a:key-aaa\nkey-bbb\n")
    return path


@pytest.fixture(scope="module")
def keyed(keys_file):
    c = start_cluster({"a": "both"}, dp_args=["--api-keys", str(keys_file), "--engine-api-key", "engine-key"])
    yield c
    c.group.close()


async def test_clients_without_a_valid_key_get_401(keyed, http):
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-aaa"}):
        for path in ("/v1/completions", "/v1/models"):
            method = http.post if path == "/v1/completions" else http.get
            async with method(keyed.url + path, json=body, headers=headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert err["code"] == 401 or err.get("type")
    await keyed.clear_sim_requests()
    for key in ("key-aaa", "key-bbb"):
        async with http.post(keyed.url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
    for path in ("/health", "/metrics"):
        async with http.get(keyed.url + path) as r:
            assert r.status == 200
    seen = await keyed.sim_requests("a")
    assert len(seen) == 2
    for req in seen:   # the engine sees the engine key, never the client's
        auth = {k.lower(): v for k, v in req["headers"].items()}.get("authorization")
        assert auth == "Bearer engine-key"


async def test_api_keys_are_reloaded_when_the_file_changes(keyed, keys_file, http):
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    keys_file.write_text("rotated:key-ccc\n")

    async def rotated() -> bool:
        async with http.post(keyed.url + "/v1/completions", json=body,
                             headers={"Authorization": "Bearer key-ccc"}) as r:
            return r.status == 200

    await wait_until(rotated, what="the new key accepted", timeout=10)
    async with http.post(keyed.url + "/v1/completions", json=body,
                         headers={"Authorization": "Bearer key-aaa"}) as r:
        assert r.status == 401


async def test_data_plane_sends_its_token_to_a_closed_scheduler(sim_both, http):
    """With [auth] dataplane_tokens, a data plane without the token gets no session; with it, it serves."""
    from omni_proxy.launcher import ProcessGroup

    group = ProcessGroup()
    try:
        cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                          "--worker", f"{sim_both.url},id=w", "--health-interval", "0.2"],
                         env={**os.environ, "OMNI_DATAPLANE_TOKENS": "edge:dp-secret"})
        good = group.start("dp-good", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                       "--controlplane-token", "dp-secret"])
        async with http.post(good.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi",
                                                                 "max_tokens": 1}) as r:
            assert r.status == 200
        bad = group.start("dp-bad", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                     "--placement-timeout", "0.5", "--fallback-after", "3600"])
        async with http.get(bad.url + "/health") as r:
            assert r.status == 503
    finally:
        group.close()


async def test_forward_client_auth_sends_the_clients_header_when_asked(http):
    c = start_cluster({"a": "both"}, dp_args=["--forward-client-auth", "--engine-api-key", "engine-key"])
    try:
        for headers, seen in (({"Authorization": "Bearer client-key"}, "Bearer client-key"),
                              ({}, "Bearer engine-key")):
            await c.clear_sim_requests()
            async with http.post(c.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi",
                                                                  "max_tokens": 1}, headers=headers) as r:
                assert r.status == 200
            (req,) = await c.sim_requests("a")
            assert {k.lower(): v for k, v in req["headers"].items()}.get("authorization") == seen
    finally:
        c.group.close()


@pytest.mark.parametrize("data,message", [
    ({"auth": {"admin_token": ["x"]}}, "unknown auth key"),
    ({"admin_tokens": ["x"]}, "belongs in [auth]"),
    ({"auth": {"admin_tokens": 5}}, "auth.admin_tokens"),
    ({"discovery": {"interval_s": -1}}, "discovery.interval_s"),
    ({"discovery": {"file": 3}}, "discovery.file"),
])
def test_auth_and_discovery_keys_are_checked(data, message):
    from controlplane.config import ControlPlaneConfig

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        ControlPlaneConfig.from_dict(data)
