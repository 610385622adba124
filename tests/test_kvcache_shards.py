"""The prefix index spread over shards: answers equal to a plain model, the cap held, growth in steps.

Why shards: one dict of every block is resized whole when it grows or has churned, holding the
event loop for the whole rebuild (hundreds of ms at a million blocks); each shard is resized alone.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from controlplane.kvcache import index as index_module
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig, SlotBlocks
from tests.test_kvcache_index import consistent, reference_depths

WORKERS = [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
# Small ints, both ends of 64 bits, and hashes outside them (kept by the per-hash path).
POOL = list(range(1, 40)) + [2**64 - 1, 2**63 + 5, 2**64 + 3, -7, 255, 256, 511]


def stored(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=16)


def chains(max_len: int = 300):
    """Chains drawn from a small pool (long runs of held blocks, repeats, shared segments with
    different middles), sometimes a long prefix of one fixed chain (walked in pieces past ``_HEAD``)."""
    base = [POOL[(i * 7) % len(POOL)] for i in range(max_len)]
    return st.one_of(st.lists(st.sampled_from(POOL), max_size=max_len),
                     st.integers(0, max_len).map(lambda n: base[:n]),
                     st.tuples(st.integers(0, max_len), st.integers(0, max_len - 1), st.sampled_from(POOL))
                     .map(lambda t: base[:t[0]][:t[1]] + [t[2]] + base[t[1] + 1:t[0]]))


ops = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "drop", "touch"]),
                         st.sampled_from(WORKERS), chains()), max_size=25)


@settings(max_examples=120, deadline=None)
@given(ops=ops, queries=st.lists(chains(), min_size=1, max_size=6), shards=st.sampled_from([1, 4, 256]))
def test_sharded_walk_equals_a_plain_model(ops, queries, shards):
    # The linear walk: these chains do not commit to their prefixes as block hashes do, which
    # the gallop relies on (tests/test_kvcache_gallop.py tests it on hash chains).
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=1_000_000, shards=shards, gallop=False))
    held: dict = {}
    for op, key, chain in ops:
        if op == "store":
            idx.apply(key[0], key[1], [stored(chain)])
            if chain:
                held.setdefault(key, set()).update(chain)
        elif op == "remove":
            idx.apply(key[0], key[1], [BlockRemoved(block_hashes=(h,)) for h in chain[::2]])
            held.get(key, set()).difference_update(chain[::2])
        elif op == "clear":
            idx.apply(key[0], key[1], [AllBlocksCleared()])
            held[key] = set()
        elif op == "drop":
            idx.drop_worker(key[0], key[1])
            held.pop(key, None)
        else:
            idx.match_depths(chain, touch=True)
        for q in queries:      # again after each step
            assert idx.match_depths(q) == reference_depths(held, q)
    consistent(idx)
    assert idx.size() == len({h for blocks in held.values() for h in blocks})
    assert idx.stats().block_refs == sum(len(b) for b in held.values())


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.tuples(st.sampled_from(WORKERS), st.lists(st.integers(0, 5000), min_size=1, max_size=80)),
                     max_size=60),
       cap=st.integers(16, 400), shards=st.sampled_from([1, 2, 8, 16]))
def test_eviction_keeps_the_cap_and_the_walk_agrees_with_what_is_kept(runs, cap, shards):
    # (the linear walk: these runs are no hash chains; tests/test_kvcache_gallop.py evicts from those)
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=cap, shards=shards, gallop=False))
    held: dict = {}
    for key, hashes in runs:
        idx.apply(key[0], key[1], [stored(hashes)])
        held.setdefault(key, set()).update(hashes)
        assert idx.size() <= cap
        assert max(len(d) for d in idx._shards) <= cap // shards
    consistent(idx)
    kept = {key: {h for h in blocks if key in idx.holders_of(h)} for key, blocks in held.items()}
    for _, hashes in runs[-5:]:
        assert idx.match_depths(hashes) == reference_depths(kept, hashes)
    if sum(len(b) for b in held.values()) > sum(len(b) for b in kept.values()):
        assert idx.stats().evicted


def test_eviction_takes_the_oldest_of_the_full_shard():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=64, shards=4))     # 16 a shard
    idx.apply("a", 0, [stored([4 * i for i in range(16)])])          # shard 0, full
    idx.apply("b", 0, [stored([4 * i + 1 for i in range(10)])])      # shard 1
    idx.match_depths([0, 4, 8], touch=True)                          # a's root refreshed
    idx.apply("c", 0, [stored([64])])                                # shard 0 over its cap
    # The block over the cap and a batch of 1/16 of the cap more: the two least recent leaves.
    assert idx.size() == 25 and idx.stats().evicted == 2
    assert idx.match_depths(list(range(0, 64, 4))) == {("a", 0): 14}
    assert idx.match_depths([1, 5, 9]) == {("b", 0): 3}              # shard 1 untouched
    assert idx.match_depths([64]) == {("c", 0): 1}


def test_shards_follow_the_cap_and_bad_counts_are_refused():
    assert PrefixIndexConfig().shard_bits() == 8                       # 2M: 256 shards of ~7,800
    assert PrefixIndexConfig(max_blocks=5).shard_bits() == 0
    assert PrefixIndexConfig(max_blocks=100_000).shard_bits() == 4
    assert len(PrefixIndex(PrefixIndexConfig(max_blocks=100_000))._shards) == 16
    for bad in (3, 512, -2):
        with pytest.raises(ValueError, match="shards"):
            PrefixIndex(PrefixIndexConfig(shards=bad))
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(PrefixIndexConfig(max_blocks=8, shards=16))


def test_a_large_index_grows_in_shards_of_even_size():
    rng = random.Random(3)
    idx = PrefixIndex(PrefixIndexConfig(keep_parents=True))
    for w in range(4):
        for _ in range(200):
            run = [rng.getrandbits(64) for _ in range(64)]
            idx.apply(f"w{w}", 0, [stored(run, run[0] ^ 1)])
            assert idx.parent_of(run[1]) == run[0]
    sizes = [len(d) for d in idx._shards]
    assert sum(sizes) == idx.size() == 51_200
    assert max(sizes) < 2 * idx.size() / len(sizes)        # no shard holds a large share to rebuild
    keys, vals = idx.entries()
    assert len(set(keys)) == len(keys) == idx.size() and all(vals)


def test_a_walk_probes_each_blocks_own_shard():
    """Chains that share their ends but differ inside (hashes that do not commit to their prefix)
    are each walked over their own blocks' shards."""
    idx = PrefixIndex(PrefixIndexConfig(shards=256, gallop=False))     # (the gallop needs hash chains)
    a = list(range(1000, 1200))
    b = a[:100] + [1] + a[101:]                 # 1 lies in another shard than 1100
    idx.apply("w", 0, [stored(a)])
    assert idx.match_depths(a) == {("w", 0): 200}
    assert idx.match_depths(b) == {("w", 0): 100}
    idx.apply("w", 0, [stored([1])])
    assert idx.match_depths(b) == {("w", 0): 200}
    assert idx.match_depths(a) == {("w", 0): 200}


@pytest.mark.parametrize("gallop", [False, True])
@pytest.mark.parametrize("shards", [1, 16, 256])
def test_long_walks_end_where_the_plain_model_does_on_either_side_of_the_first_pieces_end(shards, gallop):
    """A long chain's shards are picked in two pieces (the first ``_HEAD`` blocks, then the rest,
    only if the walk gets there), the rest through the per-hash path where a hash does not fit 64
    unsigned bits: matches ending at, just before and just after the pieces' border, and hashes
    outside 64 bits on either side, answer as the plain model."""
    rng = random.Random(5)
    head = index_module._HEAD
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=1_000_000, shards=shards, gallop=gallop))
    chain = [rng.getrandbits(64) for _ in range(head + 60)]
    chain[head + 7] = 2**64 + 11                # outside 64 bits, in the second piece
    held: dict = {}
    for i, depth in enumerate((0, 1, head - 1, head, head + 1, head + 8, len(chain))):
        key = (f"w{i}", 0)
        if depth:
            idx.apply(key[0], 0, [stored(chain[:depth])])
        held[key] = set(chain[:depth])
    for q in (chain, chain[:head], chain[:head + 1], [-3] + chain[1:], chain[:head] + [2**70] + chain[head + 1:]):
        assert idx.match_depths(q) == reference_depths(held, q)
        alive = idx.mask_of(["w2", "w5"])
        assert idx.depths(q, alive) == {k[0]: d for k, d in reference_depths(held, q).items() if k[0] in ("w2", "w5")}


def test_a_slot_compacts_in_steps_and_frees_what_it_kept_in_steps():
    """A compaction remembers the hashes it kept (to drop repeats) in 256 sets, and frees them a
    few per later call: one set of every live hash was resized and freed whole."""
    idx = PrefixIndex(PrefixIndexConfig(shards=16))
    run = list(range(10_000, 20_000))
    idx.apply("w", 0, [stored(run)])
    idx.apply("w", 0, [BlockRemoved(block_hashes=(h,)) for h in run[:7000]])
    idx.apply("w", 0, [stored(run[:10])])                  # stored again: twice in the array now
    mine = idx._blocks_of[0]
    steps = 0
    while mine._seen is not None or not steps:
        mine.compact()
        steps += 1
        if mine._seen is not None:
            assert max(len(s) for s in mine._seen) < 100   # spread by low byte
    assert steps >= 3                                      # 10,010 entries, 1,024 a step
    assert len(mine._trash) == 256 and mine.due()
    while mine._trash:
        before = len(mine._trash)
        mine.compact()
        assert before - len(mine._trash) == min(before, SlotBlocks.FREE_STEP)
    assert not mine.due()
    assert sorted(mine) == sorted(run[7000:] + run[:10]) and len(mine) == 3010
    assert len(mine.hashes) <= 3020        # those stored again while compacting may stay twice
    consistent(idx)
