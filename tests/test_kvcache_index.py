"""Prefix index: per-worker match depth, event application, bounded memory."""

from __future__ import annotations

import random

import pytest

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from controlplane.kvcache import index as index_module
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig, SlotBlocks, best_per_worker

A, B, C = ("a", 0), ("b", 0), ("c", 0)


def stored(hashes, parent=None):
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=16)


def reference_depths(held: dict, chain: list[int]) -> dict:
    """Per worker, the leading blocks of ``chain`` in its set of held blocks (the plain model)."""
    out = {}
    for key, blocks in held.items():
        d = 0
        while d < len(chain) and chain[d] in blocks:
            d += 1
        if d:
            out[key] = d
    return out


def consistent(idx: PrefixIndex) -> None:
    """Internal invariants: holders and per-slot sets agree; refs count matches."""
    refs = 0
    keys, vals = idx.entries()
    assert len(keys) == len(set(keys)) == idx.size()
    for h, m in zip(keys, vals, strict=True):
        assert m, "empty mask kept"
        for k in idx.holders_of(h):
            assert h in idx._blocks_of[idx._slot_of[k]]
            refs += 1
    assert refs == idx.stats().block_refs
    for k, s in idx._slot_of.items():
        for h in idx._blocks_of[s]:
            assert k in idx.holders_of(h)


def test_depth_stops_at_first_missing_block():
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1, 2, 3, 4])])
    idx.apply("b", 0, [stored([1, 2])])
    idx.apply("c", 0, [stored([1, 3, 4])])   # holds 3 and 4 but not 2: depth 1
    assert idx.match_depths([1, 2, 3, 4, 5]) == {A: 4, B: 2, C: 1}
    assert idx.match_depths([9, 1, 2]) == {}
    assert idx.match_depths([]) == {}
    assert idx.match_depths([1, 2, 3, 4]) == {A: 4, B: 2, C: 1}   # full match of the whole chain
    consistent(idx)


def test_candidate_restriction_and_unknown_workers():
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1, 2])])
    idx.apply("b", 0, [stored([1])])
    assert idx.match_depths([1, 2], workers=[B, ("nope", 0)]) == {B: 1}
    assert idx.match_depths([1, 2], workers=[]) == {}


def test_dp_ranks_are_separate_slots():
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1])])
    idx.apply("a", 1, [stored([1, 2, 3])])
    idx.apply("a", None, [stored([7])])      # None = rank 0
    d = idx.match_depths([1, 2, 3])
    assert d == {("a", 0): 1, ("a", 1): 3}
    assert best_per_worker(d) == {"a": 3}
    assert idx.match_depths([7]) == {("a", 0): 1}


def test_parent_links_and_continuation():
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1, 2, 3])])
    idx.apply("a", 0, [stored([4, 5], parent=3)])   # a later step continues the chain
    assert idx.parent_of(1) is None and idx.parent_of(4) == 3 and idx.parent_of(5) == 4
    assert idx.match_depths([1, 2, 3, 4, 5]) == {A: 5}


def test_removed_cleared_and_drop():
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1, 2, 3])])
    idx.apply("b", 0, [stored([1, 2, 3])])
    idx.apply("a", 0, [BlockRemoved(block_hashes=(2, 99))])     # 99 unknown: ignored
    assert idx.match_depths([1, 2, 3]) == {A: 1, B: 3}
    idx.apply("b", 0, [AllBlocksCleared(), stored([1])])         # order within a batch matters
    assert idx.match_depths([1, 2, 3]) == {A: 1, B: 1}
    assert idx.size() == 2                                        # 1 (a, b) and 3 (a)
    idx.drop_worker("a")
    assert idx.match_depths([1, 2, 3]) == {B: 1} and idx.size() == 1
    assert A not in idx.workers()
    idx.reset_worker("b")
    assert idx.size() == 0 and B in idx.workers()
    idx.remove(("ghost", 0), [1])                                 # unknown worker: no-op
    consistent(idx)
    st = idx.stats()
    assert st.removed == 1 and st.blocks == 0 and st.block_refs == 0 and st.workers == 1


def test_slot_reuse_after_drop_does_not_leak_holdings():
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1, 2])])
    idx.drop_worker("a")
    idx.apply("z", 0, [stored([5])])                              # reuses a's slot
    assert idx.match_depths([1, 2]) == {} and idx.match_depths([5]) == {("z", 0): 1}


def test_many_workers_beyond_64_bits():
    idx = PrefixIndex()
    for w in range(100):
        idx.apply(f"w{w}", 0, [stored(list(range(1, 2 + w % 10)))])
    d = idx.match_depths(list(range(1, 20)))
    assert len(d) == 100 and all(d[(f"w{w}", 0)] == 1 + w % 10 for w in range(100))


def test_eviction_bounds_size_and_takes_leaves_first():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=5))
    idx.apply("a", 0, [stored([1, 2, 3])])
    idx.apply("b", 0, [stored([10, 11, 12])])     # 6 blocks > 5: evict oldest = deepest of first run
    assert idx.size() == 5
    assert idx.match_depths([1, 2, 3]) == {A: 2}    # 3 (the leaf) went, 1 and 2 remain
    idx.match_depths([1, 2], touch=True)            # refresh a's prefix
    idx.apply("c", 0, [stored([20, 21])])           # evicts b's leaves, not a's touched prefix
    assert idx.match_depths([1, 2]) == {A: 2}
    assert idx.match_depths([10, 11, 12]) == {B: 1}
    assert idx.stats().evicted == 3
    consistent(idx)


def test_a_touched_block_gets_a_second_chance_when_eviction_reaches_it():
    """The clock's contract (was an LRU refresh at touch time): a touch moves nothing; eviction
    that reaches a block touched since it was last reached moves it to the newest end, clears
    its bit and takes the next oldest; reached again untouched, it goes."""
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=4))           # one shard, batches of one
    idx.apply("a", 0, [stored([1, 2])])                          # order: 2, 1 (deepest least recent)
    idx.match_depths([1, 2], touch=True)
    order = list(idx._shards[0])
    idx.apply("b", 0, [stored([10, 11])])
    assert order == [2, 1] and list(idx._shards[0]) == [2, 1, 11, 10]    # the touch moved nothing
    idx.apply("c", 0, [stored([20])])                            # over the cap: 2 then 1 are reached, spared
    assert idx.match_depths([1, 2]) == {A: 2}                    # a's touched prefix survives
    assert idx.match_depths([10, 11]) == {B: 1}                  # b's leaf went in its place
    assert 1 not in idx._ref and 2 not in idx._ref               # both spared once: bits cleared
    assert list(idx._shards[0]) == [10, 20, 2, 1]
    idx.apply("c", 0, [stored([21], parent=20)])                 # 10 is the oldest
    idx.apply("c", 0, [stored([22], parent=21)])                 # and now a's 2: untouched since, no bit left
    assert idx.match_depths([1, 2]) == {A: 1} and idx.match_depths([10]) == {}
    assert idx.stats().evicted == 3
    consistent(idx)


def test_referenced_bits_start_over_with_the_touched_table_past_their_bound(monkeypatch):
    monkeypatch.setattr(index_module, "_REF_MAX", 8)
    idx = PrefixIndex()
    idx.apply("a", 0, [stored(list(range(1, 21)))])
    idx.touch(list(range(1, 21)))
    assert len(idx._ref) == 20 and idx._touched
    idx.touch(list(range(1, 21)))                                # over the bound: both start over,
    assert idx._ref == set(range(1, 21))                         # and the prefix is touched afresh


def test_touching_part_of_a_recently_touched_prefix_skips_most_of_it():
    idx = PrefixIndex()
    chain = list(range(1, 1301))
    idx.apply("a", 0, [stored(chain)])
    clock = idx._clock
    idx.touch(chain)
    assert idx._clock - clock == 1300                  # new: every block
    clock = idx._clock
    idx.touch(chain[:1000])                            # shares 1,000 blocks: remembered at 960
    assert idx._clock - clock == 40
    clock = idx._clock
    idx.touch(chain[:1000])                            # its end is remembered now: nothing to touch
    assert idx._clock - clock == 0
    idx.touch(chain[:1005])                            # remembered at 992 (the first's last 16th block)
    assert idx._clock - clock == 13
    assert set(range(993, 1006)) <= idx._ref           # the touched tail's referenced bits are set
    idx._clock += idx.config.max_blocks                # long ago: touched in full again
    clock = idx._clock
    idx.touch(chain[:1000])
    assert idx._clock - clock == 1000


def test_random_operations_match_a_naive_model():
    rng = random.Random(1)
    idx = PrefixIndex(PrefixIndexConfig(gallop=False))      # ranges of ints are no hash chains
    model: dict[tuple[str, int], set[int]] = {}
    workers = [("w0", 0), ("w1", 0), ("w1", 1), ("w2", 0)]
    for _ in range(3000):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.6:
            start = rng.randrange(0, 30)
            hs = list(range(start, start + rng.randrange(1, 6)))
            idx.apply(w[0], w[1], [stored(hs, parent=start - 1 if start else None)])
            model.setdefault(w, set()).update(hs)
        elif op < 0.95:
            hs = [rng.randrange(0, 40) for _ in range(3)]
            idx.apply(w[0], w[1], [BlockRemoved(block_hashes=tuple(hs))])
            model.setdefault(w, set()).difference_update(hs)
        else:
            idx.apply(w[0], w[1], [AllBlocksCleared()])
            model[w] = set()
        if rng.random() < 0.1:
            assert idx.match_depths(list(range(0, 40))) == reference_depths(model, list(range(0, 40)))
    consistent(idx)
    assert idx.size() == len(set().union(*model.values()))


def test_compaction_in_steps_keeps_exactly_the_live_blocks(monkeypatch):
    # A busy slot is compacted a step at a time (SlotBlocks.COMPACT_STEP entries per call), not
    # in one hold of the event loop; meanwhile its blocks read as the live ones, stores and
    # removals go on (a block removed and stored again while its old entry waits), and at the
    # end every stale and repeated entry is gone.
    monkeypatch.setattr(SlotBlocks, "COMPACT_STEP", 64)
    rng = random.Random(3)
    idx = PrefixIndex()
    live: set[int] = set()
    steps = compactions = 0
    for rnd in range(400):
        batch = [BlockRemoved(block_hashes=(h,)) for h in rng.sample(sorted(live), min(len(live), 40))]
        new = [rng.randrange(1, 3000) for _ in range(rng.randrange(1, 60))]
        events = [*batch, stored(new)]
        if rnd % 7 == 0 and live:          # one removed and stored again in one batch
            again = rng.choice(sorted(live))
            events += [BlockRemoved(block_hashes=(again,)), stored([again])]
        idx.apply("w", 0, events)
        for ev in events:
            if isinstance(ev, BlockRemoved):
                live.difference_update(ev.block_hashes)
            else:
                live.update(ev.block_hashes)
        mine = idx._blocks_of[idx._slot_of["w", 0]]
        if mine._seen is not None:
            steps += 1
            assert mine._r - mine._w >= 0 and mine._r <= mine._stop <= len(mine.hashes)
        elif steps:
            compactions += 1
            steps = 0
        assert set(mine) == live and len(mine) == len(live)
        assert len(mine.hashes) <= 4 * len(live) + 400   # bounded, whatever the churn
    assert compactions >= 5
    mine.compact()
    while mine._seen is not None:
        mine.compact()
    consistent(idx)
    idx.apply("w", 0, [BlockRemoved(block_hashes=tuple(live))])
    while mine.due():
        mine.compact()
    assert len(mine.hashes) <= 64 and list(mine) == [] and len(mine) == 0   # a few stale ones may wait


def test_a_run_of_removals_is_one_call_and_keeps_order():
    # vLLM evicts a block per BlockRemoved: a run of them is applied as one removal, and a
    # block stored after its removal in the same batch stays.
    idx = PrefixIndex()
    idx.apply("a", 0, [stored([1, 2, 3, 4])])
    calls = []
    orig = idx.remove
    idx.remove = lambda key, hs: (calls.append(list(hs)), orig(key, hs))[1]   # type: ignore[method-assign]
    idx.apply("a", 0, [BlockRemoved(block_hashes=(1,)), BlockRemoved(block_hashes=(2, 3)), stored([2]),
                       BlockRemoved(block_hashes=(4,))])
    assert calls == [[1, 2, 3], [4]]
    assert idx.match_depths([2]) == {A: 1} and idx.match_depths([1]) == {} and idx.size() == 1


def test_bad_config():
    with pytest.raises(ValueError):
        PrefixIndex(PrefixIndexConfig(max_blocks=0))
