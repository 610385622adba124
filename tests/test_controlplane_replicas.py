"""Control-plane replicas sharing a real Redis: one fleet, restarts, and Redis going away.

Replicas run in this process (their state can be inspected) against a real simulator
and a real redis-server; data planes talk to them over gRPC.
"""

from __future__ import annotations

import uuid


from controlplane.config import ControlPlaneConfig, StateConfig, WorkerSpec as WorkerConfig
from controlplane.server import ControlPlane
from controlplane.workers import Role
from dataplane.placement_client import PlacementClient
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


def _config(sim, redis, prefix: str) -> ControlPlaneConfig:
    return ControlPlaneConfig(listen="127.0.0.1:0", http_port=0,
                              workers=[WorkerConfig(url=sim.url, role=Role.BOTH, id="w")],
                              state=StateConfig(backend="redis", redis_url=redis.url, key_prefix=prefix))


async def _plane(sim, redis, prefix: str) -> ControlPlane:
    plane = ControlPlane(_config(sim, redis, prefix))
    await plane.start()
    return plane


def _entry(rid: str) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, leg=pb.LEG_ENTRY, prompt_tokens=10, max_tokens=5)


async def _cond(value) -> bool:
    return value


async def _requests(plane: ControlPlane, n: int) -> bool:
    return (await plane.store.loads(["w"]))["w"].requests == n


async def test_an_operators_change_on_one_replica_reaches_the_other_and_survives_restarts(sim_both, redis_persistent):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    a, b = await _plane(sim_both, redis_persistent, prefix), await _plane(sim_both, redis_persistent, prefix)
    try:
        await a.registry.update("w", draining=True, weight=3.0)
        await wait_until(lambda: _cond(b.fleet.get("w").draining and b.fleet.get("w").weight == 3.0),
                         what="the change on the other replica")
        assert (await b.placer.place(_entry("r1"))).error == pb.NO_HEALTHY_WORKER   # drained everywhere
    finally:
        await a.stop()
        await b.stop()
    # Every replica restarted: workers, weights and drain flags come back from Redis.
    c = await _plane(sim_both, redis_persistent, prefix)
    try:
        spec = c.fleet.get("w")
        assert spec.draining and spec.weight == 3.0
    finally:
        await c.stop()


async def test_load_placed_on_one_replica_is_seen_by_the_other(sim_both, redis_server):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    a, b = await _plane(sim_both, redis_server, prefix), await _plane(sim_both, redis_server, prefix)
    try:
        await wait_until(lambda: _cond(a.fleet.get("w") is not None and b.fleet.get("w") is not None),
                         what="both replicas know the worker")
        assert not (await a.placer.place(_entry("shared-1"), "s")).error
        # Each replica places from its copy of the loads, refreshed every loads_max_age_s
        # (the default): the other's charge and release show up within that and a round trip.
        await wait_until(lambda: _requests(b, 1), what="b sees a's charge")
        await b.lifecycle.report(pb.LifecycleEvent(request_id="shared-1", kind=pb.EVENT_FINISHED))
        await wait_until(lambda: _requests(a, 0), what="a sees b's release")
        assert await a.store.records() == []     # b ended the record a placed
    finally:
        await a.stop()
        await b.stop()


async def test_placement_goes_on_while_redis_is_away_and_recovers(sim_both, redis_persistent):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    plane = await _plane(sim_both, redis_persistent, prefix)
    client = PlacementClient(f"127.0.0.1:{plane.grpc_port}", "dp-redis-outage", timeout_s=5.0)
    await client.start()
    try:
        assert await client.wait_connected(10)
        await wait_until(lambda: _cond(plane.fleet.state("w").health.value == "healthy"), what="worker healthy")
        assert not (await client.place(_entry("before"))).error
        redis_persistent.stop()
        # Redis is gone: placements are still answered, from this replica's memory.
        during = [await client.place(_entry(f"during-{i}")) for i in range(5)]
        assert all(not p.error and p.decode.worker_id == "w" for p in during)
        assert not plane.store.available and plane.store.local_reservations == 5
        for i in range(5):
            client.report(pb.LifecycleEvent(request_id=f"during-{i}", kind=pb.EVENT_FINISHED))
        await wait_until(lambda: _cond(not plane.store._local_ids), what="the outage's requests released locally")
        redis_persistent.start()
        # Back: placements go through Redis again, and the earlier request is still there.
        await wait_until(lambda: _placed_shared(client, plane), timeout=20, what="placement through Redis again")
        assert plane.store.available
        client.report(pb.LifecycleEvent(request_id="before", kind=pb.EVENT_FINISHED))
    finally:
        await client.close()
        await plane.stop()


_n = iter(range(1_000_000))


async def _placed_shared(client: PlacementClient, plane: ControlPlane) -> bool:
    rid = f"after-{next(_n)}"
    placement = await client.place(_entry(rid))
    ok = not placement.error and rid not in plane.store._local_ids
    client.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED))
    return ok and plane.store.available
