"""The event-fed walk gallops over workers without holes: the same levels as the block-by-block
walk, on hash chains (a block's hash commits to its whole prefix, as vLLM's do), whatever the
engines store, remove, clear or the cap evicts; holes send the walk back block by block."""

from __future__ import annotations

import hashlib
import random

import pytest

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from controlplane.kvcache import index as index_module
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig
from tests.test_kvcache_index import consistent, reference_depths

WORKERS = [("a", 0), ("b", 0), ("b", 1), ("c", 0), ("d", 0)]


def chain_of(tokens: list[int]) -> list[int]:
    """Block hashes that commit to their prefix: each the hash of its parent's and its token."""
    out, parent = [], b""
    for t in tokens:
        parent = hashlib.blake2b(parent + t.to_bytes(4, "little"), digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def random_chains(rng: random.Random, count: int = 24, length: int = 200) -> list[list[int]]:
    """Chains over a small token alphabet near the root (shared prefixes of many lengths)."""
    base = [rng.randrange(3) for _ in range(length)]
    chains = []
    for _ in range(count):
        cut = rng.randrange(0, length)
        tokens = base[:cut] + [rng.randrange(3, 6)] + [rng.randrange(6) for _ in range(rng.randrange(0, length - cut))]
        chains.append(chain_of(tokens))
    return chains


def stored(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=16)


class _Counted:
    """A function that counts its calls (to check a test went through the path it tests)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.parametrize("seed", range(6))
def test_the_gallop_gives_the_linear_walks_levels_on_hash_chains(seed, monkeypatch):
    rng = random.Random(seed)
    merging = _Counted(index_module._merge_levels)
    monkeypatch.setattr(index_module, "_merge_levels", merging)
    chains = random_chains(rng)
    cap = rng.choice([1_000_000, 600])               # with and without the cap's evictions
    fast = PrefixIndex(PrefixIndexConfig(max_blocks=cap, shards=16))
    slow = PrefixIndex(PrefixIndexConfig(max_blocks=cap, shards=16, gallop=False))
    galloping = _Counted(fast._gallop)
    fast._gallop = galloping                         # type: ignore[method-assign]
    held: dict = {}
    for step in range(400):
        key = rng.choice(WORKERS)
        chain = rng.choice(chains)
        op = rng.random()
        if op < 0.55:        # an engine computes a prefix, in runs continuing what it stored
            start = rng.randrange(0, len(chain))
            end = rng.randrange(start + 1, len(chain) + 1)
            if rng.random() < 0.8:
                start = 0
            events = [stored(chain[i:min(i + 32, end)], chain[i - 1] if i else None) for i in range(start, end, 32)]
        elif op < 0.75:      # frees blocks: its leaves first, or anywhere
            some = chain[-rng.randrange(1, 20):] if rng.random() < 0.5 else rng.sample(chain, min(len(chain), 5))
            events = [BlockRemoved(block_hashes=tuple(some))]
        elif op < 0.8:
            events = [AllBlocksCleared()]
        else:
            events = []
        for idx in (fast, slow):
            idx.apply(key[0], key[1], events)
        for ev in events:
            if type(ev) is BlockStored:
                held.setdefault(key, set()).update(ev.block_hashes)
            elif type(ev) is BlockRemoved:
                held.get(key, set()).difference_update(ev.block_hashes)
            else:
                held[key] = set()
        if step % 7 == 0:
            part = chain[:rng.randrange(0, len(chain) + 1)]
            for idx in (fast, slow):
                idx.touch(part)
        for q in rng.sample(chains, 4):
            q = q[:rng.randrange(1, len(q) + 1)]
            for alive in (fast._all, fast.mask_of([key[0]])):
                assert fast.levels(q, alive) == slow.levels(q, alive), (step, q)
            got = fast.match_depths(q)
            assert got == slow.match_depths(q)
            if cap > 10_000:
                assert got == reference_depths(held, q)
    consistent(fast)
    assert galloping.calls > 300 and merging.calls > 50    # alone, and merged with walks over slots with holes


def test_a_removal_a_stored_run_without_its_parent_or_an_eviction_gives_a_hole_until_cleared():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=1_000_000))
    c = chain_of(list(range(40)))
    idx.apply("a", 0, [stored(c[:16]), stored(c[16:32], c[15])])
    assert not idx._holey                             # runs continuing what it holds
    idx.apply("b", 0, [stored(c[20:30], c[19])])      # b lacks c[19]: a hole
    assert idx._holey == idx.mask_of(["b"])
    idx.apply("a", 0, [BlockRemoved(block_hashes=(c[5],))])
    assert idx._holey == idx.mask_of(["a", "b"])
    assert idx.match_depths(c) == {("a", 0): 5}       # (block by block: stops at the hole)
    idx.apply("a", 0, [AllBlocksCleared()])
    idx.apply("a", 0, [stored(c[:8])])
    assert idx._holey == idx.mask_of(["b"])           # cleared: none again
    idx.drop_worker("b")
    assert not idx._holey
    small = PrefixIndex(PrefixIndexConfig(max_blocks=8))
    small.apply("a", 0, [stored(c[:8])])
    small.apply("b", 0, [stored(c[30:32], c[29])])    # (b: a hole of its own) over the cap: a loses blocks
    assert small._holey == small.mask_of(["a", "b"])


def test_a_snapshots_blocks_are_walked_block_by_block():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=1_000_000))
    c = chain_of(list(range(20)))
    idx.store(("a", 0), [h for i, h in enumerate(c) if i != 7], None)   # as persist.load stores a slot
    idx.may_have_holes(("a", 0))
    assert idx.match_depths(c) == {("a", 0): 7}
