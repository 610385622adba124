"""KV-index snapshots in Redis (controlplane/kvcache/persist.py): a restarted control plane
answers with the same predicted hits, with a real redis-server and in-process control planes."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
import uuid

import pytest

from controlplane.config import ControlPlaneConfig, StateConfig, WorkerSpec as WorkerConfig
from controlplane.kvcache.events import BlockStored
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.kvcache import persist
from controlplane.server import ControlPlane
from controlplane.workers import Role
from protos import omni_proxy_pb2 as pb
from tests.conftest import cancel_until_done, wait_until
from tests.ports import reserved_port

BS = 16


def _config(sim, redis, prefix: str, *, workers=("w", "e"), interval: float = 0.2, backend: str = "redis"):
    port = reserved_port()
    specs = {"w": WorkerConfig(url=sim.url, role=Role.BOTH, id="w"),
             # an event-fed worker: nothing publishes there, its index is fed by hand
             "e": WorkerConfig(url=sim.url + "/", role=Role.BOTH, id="e", kv_events=f"tcp://127.0.0.1:{port}")}
    cfg = ControlPlaneConfig(
        http_port=0, listen="127.0.0.1:0", workers=[specs[w] for w in workers], policy="cache_aware",
        state=StateConfig(backend=backend, redis_url=redis.url if redis else "", key_prefix=prefix))
    cfg.kv_cache.snapshot_interval_s = interval
    cfg.kv_cache.block_size = BS
    return cfg


def _chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def _stored(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=BS)


def _match_of(explanation: str) -> list[str]:
    return re.findall(r"match=\d+/\d+blk", explanation)


async def _feed(plane: ControlPlane, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Event-fed blocks on "e" (ranks 0 and 1), routed chains to "w" through placement."""
    exact_chains = [_chain(rng, 20) for _ in range(5)]
    for i, c in enumerate(exact_chains):
        plane.kv.exact.apply("e", i % 2, [_stored(c[:12]), _stored(c[12:], c[11])])
    routed = _chain(rng, 30)
    for i in range(3):
        p = await plane.placer.place(pb.PlaceRequest(request_id=f"r{i}-{uuid.uuid4().hex[:6]}", leg=pb.LEG_ENTRY,
                                                     prompt_tokens=30 * BS, max_tokens=4,
                                                     block_hashes=routed[:10 * (i + 1)]))
        assert not p.error, p
    return exact_chains, routed


async def _answers(plane: ControlPlane, chains: list[list[int]]) -> tuple[list[dict], list[list[str]]]:
    specs = plane.fleet.specs()
    matches = [plane.kv.match(c, specs) for c in chains]
    dry = []
    for c in chains:
        p = await plane.placer.place(pb.PlaceRequest(request_id="dry", leg=pb.LEG_ENTRY, prompt_tokens=len(c) * BS,
                                                     max_tokens=4, block_hashes=c), dry_run=True)
        dry.append(_match_of(p.explanation))
    return matches, dry


async def test_a_restarted_control_plane_has_the_same_predicted_hits(sim_both, redis_server):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rng = random.Random(1)
    a = ControlPlane(_config(sim_both, redis_server, prefix))
    await a.start()
    try:
        exact_chains, routed = await _feed(a, rng)
        probes = exact_chains + [routed, routed[:15], exact_chains[0][:5] + [1, 2]]
        before = await _answers(a, probes)
        assert before[0][0] == {"e": 20} and before[0][5] == {"w": 30}
        # routed[:15] shares 15 blocks with routed[:20], whose marks are at 16 and 20: the end of
        # routed[:10] is the deepest mark it reaches (kvcache/routed.py, at most 15 blocks short)
        assert before[0][6] == {"w": 10}
        # the periodic writer runs on its own
        async def written() -> bool:
            return a.kv_snapshots.writes >= 1 and a.kv_snapshots.last_bytes > 0
        await wait_until(written, timeout=10, what="a periodic KV snapshot")
    finally:
        await a.stop()
    b = ControlPlane(_config(sim_both, redis_server, prefix))
    await b.start()
    try:
        after = await _answers(b, probes)
        assert after == before
        assert b.kv.exact.blocks_by_worker() == {"e": 100}
    finally:
        await b.stop()


async def test_a_removed_worker_is_not_loaded(sim_both, redis_server):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rng = random.Random(2)
    a = ControlPlane(_config(sim_both, redis_server, prefix))
    await a.start()
    try:
        exact_chains, routed = await _feed(a, rng)
    finally:
        await a.stop()
    # the next control plane's fleet has "w" only ("e" was removed from the config and the store)
    from controlplane.state.redis import RedisStore
    store = RedisStore(redis_server.url, key_prefix=prefix)
    await store.remove_spec("e")
    await store.close()
    b = ControlPlane(_config(sim_both, redis_server, prefix, workers=("w",)))
    await b.start()
    try:
        assert b.fleet.get("e") is None
        assert b.kv.exact.size() == 0 and b.kv.exact.workers() == []
        assert b.kv.match(routed, b.fleet.specs()) == {"w": 30}
    finally:
        await b.stop()


async def test_a_corrupt_snapshot_is_ignored_with_one_log_line(sim_both, redis_server, caplog):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    a = ControlPlane(_config(sim_both, redis_server, prefix))
    await a.start()
    try:
        await _feed(a, random.Random(3))
        rid = a.store.replica_id
    finally:
        await a.stop()
    import redis.asyncio as aioredis
    r = aioredis.Redis.from_url(redis_server.url)
    blob = await r.get(f"{prefix}kv:snap:{rid}")
    await r.set(f"{prefix}kv:snap:{rid}", blob[:-9] + b"\x00" * 9)     # flipped bytes: bad checksum
    await r.aclose()
    caplog.set_level(logging.INFO, logger="controlplane.kvcache.persist")
    b = ControlPlane(_config(sim_both, redis_server, prefix))
    await b.start()
    try:
        lines = [r for r in caplog.records if r.name == "controlplane.kvcache.persist"]
        assert len(lines) == 1 and "ignored" in lines[0].getMessage(), [r.getMessage() for r in lines]
        assert b.kv.exact.size() == 0 and b.kv.approx.size() == 0
    finally:
        await b.stop()


async def test_memory_store_writes_no_snapshots(sim_both):
    plane = ControlPlane(_config(sim_both, None, "", backend="memory"))
    await plane.start()
    try:
        assert plane.kv_snapshots is None
    finally:
        await plane.stop()


async def test_the_subscriber_resumes_from_the_saved_sequence():
    """A loaded snapshot hands each rank's last seq to its subscriber when it can replay."""
    from controlplane.workers import WorkerSpec
    kv = KVCache(KVCacheConfig(block_size=BS))
    header = {"ts": time.time(), "buckets": [], "hashing": persist.hashing_of(kv),
              "seqs": {"e": {"0": {"": 41}}, "gone": {"0": {"": 7}}}}
    e = WorkerSpec(id="e", url="http://x", role=Role.BOTH, model="m", kv_events=f"tcp://127.0.0.1:{reserved_port()}",
                   kv_replay=f"tcp://127.0.0.1:{reserved_port()}")
    persist.load(kv, header, [], [e])
    assert kv.resume_seqs == {("e", 0): {b"": 41}}
    await kv.watch(e)
    try:
        assert kv.event_seqs()["e"][0] == {b"": 41}
    finally:
        await kv.stop()


async def test_dump_and_load_round_trip_keeps_routing_age():
    kv = KVCache(KVCacheConfig(block_size=BS, approx_ttl_s=100.0))
    from controlplane.workers import WorkerSpec
    w = WorkerSpec(id="w", url="http://x", role=Role.BOTH, model="m")
    rng = random.Random(4)
    chain = _chain(rng, 8)
    kv.placed(w, chain, 0)
    blob = await persist.dump(kv)
    header, runs = persist.parse(blob)
    fresh = KVCache(KVCacheConfig(block_size=BS, approx_ttl_s=100.0))
    persist.load(fresh, header, runs, [w], now=header["ts"] + 50)
    assert fresh.match(chain, [w]) == {"w": 8}
    start = fresh.routed.expiry[0][1]
    assert abs((time.monotonic() - start) - 50) < 1.0          # it keeps its age: 50 s left
    too_old = KVCache(KVCacheConfig(block_size=BS, approx_ttl_s=100.0))
    persist.load(too_old, header, runs, [w], now=header["ts"] + 150)
    assert too_old.match(chain, [w]) == {}
    with pytest.raises(persist.CorruptSnapshot):
        persist.parse(blob[:20])


async def test_snapshots_of_gone_replicas_are_pruned_and_other_hashing_is_not_loaded(redis_server):
    from controlplane.state.redis import RedisStore
    from controlplane.workers import WorkerSpec
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    w = WorkerSpec(id="w", url="http://x", role=Role.BOTH, model="m")
    old_store = RedisStore(redis_server.url, key_prefix=prefix, replica_id="old")
    new_store = RedisStore(redis_server.url, key_prefix=prefix, replica_id="new")
    kv = KVCache(KVCacheConfig(block_size=BS))
    kv.placed(w, _chain(random.Random(5), 4), 0)
    old = persist.KVSnapshots(kv, old_store, 1.0)
    new = persist.KVSnapshots(kv, new_store, 1.0)
    try:
        assert await old.save() > 0
        # the same index under another block size: refused, and nothing else to load
        other = persist.KVSnapshots(KVCache(KVCacheConfig(block_size=BS * 2)), new_store, 1.0)
        assert await other.load_newest([w]) is None and other.kv.approx.size() == 0
        await other.close(final=False)
        await new_store.heartbeat()          # "new" is alive; "old" never heart-beat: gone
        assert await new.save() > 0
        assert await new.redis.zrange(f"{prefix}kv:snaps", 0, -1) == [b"new"]
        assert await new.redis.exists(f"{prefix}kv:snap:old") == 0
        assert await new.save() == 0         # unchanged: not written again
    finally:
        await old.close(final=False)
        await new.close(final=False)
        await old_store.close()
        await new_store.close()


async def test_after_a_restart_the_subscriber_replays_what_the_snapshot_missed(redis_server):
    """A real ZMQ publisher and replay server: events sent while no control plane ran are
    replayed from the snapshot's sequence number, on top of the loaded entries."""
    import zmq
    import zmq.asyncio
    from controlplane.state.redis import RedisStore
    from controlplane.workers import WorkerSpec
    from tests.test_kvcache_subscriber import Publisher, ReplayServer, batch, stored_map

    async def subscribed(pub) -> None:
        while True:                       # skip the stopped subscriber's unsubscription
            assert await pub.sock.poll(5000), "subscriber never subscribed"
            if (await pub.sock.recv())[:1] == b"\x01":
                return

    async def until(cond, what: str) -> None:
        deadline = time.monotonic() + 5
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.005)

    ctx = zmq.asyncio.Context.instance()
    pub = Publisher(ctx, topic=b"")
    # Every subscription reaches the test, also the second one while the first subscriber's
    # unsubscription is still in flight (XPUB passes on only new topics by default).
    pub.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    rs = ReplayServer(ctx, pub, with_topic=False)
    e = WorkerSpec(id="e", url="http://x", role=Role.BOTH, model="m", kv_events=pub.endpoint, kv_replay=rs.endpoint)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.url, key_prefix=prefix, replica_id="a")
    kv1 = KVCache(KVCacheConfig(block_size=BS))
    snaps1 = persist.KVSnapshots(kv1, store, 1.0)
    kv2 = KVCache(KVCacheConfig(block_size=BS))
    snaps2 = persist.KVSnapshots(kv2, store, 1.0)
    try:
        await kv1.watch(e)
        await subscribed(pub)
        await pub.send(batch(stored_map([1, 2])))
        await pub.send(batch(stored_map([3], parent=2)))
        await until(lambda: kv1.match([1, 2, 3], [e]) == {"e": 3}, "the first events")
        await snaps1.save()
        await kv1.stop()
        await pub.send(batch(stored_map([4], parent=3)), drop=True)     # nobody listens
        assert await snaps2.load_newest([e]) == "a"
        assert kv2.match([1, 2, 3, 4], [e]) == {"e": 3}                  # warm before any event
        await kv2.watch(e)
        await subscribed(pub)
        await pub.send(batch(stored_map([5], parent=4)))
        await until(lambda: kv2.match([1, 2, 3, 4, 5], [e]) == {"e": 5}, "the replayed and the new event")
        assert rs.requests == [2]                                        # from the saved seq, not from 0
        assert kv2.counters()["e"]["resets"] == 0
    finally:
        await kv1.stop()
        await kv2.stop()
        await snaps1.close(final=False)
        await snaps2.close(final=False)
        await store.close()
        await rs.close()
        pub.close()


async def test_close_stops_the_writer_wherever_the_cancel_lands(redis_server):
    """close() ends the periodic writer at any point of its loop, also when the cancel lands
    inside a Redis call that swallows it: redis-py sends under asyncio.wait_for (the client has
    a socket timeout), which before Python 3.12 returns normally when the cancel arrives just
    after the send finished. A writer that ended only on CancelledError then ran forever and
    ControlPlane.stop() never returned. Each round lets the writer run one more loop step
    before closing, so the rounds sweep the cancel across every await of a write."""
    from controlplane.state.redis import RedisStore
    from controlplane.workers import WorkerSpec
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.url, key_prefix=prefix, replica_id="a")
    kv = KVCache(KVCacheConfig(block_size=BS))
    kv.placed(WorkerSpec(id="w", url="http://x", role=Role.BOTH, model="m"), _chain(random.Random(6), 64), 0)
    try:
        for steps in range(160):
            snaps = persist.KVSnapshots(kv, store, 0.0)     # interval 0: writes back to back
            snaps.start()
            for _ in range(steps):
                await asyncio.sleep(0)
            writer = snaps._task
            closing = asyncio.ensure_future(snaps.close(final=False))
            done, _ = await asyncio.wait({closing}, timeout=10)
            if not done:
                await cancel_until_done(writer)
                closing.cancel()
                await asyncio.gather(closing, return_exceptions=True)
                await snaps.redis.aclose()
                pytest.fail(f"close() did not return: the writer outlived its cancel (after {steps} loop steps)")
            closing.result()
            assert writer.done()
    finally:
        await store.close()
