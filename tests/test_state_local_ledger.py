"""The local ledger (``[state] ledger = "local"``, controlplane/state/local.py) against a real redis-server.

Its guarantees: placement never waits for Redis; replicas see each other's loads (within
the flush and refresh intervals); a dead replica's reservations vanish after its TTL;
while Redis is away placement goes on from this replica's ledger, and once Redis is back
(restarted empty or not) this replica's loads are published again. Behaviour parity with
MemoryStore is covered by tests/test_state_redis.py (its ``store`` fixture has it too).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from controlplane.config import ControlPlaneConfig, StateConfig, WorkerSpec as WorkerConfig
from controlplane.server import ControlPlane
from controlplane.state import Charge, RequestRecord, make_store
from controlplane.state.local import LocalLedgerStore
from controlplane.state.redis import RedisStore
from controlplane.workers import IDLE, Load, Role
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until
from tests.redis_fixtures import RedisServer


def _prefix() -> str:
    return f"l{random.getrandbits(32):08x}:"


def _local(server, prefix: str, *, ttl_s: float = 10.0, refresh_s: float = 0.02) -> LocalLedgerStore:
    return LocalLedgerStore(RedisStore(server.url, key_prefix=prefix, replica_ttl_s=ttl_s),
                            flush_interval_s=0.002, refresh_s=refresh_s, retry_s=0.05)


def _rec(rid: str) -> RequestRecord:
    return RequestRecord(request_id=rid, model="m", prompt_tokens=100, max_tokens=20, session="s1")


def _sees(store: LocalLedgerStore, wid: str, load: Load):
    async def cond() -> bool:
        return (await store.loads([wid]))[wid] == load
    return cond


async def test_replicas_see_each_others_loads_and_their_own_at_once(redis_server):
    prefix = _prefix()
    a, b = _local(redis_server, prefix), _local(redis_server, prefix)
    try:
        await a.reserve(_rec("a1"), (Charge("w", "aggregated", 10, 4),))
        assert (await a.loads(["w"]))["w"] == Load(1, 10, 4, 1)          # its own: at once
        await wait_until(_sees(b, "w", Load(1, 10, 4, 1)), timeout=5, what="b to see a's charge")
        await b.reserve(_rec("b1"), (Charge("w", "aggregated", 5),))
        await wait_until(_sees(a, "w", Load(2, 15, 4, 1)), timeout=5, what="a to see both charges")
        assert b.own_loads(["w"])["w"] == Load(1, 5, 0, 0) and (await b.get("a1")) is None   # records stay local
        await a.settle_prefill("a1")
        await a.end("a1")
        await b.end("b1")
        await wait_until(_sees(a, "w", IDLE), timeout=5, what="a to see zero")
        await wait_until(_sees(b, "w", IDLE), timeout=5, what="b to see zero")
    finally:
        await a.close()
        await b.close()


async def test_load_listeners_hear_every_change_of_the_total(redis_server):
    """As with MemoryStore, the fleet's least-loaded order follows the ledger: listeners get
    the total (this replica's and the others') when either changes."""
    prefix = _prefix()
    a, b = _local(redis_server, prefix), _local(redis_server, prefix)
    heard: dict[str, Load] = {}
    a.load_listeners.append(heard.__setitem__)
    try:
        assert (await a.loads(["w"]))["w"] == IDLE   # its first ledger call starts its sync
        await b.reserve(_rec("b1"), (Charge("w", "aggregated", 5),))

        async def heard_is(load: Load) -> bool:
            return heard.get("w") == load
        await wait_until(lambda: heard_is(Load(1, 5, 0, 0)), timeout=5, what="a's listener to hear b's charge")
        await a.reserve(_rec("a1"), (Charge("w", "aggregated", 10),))
        assert heard["w"] == Load(2, 15, 0, 0) == (await a.loads(["w"]))["w"]
        await b.end("b1")
        await wait_until(lambda: heard_is(Load(1, 10, 0, 0)), timeout=5, what="a's listener to hear b's release")
        await a.end("a1")
        assert heard["w"] == IDLE
    finally:
        await a.close()
        await b.close()


async def test_placement_never_waits_for_redis():
    """reserve/loads/end complete without suspending, even with Redis gone (a stalled
    Redis cannot hold a placement up)."""
    server = RedisServer(tcp=True).start()
    store = _local(server, _prefix())
    try:
        await store.sync_now()
        server.stop()
        for i in range(50):
            coro = store.reserve(_rec(f"r{i}"), (Charge("w", "aggregated", 1),))
            with pytest.raises(StopIteration):   # finished on its first step: no await suspended it
                coro.send(None)
        loads = store.loads(["w"])
        with pytest.raises(StopIteration) as done:
            loads.send(None)
        assert done.value.value["w"].requests == 50
    finally:
        await store.close()
        server.close()


async def test_a_dead_replicas_reservations_expire(redis_server):
    prefix = _prefix()
    a, b = _local(redis_server, prefix, ttl_s=0.5), _local(redis_server, prefix)
    try:
        await a.reserve(_rec("a1"), (Charge("w", "aggregated", 10),))
        await wait_until(_sees(b, "w", Load(1, 10, 0, 0)), timeout=5, what="b to see a's charge")
        # a stops without releasing anything (a crash: nothing refreshes its TTL any more)
        await a.close()
        assert (await b.loads(["w"]))["w"] == Load(1, 10, 0, 0)   # still alive as far as anyone knows
        await wait_until(_sees(b, "w", IDLE), timeout=5, what="a's charge to expire with it")
    finally:
        await a.close()
        await b.close()


async def test_redis_away_then_back_republishes_this_replicas_loads(redis_persistent):
    prefix = _prefix()
    a, b = _local(redis_persistent, prefix), _local(redis_persistent, prefix)
    try:
        await b.reserve(_rec("b1"), (Charge("w", "aggregated", 5),))
        await wait_until(_sees(a, "w", Load(1, 5, 0, 0)), timeout=5, what="a to see b's charge")
        redis_persistent.stop()
        for i in range(3):
            await a.reserve(_rec(f"a{i}"), (Charge("w", "aggregated", 10),))
        await a.end("a0")

        async def a_down() -> bool:
            return not a.available
        await wait_until(a_down, timeout=5, what="a to notice Redis is away")
        assert (await a.loads(["w"]))["w"] == Load(3, 25, 0, 0)   # its own, plus b's as last read
        redis_persistent.start()

        async def a_up() -> bool:
            return a.available
        await wait_until(a_up, timeout=10, what="a to be back on Redis")
        await wait_until(_sees(b, "w", Load(3, 25, 0, 0)), timeout=10, what="b to see what a placed meanwhile")
        assert a.outages == 1
    finally:
        await a.close()
        await b.close()


async def test_redis_losing_its_data_gets_this_replicas_loads_again(redis_server):
    """Redis lost the data without a failure this replica could see (emptied, or a failover
    to a replica that was behind) and nothing changed here since: the refresh finds this
    replica's hash missing and it is rewritten."""
    prefix = _prefix()
    a, b = _local(redis_server, prefix), _local(redis_server, prefix)
    try:
        await a.reserve(_rec("a1"), (Charge("w", "aggregated", 7),))
        await wait_until(_sees(b, "w", Load(1, 7, 0, 0)), timeout=5, what="b to see a's charge")
        key = f"{prefix}lload:{a.shared.replica_id}"
        await b.shared.redis.delete(key)

        async def rewritten() -> bool:
            return await b.shared.redis.hgetall(key) == {"w": "1 7 0 0"}
        await wait_until(rewritten, timeout=10, what="a's charge back in Redis")
        await wait_until(_sees(b, "w", Load(1, 7, 0, 0)), timeout=5, what="b to see it")
        assert a.available and b.own_loads(["w"])["w"] == IDLE
    finally:
        await a.close()
        await b.close()


async def test_concurrent_traffic_on_two_replicas_ends_at_zero(redis_server):
    prefix, workers = _prefix(), [f"w{i}" for i in range(4)]
    a, b = _local(redis_server, prefix), _local(redis_server, prefix)
    rng = random.Random(7)
    try:
        async def one(store: LocalLedgerStore, i: int) -> None:
            rid = f"{id(store)}-{i}"
            await store.reserve(_rec(rid), (Charge(rng.choice(workers), "aggregated", rng.randint(1, 100)),))
            await asyncio.sleep(rng.random() / 100)
            await store.end(rid)

        await asyncio.gather(*(one(s, i) for i in range(200) for s in (a, b)))

        async def zero() -> bool:
            seen = [await s.loads(workers) for s in (a, b)]
            return all(v == IDLE for loads in seen for v in loads.values())
        # (the views can be at zero before a's first flush on a loaded machine: wait for the
        # exchange itself, then for zero on both sides once it has happened)
        await wait_until(lambda: a.flushes > 0 and b.refreshes > 0, timeout=5, what="a flush and a refresh")
        await wait_until(zero, timeout=5, what="every load back to zero on both replicas")
    finally:
        await a.close()
        await b.close()


def test_config_selects_the_local_ledger():
    cfg = ControlPlaneConfig.from_dict({"state": {"backend": "redis", "redis_url": "unix:///tmp/r.sock",
                                                  "ledger": "local", "flush_interval_s": 0.01,
                                                  "loads_max_age_s": 0.2, "replica_ttl_s": 4}})
    store = make_store(cfg)
    assert isinstance(store, LocalLedgerStore) and store.flush_interval_s == 0.01 and store.refresh_s == 0.2
    assert store.shared.replica_ttl_ms == 4000
    assert make_store(ControlPlaneConfig.from_dict({"state": {"backend": "redis", "ledger": "local"}})).refresh_s \
        == 0.05
    for bad, words in (({"ledger": "mine"}, ["state.ledger", "shared, local"]),
                       ({"flush_interval_s": 0}, ["state.flush_interval_s"]),
                       ({"flush_interval_s": 5}, ["state.flush_interval_s"])):
        with pytest.raises(ValueError) as err:
            ControlPlaneConfig.from_dict({"state": bad})
        assert all(w in str(err.value) for w in words), str(err.value)


async def test_control_plane_replicas_share_loads_through_the_local_ledger(sim_both, redis_server):
    prefix = _prefix()

    def config() -> ControlPlaneConfig:
        return ControlPlaneConfig(listen="127.0.0.1:0", http_port=0,
                                  workers=[WorkerConfig(url=sim_both.url, role=Role.BOTH, id="w")],
                                  state=StateConfig(backend="redis", redis_url=redis_server.url, key_prefix=prefix,
                                                    ledger="local", flush_interval_s=0.002, loads_max_age_s=0.02))
    a, b = ControlPlane(config()), ControlPlane(config())
    await a.start()
    await b.start()
    try:
        req = pb.PlaceRequest(request_id="p1", leg=pb.LEG_ENTRY, prompt_tokens=10, max_tokens=5)
        assert not (await a.placer.place(req, "s")).error
        await wait_until(_sees(b.store, "w", Load(1, 15, 10, 1)), timeout=5, what="b to see a's placement")
        await a.lifecycle.report(pb.LifecycleEvent(request_id="p1", kind=pb.EVENT_FINISHED))
        await wait_until(_sees(b.store, "w", IDLE), timeout=5, what="b to see it released")
    finally:
        await a.stop()
        await b.stop()


async def test_a_control_plane_on_the_local_ledger_places_through_a_redis_outage(sim_both, redis_persistent):
    from dataplane.placement_client import PlacementClient

    prefix = _prefix()
    state = StateConfig(backend="redis", redis_url=redis_persistent.url, key_prefix=prefix, ledger="local",
                        flush_interval_s=0.002, loads_max_age_s=0.02)
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", http_port=0, state=state, workers=[
        WorkerConfig(url=sim_both.url, role=Role.BOTH, id="w")]))
    await plane.start()
    other = _local(redis_persistent, prefix)
    client = PlacementClient(f"127.0.0.1:{plane.grpc_port}", "dp-local-outage", timeout_s=5.0)
    await client.start()
    try:
        assert await client.wait_connected(10)

        async def healthy() -> bool:
            return plane.fleet.state("w").health.value == "healthy"
        await wait_until(healthy, what="worker healthy")
        redis_persistent.stop()
        placed = [await client.place(pb.PlaceRequest(request_id=f"d{i}", leg=pb.LEG_ENTRY, prompt_tokens=10,
                                                     max_tokens=5)) for i in range(4)]
        assert all(not p.error and p.decode.worker_id == "w" for p in placed)

        async def degraded() -> bool:
            return not plane.store.available
        await wait_until(degraded, timeout=5, what="the replica to notice the outage")
        client.report(pb.LifecycleEvent(request_id="d0", kind=pb.EVENT_FINISHED))
        redis_persistent.start()
        await wait_until(_sees(other, "w", Load(3, 45, 30, 3)), timeout=15,
                         what="another replica to see what was placed during the outage")
        assert plane.store.available
    finally:
        await client.close()
        await other.close()
        await plane.stop()
