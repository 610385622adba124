"""The built-in cache policies' one-pass path (scheduling/fused.py) chooses what their plugins choose."""

from __future__ import annotations

import dataclasses
import random

import pytest

from controlplane.scheduling import PlacementContext, build_profile
from controlplane.scheduling import fused
from controlplane.workers import NO_METRICS, EngineMetrics, HealthState, Health, Load, Role, WorkerSpec, WorkerView


def _fleet(rng: random.Random, n: int) -> list[WorkerView]:
    """Candidates with loads drawn from few values (ties), some with engine metrics (fresh or
    stale), a few with other weights."""
    out = []
    for i in range(n):
        spec = WorkerSpec(id=f"w{i}", url=f"http://w{i}", role=Role.BOTH, model="m",
                          weight=rng.choice((1.0, 1.0, 1.0, 2.0, 0.5)))
        reqs = rng.choice((0, 0, 1, 2, 3, 40, 80))
        load = Load(reqs, reqs * rng.choice((0, 100, 512)), rng.choice((0, 0, 256, 4096)), 0)
        engine = NO_METRICS
        if rng.random() < 0.3:
            engine = EngineMetrics(running=rng.randrange(0, 60), waiting=rng.randrange(-1, 5),
                                   updated_at=rng.choice((99.0, 10.0)))
        out.append(WorkerView(spec, load, HealthState(health=Health.HEALTHY), engine))
    return out


def _context(rng: random.Random, workers: list[WorkerView], chain: list[int], explain: bool) -> PlacementContext:
    depths = {}
    for w in workers:
        d = rng.choice((0, 0, 3, 8, len(chain) // 2, len(chain) - 4, len(chain)))
        if d:
            depths[w.id] = d
    return PlacementContext(request_id="r", model="m", leg="entry", prompt_tokens=16 * len(chain), max_tokens=64,
                            now=100.0, roles=frozenset({Role.BOTH}), chain_blocks=len(chain), chain=chain,
                            match_blocks=depths, keep_scores=explain,
                            tree_sizes=lambda: {w.id: (i * 7) % 5 for i, w in enumerate(workers)})


@pytest.mark.parametrize("policy", ["cache_aware", "apc_first"])
def test_fused_path_chooses_what_the_plugins_choose(policy):
    generic, one_pass = build_profile(policy), build_profile(policy)
    assert fused.applies(one_pass.scorers, one_pass.picker)
    generic.picker.rng.seed(5)
    one_pass.picker.rng.seed(5)
    rng = random.Random(11)
    docs = [[rng.getrandbits(64) for _ in range(64)] for _ in range(4)]   # shared prefixes come back
    for _ in range(1500):
        workers = _fleet(rng, rng.choice((1, 2, 5, 12, 12)))
        doc = rng.choice(docs)
        chain = doc[:rng.randrange(16, 64)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 8))]
        if rng.random() < 0.1:
            chain = []                      # a placement without a chain
        seed = rng.getrandbits(32)
        a = _context(random.Random(seed), workers, chain, explain=True)    # explained: the plugins run
        b = _context(random.Random(seed), workers, chain, explain=False)   # the one-pass path
        if rng.random() < 0.1:              # matches given without the chain (as some callers do)
            a.chain = b.chain = ()
        got_a, got_b = generic.place(a, workers), one_pass.place(b, workers)
        assert got_a.worker is got_b.worker
        assert got_b.candidates == []
        assert (a.common_blocks, a.floor_blocks) == (b.common_blocks, b.floor_blocks)
    # every tie was broken by the same draws
    assert generic.picker.rng.random() == one_pass.picker.rng.random()


def test_fused_path_only_for_exactly_those_plugins():
    assert not fused.applies(build_profile("least_load").scorers, build_profile("least_load").picker)
    p = build_profile("predicted_latency")
    assert not fused.applies(p.scorers, p.picker)
    p = build_profile("cache_aware")
    assert not fused.applies(list(reversed(p.scorers)), p.picker)
    custom = build_profile("mine", {"mine": {"scorers": [{"name": "prefix_cache"}, {"name": "least_load"}],
                                             "picker": "near_best"}})
    assert not fused.applies(custom.scorers, custom.picker)


def test_a_decision_keeps_every_candidate_and_its_scores_unless_placement_clears_it():
    profile = build_profile("cache_aware")
    rng = random.Random(3)
    workers = _fleet(rng, 5)
    c = _context(rng, workers, [rng.getrandbits(64) for _ in range(32)], explain=True)
    decision = profile.place(c, workers)
    assert [cand.worker for cand in decision.candidates] == workers
    assert all(set(cand.scores) == {"prefix_cache", "least_load"} for cand in decision.candidates)
    quiet = profile.place(dataclasses.replace(c, keep_scores=False, common_blocks=0, floor_blocks=0), workers)
    assert quiet.candidates == [] and quiet.worker is not None
