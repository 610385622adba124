"""Placement at scale: the bounded candidate stage, the fleet's least-loaded order, the prefix
index's group walk and its memory bound.

Small fleets must decide exactly as the unsampled pipeline; large fleets must still find what
each policy looks for (the global least-loaded worker, the one deep cache among 1,000).
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import Counter

import pytest

from controlplane.fleet import Fleet
from controlplane.kvcache.events import BlockStored
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig, RoutedIndex
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.placement import Placer
from controlplane.scheduling import POLICIES, build_profile
from controlplane.scheduling.candidates import SampleStage
from controlplane.state import Charge, MemoryStore, RequestRecord
from controlplane.workers import Health, HealthState, Load, Role, WorkerSpec
from protos import omni_proxy_pb2 as pb

BUILTINS = sorted(POLICIES)


def wid(i: int) -> str:
    return f"w{i:04d}"


async def plane(policy: str, n: int, *, exact: bool = False, weights=None, sample: bool = True,
                seed: int = 1, clock=None) -> tuple[Placer, MemoryStore, Fleet]:
    store, fleet = MemoryStore(), Fleet()
    for i in range(n):
        spec = WorkerSpec(id=wid(i), url=f"http://{wid(i)}", role=Role.BOTH, model="m",
                          weight=weights[i] if weights else 1.0, kv_events="tcp://x:1" if exact else "")
        await store.put_spec(spec)
        fleet.put(spec)
        fleet.set_state(spec.id, HealthState(health=Health.HEALTHY))
    spec = dict(POLICIES[policy])
    if not sample:
        spec["candidates"] = "all"
    profile = build_profile(policy, {policy: spec})
    for obj in (profile.picker, profile.candidates):
        if obj is not None and hasattr(obj, "rng"):
            obj.rng = random.Random(seed)
    placer = Placer(store, fleet, profile, **({"clock": clock} if clock else {}))
    placer.kv = KVCache(KVCacheConfig(approx_ttl_s=600))
    return placer, store, fleet


class FakeClock:
    """A clock the test moves by hand (Placer's ``clock``)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def entry(rid: str, chain=(), tokens: int = 0, **kw) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=tokens or 16 * len(chain) or 100,
                           max_tokens=16, block_hashes=list(chain), **kw)


def stored(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=16)


async def charge(store: MemoryStore, worker_id: str, rid: str, tokens: int = 100) -> None:
    await store.reserve(RequestRecord(request_id=rid, model="m", prompt_tokens=tokens, max_tokens=0),
                        (Charge(worker_id=worker_id, leg="aggregated", tokens=tokens),))


# ---------------------------------------------------------------------------------- small fleets


@pytest.mark.parametrize("policy", BUILTINS)
@pytest.mark.parametrize("exact", [False, True])
async def test_small_fleets_decide_exactly_as_the_unsampled_pipeline(policy, exact):
    rng = random.Random(5)
    docs = [[rng.getrandbits(64) for _ in range(24)] for _ in range(6)]
    got = []
    for sample in (True, False):
        # Both runs see the same clock (a placement every 10 ms): the prediction counts what an
        # engine computed since its last prompt was placed, so wall time would tip near ties.
        clock = FakeClock(1000.0)
        placer, store, _ = await plane(policy, 16, exact=exact, sample=sample, seed=3, clock=clock)
        assert (placer.profile.candidates is not None) == sample
        if exact:
            for d, doc in enumerate(docs):
                placer.kv.exact.apply(wid(d * 2), 0, [stored(doc[:8 + d * 2])])
        r = random.Random(9)
        seq = []
        for i in range(120):
            clock.t += 0.01
            doc = docs[r.randrange(len(docs))]
            chain = doc[:r.randrange(4, 24)] + [r.getrandbits(64) for _ in range(4)]
            p = await placer.place(entry(f"r{i}", chain))
            seq.append(p.decode.worker_id)
            if i % 3 == 0:
                await store.end(f"r{i - 6}")
        got.append(seq)
    assert got[0] == got[1]


# ---------------------------------------------------------------------------------- large fleets


@pytest.mark.parametrize("policy", BUILTINS)
async def test_large_fleets_consider_a_bounded_sample(policy):
    placer, _, _ = await plane(policy, 1000)
    chain = [random.getrandbits(64) for _ in range(32)]
    p = await placer.place(entry("r1", chain, explain=True))
    assert p.decode.worker_id and "sampled of 1000 routable" in p.explanation
    considered = p.explanation.count(" score=")
    stage = placer.profile.candidates
    assert 1 <= considered <= stage.deepest + stage.least_loaded + stage.random
    dry = await placer.place(entry("", chain), dry_run=True)        # omni-ctl explain
    assert dry.decode.worker_id and "policy=" in dry.explanation


async def test_least_load_finds_the_global_minimum_the_ledger_orders():
    placer, store, _ = await plane("least_load", 1000)
    idle = 737
    for i in range(1000):
        if i != idle:
            await charge(store, wid(i), f"busy{i}", tokens=100 + i % 7)
    assert (await placer.place(entry("r1"))).decode.worker_id == wid(idle)
    # The ledger's releases reorder it: ending w0003's request makes w0003 the idlest again
    # once w0737 holds r1.
    await store.end("busy3")
    assert (await placer.place(entry("r2"))).decode.worker_id == wid(3)


async def test_least_loaded_order_follows_reserve_and_release():
    _, store, fleet = await plane("least_load", 40)
    group = fleet.group("m", (Role.BOTH,))
    assert group.least_loaded(3) == [wid(0), wid(1), wid(2)]          # all idle: id order
    for i in range(40):
        await charge(store, wid(i), f"r{i}", tokens=1000 - i)
    assert group.least_loaded(2) == [wid(39), wid(38)]
    await store.end("r5")
    assert group.least_loaded(2, skip={wid(5)}) == [wid(39), wid(38)]
    assert group.least_loaded(1) == [wid(5)]
    for _ in range(500):                                            # stale entries are compacted away
        await charge(store, wid(7), "x")
        await store.end("x")
    assert group._heap is None or len(group._heap) <= 3 * 40 + 64 + 1   # dropped: rebuilt on demand
    assert group.least_loaded(1) == [wid(5)] and len(group._heap) == 40


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("policy", ["cache_aware", "apc_first", "predicted_latency"])
async def test_prefix_policies_find_the_one_deep_cache_among_1000(policy, exact):
    placer, _, _ = await plane(policy, 1000, exact=exact)
    rng = random.Random(2)
    system = [rng.getrandbits(64) for _ in range(8)]
    chain = system + [rng.getrandbits(64) for _ in range(120)]
    warm = wid(613)
    if exact:
        for i in range(0, 1000, 3):                                 # a third share the system prompt
            placer.kv.exact.apply(wid(i), 0, [stored(system)])
        placer.kv.exact.apply(warm, 0, [stored(chain[:100])])
    else:
        spec = placer.fleet.get(warm)
        for i in range(0, 1000, 3):
            placer.kv.placed(placer.fleet.get(wid(i)), system, 0)
        placer.kv.placed(spec, chain[:100], 0)
    p = await placer.place(entry("r1", chain, explain=True))
    assert p.decode.worker_id == warm, p.explanation
    assert "match=100/128blk" in p.explanation


async def test_deepest_level_wider_than_the_budget_is_sampled_fairly():
    idx = PrefixIndex()
    for i in range(300):
        idx.apply(wid(i), 0, [stored([1, 2, 3])])
    idx.apply(wid(299), 0, [stored([1, 2, 3, 4])])
    rng = random.Random(0)
    alive = idx.mask_of(wid(i) for i in range(300))
    seen = Counter()
    for _ in range(50):
        top = idx.deepest([1, 2, 3, 4, 5], alive, 5, rng)
        assert len(top) == 5 and top[wid(299)] == 4
        assert all(d == 3 for w, d in top.items() if w != wid(299))
        seen.update(top)
    assert len(seen) > 100                       # not always the lowest slots
    levels = idx.levels([1, 2, 3, 4, 5], alive)
    assert idx.depths_in(levels, idx.mask_of([wid(7), wid(299), "nope"])) == {wid(7): 3, wid(299): 4}
    assert idx.depths_among(levels, [wid(7), wid(299), "nope"]) == {wid(7): 3, wid(299): 4}


@pytest.mark.parametrize("seed", [1, 2])
def test_candidates_depths_read_slot_by_slot_or_through_a_mask_agree(seed):
    """``depths_among`` (a few candidates: narrow levels read slot by slot, wide ones ANDed
    with the candidates' mask) and ``mask_of`` for a few ids (per-worker masks ORed) give what
    the plain mask and ``depths_in`` give, DP ranks and dropped workers included."""
    rng = random.Random(seed)
    idx = PrefixIndex()
    doc = list(range(1, 41))
    for i in range(200):
        idx.apply(wid(i), i % 3, [stored(doc[:rng.randrange(1, 41)])])
    for i in rng.sample(range(200), 20):
        idx.drop_worker(wid(i), rng.choice([None, 0, 1, 2]))
    alive = idx.mask_of([wid(i) for i in range(200)])
    for _ in range(30):
        chain = doc[:rng.randrange(1, 41)] + [999]
        levels = idx.levels(chain, alive)
        some = [wid(i) for i in rng.sample(range(210), rng.randrange(1, 40))]
        plain = 0
        for w in some:
            for slot in idx._by_worker.get(w, ()):
                plain |= 1 << slot
        assert idx.mask_of(some) == plain
        assert idx.depths_among(levels, some) == idx.depths_in(levels, plain)


async def test_round_robin_at_scale_is_even_and_weighted():
    placer, _, _ = await plane("round_robin", 100)
    got = Counter()
    for i in range(500):
        got[(await placer.place(entry(f"r{i}"))).decode.worker_id] += 1
    assert set(got.values()) == {5}
    weights = [3.0 if i < 50 else 1.0 for i in range(100)]
    placer, _, _ = await plane("round_robin", 100, weights=weights)
    got = Counter()
    for i in range(2000):
        got[(await placer.place(entry(f"r{i}"))).decode.worker_id] += 1
    assert {got[wid(i)] for i in range(50)} == {30} and {got[wid(i)] for i in range(50, 100)} == {10}


async def test_random_at_scale_is_weighted_and_honours_exclusions():
    weights = [3.0 if i < 50 else 1.0 for i in range(100)]
    placer, _, _ = await plane("random", 100, weights=weights)
    got = Counter()
    for i in range(4000):
        got[(await placer.place(entry(f"r{i}", exclude_workers=[wid(0)]))).decode.worker_id] += 1
    assert wid(0) not in got
    heavy = sum(got[wid(i)] for i in range(1, 50)) / 49
    light = sum(got[wid(i)] for i in range(50, 100)) / 50
    assert 2.4 < heavy / light < 3.6


async def test_power_of_two_at_scale_compares_a_uniform_pair():
    placer, store, _ = await plane("power_of_two", 200)
    for i in range(100):                         # half the fleet is busy
        for j in range(3):
            await charge(store, wid(i), f"b{i}-{j}")
    got = Counter()
    for i in range(2000):
        p = await placer.place(entry(f"r{i}"))
        got[p.decode.worker_id] += 1
        await store.end(f"r{i}")
    busy = sum(n for w, n in got.items() if int(w[1:]) < 100)
    # both of a pair busy: 1/4 of the time (the unsampled picker's odds, too)
    assert 0.18 < busy / 2000 < 0.32 and len(got) > 150


async def test_exclusions_that_leave_one_worker_still_place():
    for policy in BUILTINS:
        placer, _, _ = await plane(policy, 100)
        others = [wid(i) for i in range(100) if i != 42]
        p = await placer.place(entry("r1", [1, 2, 3], exclude_workers=others))
        assert p.decode.worker_id == wid(42), (policy, p)


async def test_stage_options_are_checked():
    with pytest.raises(ValueError):
        SampleStage(max_candidates=1)
    with pytest.raises(ValueError):
        SampleStage(least_loaded=0, random=0)
    with pytest.raises(ValueError):
        build_profile("x", {"x": {"picker": "max_score", "candidates": {"name": "nope"}}})
    prof = build_profile("x", {"x": {"picker": "max_score", "scorers": ["least_load"],
                                     "candidates": {"name": "sample", "max_candidates": 8, "random": 2}}})
    assert prof.candidates.max_candidates == 8 and prof.candidates.mode == "sample"
    from controlplane.config import _profiles
    custom = _profiles({"y": {"picker": "round_robin", "candidates": "all"}})
    assert build_profile("y", custom).candidates is None          # a config file can turn it off
    assert build_profile("round_robin").candidates.mode == "round_robin"
    assert build_profile("power_of_two").candidates.mode == "pair"


# ---------------------------------------------------------------------------------- prefix index


def test_routed_index_galloping_walk_equals_the_linear_walk():
    """Routed prefixes only ever shrink along a chain, which the galloping walk relies on."""
    rng = random.Random(3)
    trunks = [[rng.getrandbits(64) for _ in range(40)] for _ in range(4)]
    chains = [t[:rng.randrange(1, 40)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 30))]
              for t in trunks for _ in range(6)]
    idx = RoutedIndex()
    queued: list[tuple[int, list[int]]] = []
    bucket = 0
    for step in range(1500):
        if rng.random() < 0.05:
            bucket += 1
        chain = rng.choice(chains)
        cut = chain[:rng.randrange(1, len(chain) + 1)]
        w = wid(rng.randrange(12))
        levels = PrefixIndex._walk(idx, cut, idx.mask_of([w]))          # what placement's walk says
        changed = idx.route((w, 0), cut, bucket, held=levels[-1][0] if levels else 0)
        if not queued or queued[-1][0] != bucket:        # one list per bucket, as KVCache keeps
            queued.append((bucket, []))
        queued[-1][1].extend(changed)
        if rng.random() < 0.03 and queued:                # oldest bucket first, as KVCache expires
            b, blocks = queued.pop(0)
            idx.expire(blocks, b)
        if rng.random() < 0.01:
            idx.drop_worker(wid(rng.randrange(12)))
        if step % 10 == 0:
            alive = idx.mask_of(wid(i) for i in rng.sample(range(12), rng.randrange(1, 13)))
            for c in rng.sample(chains, 4):
                assert idx._walk(c, alive) == PrefixIndex._walk(idx, c, alive)


def test_approximate_index_is_capped_by_expiring_the_oldest_buckets(monkeypatch):
    kv = KVCache(KVCacheConfig(approx_ttl_s=60_000, max_blocks=1000))   # only the cap expires
    spec = WorkerSpec(id="a", url="http://a", role=Role.BOTH, model="m")
    now = [1000.0]
    monkeypatch.setattr("controlplane.kvcache.routed.time.monotonic", lambda: now[0])
    old = [1, 2, 3]
    kv.placed(spec, old, 0)
    for i in range(30):
        now[0] += 4000                                   # a new bucket each time (60000 / 16 s)
        kv.placed(spec, list(range(100 * i + 10, 100 * i + 110)), 0)
        assert kv.approx.size() <= 1000
    assert kv.match(old, [spec]) == {}                   # the oldest went first
    assert kv.match(list(range(2910, 3010)), [spec]) == {"a": 100}


def test_a_burst_over_the_cap_within_one_time_bucket_drops_only_the_oldest(monkeypatch):
    # every block a mark, so the linear walk over blocks is the reference (strided: test_kvcache_routed_stride)
    kv = KVCache(KVCacheConfig(approx_ttl_s=3600, max_blocks=4096, routed_stride=1))
    monkeypatch.setattr("controlplane.kvcache.routed.time.monotonic", lambda: 50.0)   # no time passes
    specs = [WorkerSpec(id=wid(i), url="http://x", role=Role.BOTH, model="m") for i in range(8)]
    rng = random.Random(8)
    trunk = [rng.getrandbits(64) for _ in range(16)]
    chains = [trunk + [rng.getrandbits(64) for _ in range(48)] for _ in range(200)]
    for i, chain in enumerate(chains):
        kv.placed(specs[i % 8], chain, 0)
        assert kv.approx.size() <= 4096
    assert kv.approx.size() > 2048                        # only old buckets went, not everything
    assert kv.match(chains[-1], specs) == {specs[199 % 8].id: 64, **{s.id: 16 for s in specs if s.id != wid(7)}}
    ids = tuple(s.id for s in specs)
    alive = kv.approx.mask_of(ids)
    for chain in chains[::7]:
        assert kv.approx._walk(chain, alive) == PrefixIndex._walk(kv.approx, chain, alive)


def test_a_hash_twice_in_one_routed_chain_counts_once():
    idx = RoutedIndex()
    idx.route(("a", 0), [5, 6, 5, 7], stamp=1)
    assert idx.stats().block_refs == 3 and len(idx._blocks_of[0]) == 3
    idx.reset_worker("a")
    assert idx.size() == 0 and idx.stats().block_refs == 0


def test_routed_blocks_expire_by_bucket_unless_routed_again():
    idx = RoutedIndex()
    a, b = ("a", 0), ("b", 0)
    assert idx.route(a, [1, 2, 3], stamp=10) == [3, 2, 1]
    assert idx.route(a, [1, 2, 3], stamp=10) == []          # same bucket: nothing to queue again
    assert idx.route(b, [1, 2], stamp=11) == [2, 1]
    assert idx.match_depths([1, 2, 3]) == {a: 3, b: 2}
    assert idx.expire([3, 2, 1], 10) == 1                   # 1 and 2 were routed again in bucket 11
    assert idx.match_depths([1, 2, 3]) == {a: 2, b: 2}
    assert idx.expire([2, 1], 11) == 2 and idx.size() == 0 and idx.stats().block_refs == 0


async def test_cached_blocks_for_candidates_equal_the_full_count():
    kv = KVCache(KVCacheConfig(routed_stride=1))     # routed blocks counted exactly, not marks x 16
    kv.exact.apply("a", 0, [stored([1, 2, 3])])
    kv.exact.apply("a", 1, [stored([4])])
    kv.approx.route(("b", 0), [7, 8], 1)
    full = kv.cached_blocks()
    assert full == {"a": 4, "b": 2}
    assert kv.cached_blocks(["a", "c"]) == {"a": 4}


def test_hashes_beyond_64_bits_are_held_and_cleared():
    idx = PrefixIndex()
    big, neg = 1 << 70, -5
    idx.apply("a", 0, [stored([1, big, neg, 2])])
    assert idx.match_depths([1, big, neg, 2]) == {("a", 0): 4}
    assert sorted(idx._blocks_of[0]) == sorted([1, big, neg, 2])
    idx.apply("a", 0, [BlockStored(block_hashes=(), parent_block_hash=None, token_ids=(), block_size=16)])
    idx.reset_worker("a")
    assert idx.size() == 0 and idx.stats().block_refs == 0


def test_slot_arrays_stay_bounded_under_churn():
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=10_000))
    for r in range(200):
        hs = list(range(r * 10, r * 10 + 50))
        idx.store(("a", 0), hs, None)
        idx.remove(("a", 0), hs[:40])
    mine = idx._blocks_of[0]
    assert len(mine) == idx.stats().block_refs and len(mine.hashes) <= 2 * len(mine) + 64 + 50


@pytest.mark.parametrize("mode", ["exact", "approx", "approx-strided"])
def test_index_memory_per_entry_is_bounded(mode):
    """Same measure as bench/placement.py, smaller: 16 workers, 64K distinct blocks. ``approx``:
    every routed block a mark (the worst case per entry); ``approx-strided``: the default, a mark
    every 16 blocks, bounded per mark and 16 times smaller per routed block."""
    rng = random.Random(4)
    specs = [WorkerSpec(id=wid(i), url="http://x", role=Role.BOTH, model="m") for i in range(16)]
    chains = [[rng.getrandbits(64) for _ in range(128)] for _ in range(500)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    kv = KVCache(KVCacheConfig(approx_ttl_s=3600, routed_stride=1 if mode == "approx" else 16))
    for c, chain in enumerate(chains):
        if mode == "exact":
            for i in range(0, 128, 32):
                kv.exact.apply(wid(c % 16), 0, [stored(chain[i:i + 32], chain[i - 1] if i else None)])
        else:
            kv.placed(specs[c % 16], chain, 0)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del chains
    refs = (kv.exact if mode == "exact" else kv.approx).stats().block_refs
    assert refs == (4_000 if mode == "approx-strided" else 64_000)
    assert used / refs <= 150, f"{used / refs:.0f} bytes per entry"
    assert used / 64_000 <= (150 / 16 if mode == "approx-strided" else 150)


def test_group_masks_follow_new_slots_without_a_rebuild():
    kv = KVCache(KVCacheConfig())
    ids = tuple(wid(i) for i in range(100))
    rng = random.Random(1)
    assert kv.deepest([1, 2], ids, 4, rng) == {}
    kv.exact.apply(wid(50), 0, [stored([1, 2])])
    spec = WorkerSpec(id=wid(60), url="http://x", role=Role.BOTH, model="m")
    kv.placed(spec, [1], 0)
    kv.exact.apply("stranger", 0, [stored([1, 2])])            # not in the group
    assert kv.deepest([1, 2], ids, 4, rng) == {wid(50): 2, wid(60): 1}
    kv.exact.drop_worker(wid(50))
    assert kv.deepest([1, 2], ids, 4, rng) == {wid(60): 1}
    _ = Load  # noqa: F841 (imported for readers: loads are what the ledger orders)


def test_views_are_reused_only_while_spec_health_metrics_and_load_stay():
    """Fleet.views reuses a worker's view while its load is the same object; a new spec,
    health state or engine metrics drop the view, so the next one carries them."""
    from controlplane.workers import EngineMetrics

    fleet = Fleet()
    spec = WorkerSpec(id="a", url="http://a", role=Role.BOTH, model="m")
    fleet.put(spec)
    fleet.set_state("a", HealthState(health=Health.HEALTHY))
    load = Load(1, 10)
    first = fleet.views(["a"], {"a": load})[0]
    assert fleet.views(["a"], {"a": load})[0] is first
    assert fleet.views(["a"], {"a": Load(2, 20)})[0].load.requests == 2
    fleet.views(["a"], {"a": load})                   # (the view holds this very load again)
    fleet.set_engine("a", EngineMetrics(running=7, updated_at=1.0))
    assert fleet.views(["a"], {"a": load})[0].engine.running == 7
    fleet.set_state("a", HealthState(health=Health.UNHEALTHY))
    assert fleet.views(["a"], {"a": load})[0].state.health is Health.UNHEALTHY
    fleet.put(WorkerSpec(id="a", url="http://a2", role=Role.BOTH, model="m", weight=3.0))
    assert fleet.views(["a"], {"a": load})[0].spec.weight == 3.0
    fleet.remove("a")
    assert fleet.views(["a"], {"a": load}) == []
