"""RoutingMemory's expiry and cap in bounded steps (controlplane/kvcache/routed.py): no call goes
through more than ``step`` queued marks (plus one routing's), whatever is due, and once the due
work is done the index is the one whole-queue expiry leaves."""

from __future__ import annotations

import random

from controlplane.kvcache.routed import STEP_MARKS, RoutingMemory


def _counted(mem: RoutingMemory) -> list[int]:
    """Marks each expiry/eviction step of ``mem``'s index goes through, accumulated per call of
    ``mem.expire`` / ``mem.shrink`` (the caller resets ``work[0]``)."""
    work = [0]
    expire = mem.index.expire                     # (evict() goes through it too)

    def counting(chain, stamp):
        work[0] += len(chain)
        return expire(chain, stamp)
    mem.index.expire = counting                   # type: ignore[method-assign]
    return work


def _contents(mem: RoutingMemory) -> list[tuple[int, int]]:
    keys, vals = mem.index.entries()
    return sorted(zip(keys, vals, strict=True))


def _chains(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.getrandbits(64) for _ in range(length)] for _ in range(n)]


def test_a_bucket_never_holds_more_than_a_step_at_the_default_cap():
    mem = RoutingMemory(ttl_s=120.0, max_blocks=2_000_000, stride=16)
    assert mem.bucket_max == STEP_MARKS          # was 1/16 of the cap: 125,000 marks
    assert RoutingMemory(ttl_s=1.0, max_blocks=1000).bucket_max == 1024   # small caps as before


def test_expiry_after_a_long_pause_goes_in_steps_to_the_same_index():
    step, per_chain = 1000, 100
    rng = random.Random(3)
    mem = RoutingMemory(ttl_s=16.0, max_blocks=1_000_000, stride=1, step=step)
    ref = RoutingMemory(ttl_s=16.0, max_blocks=1_000_000, stride=1, step=step)
    ref.step = 1 << 60                            # same buckets, whole queue in one call
    chains = _chains(rng, 400, per_chain)
    for i, chain in enumerate(chains):            # 40,000 marks over 8 s, some routed twice
        for m in (mem, ref):
            m.route(("w", i % 3), chain, now=i * 0.02)
            if i % 7 == 0:
                m.route(("w", 0), chains[i // 2], now=i * 0.02)
    assert len(mem.expiry) >= 40 and max(len(b) for _, _, b in mem.expiry) <= step + per_chain
    work = _counted(mem)
    calls = 0
    while mem.expiry and mem.expiry[0][1] <= 100.0 - 16.0:   # everything is due
        work[0] = 0
        mem.expire(now=100.0)
        calls += 1
        assert 0 < work[0] <= step + per_chain, work[0]
    ref.expire(now=100.0)
    assert calls >= 40 and not ref.expiry and mem.index.size() == 0 == ref.index.size()
    assert mem.index.stats().block_refs == 0


def test_partial_expiry_expires_the_oldest_buckets_first_and_matches_whole_expiry():
    step = 500
    rng = random.Random(5)
    mem = RoutingMemory(ttl_s=10.0, max_blocks=1_000_000, stride=4, step=step)
    ref = RoutingMemory(ttl_s=10.0, max_blocks=1_000_000, stride=4, step=step)
    ref.step = 1 << 60
    chains = _chains(rng, 300, 160)               # 40 marks a routing
    for i, chain in enumerate(chains):
        for m in (mem, ref):
            m.route(("w", i % 4), chain, now=i * 0.1)
            if i and i % 5 == 0:
                m.route(("w", (i + 1) % 4), chains[i - 5] + chain[:20], now=i * 0.1)
    for now in (12.0, 18.0, 25.0):
        ref.expire(now=now)
        while mem.expiry and mem.expiry[0][1] <= now - 10.0:
            mem.expire(now=now)
        assert _contents(mem) == _contents(ref)
        cutoff = now - 10.0
        for i, chain in enumerate(chains):        # routed after the cutoff: still matched in full
            if i * 0.1 > cutoff + 1.0:
                assert mem.index.match_depths(chain).get(("w", i % 4)) == 160


def test_the_cap_holds_at_once_and_its_margin_is_made_in_steps():
    step, cap, per_chain = 600, 20_000, 200
    rng = random.Random(9)
    mem = RoutingMemory(ttl_s=3600.0, max_blocks=cap, stride=1, step=step)
    ref = RoutingMemory(ttl_s=3600.0, max_blocks=cap, stride=1, step=step)
    ref.step = 1 << 60
    work = _counted(mem)
    worst = 0
    for i, chain in enumerate(_chains(rng, 600, per_chain)):    # 6x the cap
        work[0] = 0
        mem.route(("w", 0), chain, now=float(i))
        ref.route(("w", 0), chain, now=float(i))
        worst = max(worst, work[0])
        assert mem.index.size() <= cap and ref.index.size() <= cap
    assert 0 < worst <= step + per_chain
    assert mem.index.size() > cap - 2 * (step + per_chain)
    assert mem.index.match_depths(chain) == {("w", 0): per_chain}   # the newest stays
