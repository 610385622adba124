"""Routed and pending chains recorded as sparse marks (``KVCacheConfig.routed_stride``,
controlplane/kvcache/routed.py): every K-th block and the chain's last one.

What is promised: routing a chain costs n / K + 1 entries; a walk finds, per worker, at most
K - 1 blocks fewer than the every-block index fed the same routings and never more; a prompt that
repeats or extends a routed chain (the next turn) matches all of it; expiry and the cap work as
before, in marks.
"""

from __future__ import annotations

import random

import pytest

from controlplane.kvcache import persist
from controlplane.kvcache.index import RoutedIndex
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.kvcache.routed import RoutingMemory
from tests.test_dp_ranks import entry, placer_of, spec

K = 16


def wid(i: int) -> str:
    return f"w{i:02d}"


def reference_depth(idx: RoutedIndex, chain: list[int], worker: str) -> int:
    """The marks read linearly: the leading run of held depths K, 2K, ..., then the deepest held
    mark in the K - 1 depths after it."""
    slot = idx._slot_of.get((worker, 0))
    if slot is None:
        return 0
    bit = 1 << (slot + idx._shift)
    held = lambda d: bool(idx._held(chain[d - 1]) & bit)   # noqa: E731
    k, n = idx.stride, len(chain)
    base = 0
    while base + k <= n and held(base + k):
        base += k
    for d in range(min(base + k - 1, n), base, -1):
        if held(d):
            return d
    return base


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_strided_depths_are_within_stride_of_every_block_and_never_deeper(seed):
    rng = random.Random(seed)
    trunks = [[rng.getrandbits(64) for _ in range(120)] for _ in range(4)]
    chains = [t[:rng.randrange(1, 120)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 60))]
              for t in trunks for _ in range(6)]
    dense, sparse = RoutedIndex(), RoutedIndex(stride=K)
    queued: dict[int, list[tuple[int, list, list]]] = {}
    order: list[int] = []
    bucket = 0
    for step in range(1500):
        if rng.random() < 0.05:
            bucket += 1
        chain = rng.choice(chains)
        cut = chain[:rng.randrange(1, len(chain) + 1)]
        w = wid(rng.randrange(10))
        # each index is told what its own walk found there, as placement does
        held_d = max(dense.match_depths(cut, [(w, 0)]).values(), default=0)
        held_s = max(sparse.match_depths(cut, [(w, 0)]).values(), default=0)
        changed_d = dense.route((w, 0), cut, bucket, held=held_d)
        changed_s = sparse.route((w, 0), cut, bucket, held=held_s)
        if bucket not in queued:
            queued[bucket] = []
            order.append(bucket)
        queued[bucket].append((bucket, changed_d, changed_s))
        if rng.random() < 0.03 and order:               # oldest bucket first, as RoutingMemory expires
            b = order.pop(0)
            for _, cd, cs in queued.pop(b):
                dense.expire(cd, b)
                sparse.expire(cs, b)
        if rng.random() < 0.005:
            gone = wid(rng.randrange(10))
            dense.drop_worker(gone)
            sparse.drop_worker(gone)
        if step % 10 == 0:
            workers = [wid(i) for i in rng.sample(range(10), rng.randrange(1, 11))]
            alive = sparse.mask_of(workers)
            for probe in rng.sample(chains, 4):
                probe = probe[:rng.randrange(1, len(probe) + 1)] + ([rng.getrandbits(64)] if rng.random() < 0.5 else [])
                got = sparse.depths(probe, alive)
                want = dense.depths(probe, dense.mask_of(workers))
                for x in workers:
                    g, d = got.get(x, 0), want.get(x, 0)
                    assert g == reference_depth(sparse, probe, x)
                    assert d - (K - 1) <= g <= d, (x, g, d)


def test_a_long_chain_costs_a_mark_every_stride_blocks_and_its_end():
    idx = RoutedIndex(stride=K)
    chain = list(range(1, 1301))
    changed = idx.route(("a", 0), chain, stamp=1)
    assert len(changed) == idx.size() == 1300 // K + 1 == 82
    assert idx.route(("a", 0), chain, stamp=1, held=1300) == []          # same bucket: nothing
    assert idx.match_depths(chain) == {("a", 0): 1300}
    assert idx.match_depths(chain[:1000] + [0]) == {("a", 0): 992}       # the last multiple of 16
    assert idx.match_depths(chain[:7]) == {}                             # under one stride: none
    assert idx.stats().stored == 2600 and idx.blocks_by_worker() == {"a": 82 * K}


def test_a_follow_up_matches_its_predecessor_exactly():
    idx = RoutedIndex(stride=K)
    turn1 = list(range(1, 38))                    # 37 blocks: marks at 16, 32 and 37
    idx.route(("a", 0), turn1, stamp=1)
    idx.route(("b", 0), turn1[:20], stamp=1)      # another worker holds a shorter prefix of it
    turn2 = turn1 + list(range(500, 550))
    assert idx.match_depths(turn2) == {("a", 0): 37, ("b", 0): 20}
    assert idx.match_depths(turn1) == {("a", 0): 37, ("b", 0): 20}


def test_strided_marks_expire_by_bucket_unless_routed_again():
    mem = RoutingMemory(ttl_s=16.0, max_blocks=10_000, stride=K)
    a, b = ("a", 0), ("b", 0)
    chain = list(range(1, 101))
    mem.route(a, chain, now=0.0)
    mem.route(b, chain[:40], now=8.0)             # its marks at 16 and 32 are routed again
    mem.expire(now=10.0)
    assert mem.index.match_depths(chain) == {a: 100, b: 40}
    mem.expire(now=16.5)                          # a's routing is over; b's refreshed marks stay
    assert mem.index.match_depths(chain) == {a: 32, b: 40}
    mem.expire(now=24.5)
    assert mem.index.size() == 0 and mem.index.stats().block_refs == 0


def test_the_cap_counts_marks_and_drops_the_oldest_buckets_first():
    mem = RoutingMemory(ttl_s=3600.0, max_blocks=1000, stride=K)
    rng = random.Random(5)
    chains = [[rng.getrandbits(64) for _ in range(160)] for _ in range(300)]   # 10 marks each
    for i, chain in enumerate(chains):
        mem.route(("a", 0), chain, now=float(i * 300))    # 1,000 marks would take 100 chains
        assert mem.index.size() <= 1000
    assert mem.index.size() > 900
    assert mem.index.match_depths(chains[0]) == {}
    assert mem.index.match_depths(chains[-1]) == {("a", 0): 160}


async def test_a_follow_up_turn_lands_on_its_predecessors_worker_with_long_prompts():
    for kv_events in (False, True):               # approximate mode, and pending before any event
        extra = {"kv_events": "tcp://x:1"} if kv_events else {}
        placer, _, _ = await placer_of(*[spec(w, **extra) for w in "abcd"], policy="cache_aware")
        rng = random.Random(7)
        turn1 = [rng.getrandbits(64) for _ in range(1301)]
        first = (await placer.place(entry("t1", turn1, tokens=16 * len(turn1)))).decode.worker_id
        for i in range(6):                        # other prompts in between spread by load
            other = [rng.getrandbits(64) for _ in range(300)]
            await placer.place(entry(f"n{i}", other, tokens=16 * len(other)))
        turn2 = turn1 + [rng.getrandbits(64) for _ in range(40)]
        p = await placer.place(entry("t2", turn2, tokens=16 * len(turn2)))
        assert p.decode.worker_id == first
        assert placer.stats.predicted_hit_blocks[first] == 1301          # all of turn 1, exactly


async def test_snapshots_keep_marks_and_refuse_another_strides():
    w = spec("w")
    rng = random.Random(9)
    chain = [rng.getrandbits(64) for _ in range(50)]
    kv = KVCache(KVCacheConfig(approx_ttl_s=100.0))
    kv.placed(w, chain, 0)
    header, runs = persist.parse(await persist.dump(kv))
    same = KVCache(KVCacheConfig(approx_ttl_s=100.0))
    persist.load(same, header, runs, [w], now=header["ts"])
    assert same.match(chain + [1], [w]) == {"w": 50} and same.approx.size() == kv.approx.size() == 4
    other = KVCache(KVCacheConfig(approx_ttl_s=100.0, routed_stride=8))
    persist.load(other, header, runs, [w], now=header["ts"])
    assert other.approx.size() == 0                                       # would be misread
    dense = KVCache(KVCacheConfig(approx_ttl_s=100.0, routed_stride=1))   # every block: fits any stride
    dense.placed(w, chain, 0)
    header, runs = persist.parse(await persist.dump(dense))
    persist.load(other, header, runs, [w], now=header["ts"])
    assert other.match(chain[:45] + [1], [w]) == {"w": 45}


class _CountingDict(dict):
    """A shard that counts the walk's probes (``get``)."""

    probes = 0

    def get(self, key, default=None):
        _CountingDict.probes += 1
        return super().get(key, default)


def _counting(idx: RoutedIndex) -> RoutedIndex:
    idx._shards = [_CountingDict() for _ in idx._shards]
    return idx


def test_ends_are_searched_for_only_after_a_mark_a_chain_ended_after():
    idx = _counting(RoutedIndex(stride=K))
    chain = list(range(1, 129))                   # 128 blocks: it ends on a mark
    idx.route(("a", 0), chain, stamp=1)
    prompt = chain[:40] + [9999]
    _CountingDict.probes = 0
    assert idx.match_depths(prompt) == {("a", 0): 32}
    assert _CountingDict.probes == 2              # the marks at 16 and 32 only: no search of depths 33-41
    idx.route(("b", 0), chain[:40], stamp=1)      # ends at 40: the mark at 32 is flagged
    _CountingDict.probes = 0
    assert idx.match_depths(prompt) == {("a", 0): 32, ("b", 0): 40}
    assert _CountingDict.probes == 2 + 9          # and depths 33-41 searched
    idx.route(("c", 0), chain[:9], stamp=1)       # shorter than the stride: searched before the first mark
    assert idx.match_depths(chain[:9] + [9999]) == {("c", 0): 9}
    assert idx.match_depths([chain[0], 9999]) == {}


def test_a_flagged_mark_lost_before_expiry_keeps_ends_searched_for_until_its_bucket_expires():
    idx = RoutedIndex(stride=K)
    a, b = ("a", 0), ("b", 0)
    chain = list(range(1, 65))
    ended = idx.route(a, chain[:40], stamp=1)     # flags the mark at 32
    idx.remove(a, [chain[31]])                    # the engine evicted it: the flagged mark goes
    idx.route(b, chain, stamp=2)                  # the mark at 32 again, no chain ends after it
    idx.route(a, chain, stamp=2)
    prompt = chain[:40] + [9999]
    assert idx.match_depths(prompt) == {a: 40, b: 32}     # a's end at 40 is still found
    assert reference_depth(idx, prompt, "a") == 40
    idx.expire(ended, 1)
    assert idx.match_depths(prompt) == {a: 32, b: 32}
    assert idx._blind == -1


def test_marks_loaded_without_flags_are_searched_after_until_they_expire():
    idx = RoutedIndex(stride=K)
    chain = list(range(1, 41))
    loaded = idx.mark(("a", 0), idx.marks(chain), 7)      # a snapshot's marks: no flags
    assert idx.match_depths(chain[:40] + [9999]) == {("a", 0): 40}
    idx.expire(loaded, 7)
    assert idx.size() == 0 and idx._blind == -1


def _random_chains(rng: random.Random) -> list[list[int]]:
    """18 chains over 3 shared trunks: prefixes of a trunk, each with its own tail."""
    trunks = [[rng.getrandbits(64) for _ in range(100)] for _ in range(3)]
    return [t[:rng.randrange(1, 100)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 40))]
            for t in trunks for _ in range(6)]


@pytest.mark.parametrize("seed", [4, 5])
def test_ends_flags_never_hide_an_end_the_marks_hold(seed):
    """Routings, in-order expiry, removals (BlockRemoved on pending marks), dropped workers and
    snapshot-style loads at random: every walk finds what it finds searching after every mark
    (removals leave holes a walk may gallop over, so the linear reading is no reference here)."""
    rng = random.Random(seed)
    chains = _random_chains(rng)
    idx = RoutedIndex(stride=K)
    queued: dict[int, list[int]] = {}
    bucket = oldest = 1
    for step in range(2000):
        if rng.random() < 0.05:
            bucket += 1
        chain = rng.choice(chains)
        cut = chain[:rng.randrange(1, len(chain) + 1)]
        w = (wid(rng.randrange(8)), 0)
        r = rng.random()
        if r < 0.1:
            gone = [h for h in cut if rng.random() < 0.3]
            idx.remove(w, gone)
        elif r < 0.13:
            queued.setdefault(bucket, []).extend(idx.mark(w, idx.marks(cut), bucket))
        elif r < 0.135:
            idx.drop_worker(w[0])
        else:
            held = max(idx.match_depths(cut, [w]).values(), default=0)
            queued.setdefault(bucket, []).extend(idx.route(w, cut, bucket, held=held))
        if rng.random() < 0.03 and oldest < bucket:       # oldest bucket first, as RoutingMemory expires
            idx.expire(queued.pop(oldest, []), oldest)
            oldest += 1
        if step % 10 == 0:
            workers = [wid(i) for i in range(8)]
            for probe in rng.sample(chains, 4):
                probe = probe[:rng.randrange(1, len(probe) + 1)] + ([rng.getrandbits(64)] if rng.random() < 0.5 else [])
                alive = idx.mask_of(workers)
                got = idx.depths(probe, alive)
                blind, idx._blind = idx._blind, 1 << 62     # as without flags: search after every mark
                assert got == idx.depths(probe, alive), step
                idx._blind = blind


@pytest.mark.parametrize("seed", [1, 2])
def test_routing_with_the_depth_held_skips_only_marks_it_would_leave_as_they_are(seed):
    """``route(held=...)`` skips the marks within the held prefix when its deepest mark is the
    worker's and current: the index (every value, stamp and ends flag) and the marks reported
    changed are those of routing with nothing held. ``held`` is the merged depth placement
    passes: the routed walk's, or deeper (the event-fed index's), rarely on a mark."""
    rng = random.Random(seed)
    chains = _random_chains(rng)
    hinted, plain = RoutedIndex(stride=K), RoutedIndex(stride=K)
    probed = {id(hinted): 0, id(plain): 0}          # marks each was asked to mark
    for idx in (hinted, plain):
        def counting(key, hashes, stamp, _idx=idx, _mark=idx._mark):
            probed[id(_idx)] += len(hashes)
            return _mark(key, hashes, stamp)
        idx._mark = counting
    queued: dict[int, list[int]] = {}
    bucket = oldest = 1
    for _ in range(3000):
        if rng.random() < 0.05:
            bucket += 1
        chain = rng.choice(chains)
        cut = chain[:rng.randrange(1, len(chain) + 1)]
        w = (wid(rng.randrange(8)), 0)
        held = max(hinted.match_depths(cut, [w]).values(), default=0)
        if rng.random() < 0.5:
            held = rng.randrange(held, len(cut) + 1)         # an event-fed depth may be deeper
        got = hinted.route(w, cut, bucket, held=held)
        assert got == plain.route(w, cut, bucket), (cut, held)
        queued.setdefault(bucket, []).extend(got)
        if rng.random() < 0.03 and oldest < bucket:
            for idx in (hinted, plain):
                idx.expire(queued.get(oldest, []), oldest)
            queued.pop(oldest, None)
            oldest += 1
        assert hinted.entries() == plain.entries()
    assert probed[id(hinted)] < 0.8 * probed[id(plain)]   # the hint did skip marks
