"""Cache-aware placement: prefix-cache scorer, balance guard, APC-first, approximate mode."""

from __future__ import annotations


from controlplane.kvcache.events import BlockRemoved, BlockStored
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.fleet import Fleet
from controlplane.placement import Placer
from controlplane.scheduling import PlacementContext, build_profile
from controlplane.scheduling.base import Candidate
from controlplane.scheduling.pickers import CacheAwarePicker
from controlplane.scheduling.scorers import PrefixCacheScorer
from controlplane.state import MemoryStore
from controlplane.workers import Health, HealthState, Load, Role, WorkerSpec, WorkerView
from protos import omni_proxy_pb2 as pb


def w(wid, reqs=0, kv_events="", role=Role.BOTH) -> WorkerView:
    spec = WorkerSpec(id=wid, url=f"http://{wid}", role=role, model="m", kv_events=kv_events)
    return WorkerView(spec, Load(reqs, 0), HealthState(health=Health.HEALTHY))


def ctx(match, chain=10):
    return PlacementContext(request_id="r", model="m", leg="entry", roles=frozenset({Role.BOTH}),
                            chain_blocks=chain, match_blocks=match)


def test_prefix_cache_scorer_is_the_matched_fraction():
    ws = [w("a"), w("b"), w("c")]
    assert PrefixCacheScorer().score(ctx({"a": 10, "b": 5}), ws) == [1.0, 0.5, 0.0]
    assert PrefixCacheScorer().score(ctx({}, chain=0), ws) == [0.0, 0.0, 0.0]


def test_cache_aware_follows_the_cache_until_load_is_out_of_balance():
    picker = CacheAwarePicker(abs_threshold=4, rel_threshold=1.5)
    cold = w("cold", reqs=2)
    cands = [Candidate(w("warm", reqs=5), score=1.0, scores={"prefix_cache": 1.0}), Candidate(cold, score=0.0)]
    assert picker.pick(ctx({"warm": 10}), cands).worker.id == "warm"      # 5-2 <= 4: cache wins
    # 10-2 > 4 and 10 > 3
    cands = [Candidate(w("warm", reqs=10), score=1.0, scores={"prefix_cache": 1.0}), Candidate(cold, score=0.0)]
    assert picker.pick(ctx({"warm": 10}), cands).worker.id == "cold"


def test_apc_first_takes_the_deepest_match_within_budget_then_the_lighter():
    prof = build_profile("apc_first")
    a, b, c = w("a", reqs=1), w("b", reqs=0), w("c", reqs=40)   # c is over the 32-request budget
    assert prof.place(ctx({"a": 6, "b": 6, "c": 9}), [a, b, c]).worker.id == "b"   # tie on depth -> lighter
    assert prof.place(ctx({"a": 7, "b": 6, "c": 9}), [a, b, c]).worker.id == "a"
    d = prof.place(ctx({"a": 7, "b": 6, "c": 9}), [a, b, c])
    assert d.dropped == {"c": "overload"} and "match=7/10blk" in d.explain()


async def _placer(policy, workers):
    store, fleet = MemoryStore(), Fleet()
    for x in workers:
        await store.put_spec(x.spec)
        fleet.put(x.spec)
        fleet.set_state(x.id, x.state)
    placer = Placer(store, fleet, build_profile(policy))
    placer.kv = KVCache(KVCacheConfig(approx_ttl_s=60))
    return placer, store


def entry(rid, chain):
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=16 * len(chain),
                           block_hashes=chain)


async def test_approximate_mode_keeps_a_conversation_on_one_worker():
    placer, _ = await _placer("cache_aware", [w("a"), w("b"), w("c")])
    turn1 = [11, 12, 13]
    first = (await placer.place(entry("t1", turn1))).decode.worker_id
    for i, extra in enumerate(([14, 15], [14, 15, 16, 17])):
        p = await placer.place(entry(f"t{i + 2}", turn1 + extra))
        assert p.decode.worker_id == first
    assert placer.stats.predicted_hit_blocks[first] == 3 + 5


async def test_exact_mode_uses_engine_events_and_forgets_removed_blocks():
    placer, _ = await _placer("cache_aware", [w("a", kv_events="tcp://x:1"), w("b", kv_events="tcp://y:1")])
    kv = placer.kv
    kv.exact.apply("b", None, [BlockStored(block_hashes=(1, 2, 3), parent_block_hash=None, token_ids=(),
                                           block_size=16)])
    p = await placer.place(entry("r1", [1, 2, 3, 4]))
    assert p.decode.worker_id == "b" and placer.stats.predicted_hit_blocks["b"] == 3
    kv._on_events("b", None, [BlockRemoved(block_hashes=(1,))])   # as the subscriber delivers them
    assert kv.match([1, 2, 3], [w("a", kv_events="x"), w("b", kv_events="y")]) == {}


async def test_routed_prefixes_expire():
    placer, _ = await _placer("cache_aware", [w("a")])
    placer.kv.routed.ttl_s = 0.0
    await placer.place(entry("r", [7, 8]))
    assert placer.kv.match([7, 8], [w("a")]) == {}


def test_cache_aware_sends_unmatched_prompts_to_the_smallest_cache():
    picker = CacheAwarePicker()
    a, b = w("a"), w("b")
    c = ctx({}, chain=10)
    c.cached_blocks = {"a": 500, "b": 20}
    cands = [Candidate(a, score=0.0, scores={"prefix_cache": 0.0}),
             Candidate(b, score=0.0, scores={"prefix_cache": 0.0})]
    assert all(picker.pick(c, cands).worker.id == "b" for _ in range(20))
    cands[0].scores["prefix_cache"], cands[0].score = 0.4, 0.4    # a real match beats an empty cache
    assert picker.pick(c, cands).worker.id == "a"


def test_cache_aware_spreads_a_burst_of_new_prompts_by_load_not_by_cache_size():
    """New prompts of a burst have stored no blocks yet: by cache size alone they would all
    go to the engine that held the fewest blocks before the burst."""
    picker = CacheAwarePicker()
    c = ctx({}, chain=10)
    c.cached_blocks = {"a": 20, "b": 500}
    busy_small = Candidate(w("a", reqs=3), scores={"prefix_cache": 0.0})
    idle_big = Candidate(w("b", reqs=0), scores={"prefix_cache": 0.0})
    assert all(picker.pick(c, [busy_small, idle_big]).worker.id == "b" for _ in range(10))
