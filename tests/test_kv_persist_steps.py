"""The KV-index snapshot's copy in steps (controlplane/kvcache/persist.py): the dump never copies
more than a chunk of entries (plus one shard) between two turns of the event loop, and takes the
same snapshot as a copy in one step when nothing changes meanwhile."""

from __future__ import annotations

import asyncio
import random

from controlplane.kvcache import persist
from controlplane.kvcache.events import BlockStored
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.workers import Role, WorkerSpec

BS = 16


def _kv(blocks: int, rng: random.Random) -> tuple[KVCache, list[WorkerSpec]]:
    kv = KVCache(KVCacheConfig(block_size=BS, approx_ttl_s=100.0, max_blocks=1 << 17))
    for i in range(blocks // 100):                 # event-fed blocks on two ranks of "e"
        chain = tuple(rng.getrandbits(64) for _ in range(100))
        kv.exact.apply("e", i % 2, [BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=(),
                                                block_size=BS)])
    w = WorkerSpec(id="w", url="http://x", role=Role.BOTH, model="m")
    e = WorkerSpec(id="e", url="http://y", role=Role.BOTH, model="m", kv_events="tcp://127.0.0.1:1")
    for _ in range(blocks // 400):                 # routed chains to "w"
        kv.placed(w, [rng.getrandbits(64) for _ in range(400)], 0)
    return kv, [w, e]


class _Watched(list):
    """An index's shard list that notes, per shard read, how many loop turns had run."""

    def __init__(self, shards, turns: list[int], reads: list[tuple[int, int]]) -> None:
        super().__init__(shards)
        self.turns, self.reads = turns, reads

    def __iter__(self):
        for shard in super().__iter__():
            self.reads.append((self.turns[0], len(shard)))
            yield shard


async def test_the_copy_yields_to_the_loop_every_chunk():
    kv, _ = _kv(120_000, random.Random(1))
    assert kv.exact.size() == 120_000 and len(kv.exact._shards) >= 16
    turns = [0]
    reads: list[tuple[int, int]] = []
    for index in (kv.exact, kv.approx):
        index._shards = _Watched(index._shards, turns, reads)
    stop = False

    async def ticker() -> None:
        while not stop:
            turns[0] += 1
            await asyncio.sleep(0)
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    chunk = 8192
    try:
        await persist.dump(kv, chunk=chunk)
    finally:
        stop = True
        await task
    per_turn: dict[int, int] = {}
    for turn, n in reads:
        per_turn[turn] = per_turn.get(turn, 0) + n
    biggest_shard = max(n for _, n in reads)
    assert sum(n for _, n in reads) == kv.exact.size() + kv.approx.size()
    assert len(per_turn) >= (kv.exact.size() + kv.approx.size()) // (chunk + biggest_shard)
    assert max(per_turn.values()) < chunk + biggest_shard, max(per_turn.values())


async def test_a_copy_in_steps_is_the_same_snapshot_as_in_one():
    kv, specs = _kv(60_000, random.Random(2))
    one = persist.parse(await persist.dump(kv, chunk=1 << 30, now=1000.0))
    steps = persist.parse(await persist.dump(kv, chunk=512, now=1000.0))
    for (h1, r1), (h2, r2) in ((one, steps),):
        assert {k: v for k, v in h1.items() if k != "buckets"} == {k: v for k, v in h2.items() if k != "buckets"}
        assert [(k, w, rank, b, a.tolist()) for k, w, rank, b, a in r1] == \
               [(k, w, rank, b, a.tolist()) for k, w, rank, b, a in r2]
    fresh = KVCache(KVCacheConfig(block_size=BS, approx_ttl_s=100.0, max_blocks=1 << 17))
    persist.load(fresh, *steps, specs, now=1000.0)
    assert fresh.exact.size() == kv.exact.size() and fresh.approx.size() == kv.approx.size()


async def test_a_slot_freed_during_the_copy_is_copied_again_in_one_step():
    """Another worker may take a freed slot's bit: entries copied before the free would be
    read as its blocks. The index is then copied again at once, with the owners of then."""
    kv, specs = _kv(40_000, random.Random(3))
    exact = kv.exact
    shards = exact._shards
    dropped = [False]

    class _Dropping(list):
        def __iter__(self):
            for i, shard in enumerate(super().__iter__()):
                if i == len(self) // 2 and not dropped[0]:
                    dropped[0] = True
                    exact.drop_worker("e", 1)       # (in the middle of the copy)
                yield shard
    exact._shards = _Dropping(shards)
    header, runs = persist.parse(await persist.dump(kv, chunk=1024, now=1000.0))
    exact._shards = shards
    assert dropped[0]
    exact_runs = [(w, rank) for kind, w, rank, _, _ in runs if kind == "e"]
    assert ("e", 1) not in exact_runs and ("e", 0) in exact_runs
    assert sum(len(a) for kind, _, _, _, a in runs if kind == "e") == exact.size()
