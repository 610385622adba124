"""Each scheduling plugin on its own: filters, scorers, pickers, profiles."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from controlplane.scheduling import PlacementContext, build_profile
from controlplane.scheduling.base import Candidate
from controlplane.scheduling.filters import (DrainFilter, ExcludeFilter, HealthyFilter, ModelFilter,
                                             OverloadFilter, RoleFilter)
from controlplane.scheduling.pickers import (MaxScorePicker, NearBestPicker, PowerOfTwoPicker, RoundRobinPicker,
                                            WeightedRandomPicker)
from controlplane.scheduling.scorers import LeastLoadScorer, effective_requests
from controlplane.workers import NO_METRICS, EngineMetrics, Health, HealthState, Load, Role, WorkerSpec, WorkerView


def worker(wid: str, *, role=Role.BOTH, model="m", weight=1.0, health=Health.HEALTHY, reqs=0, toks=0,
           draining=False, engine: EngineMetrics = NO_METRICS) -> WorkerView:
    spec = WorkerSpec(id=wid, url=f"http://{wid}", role=role, model=model, weight=weight, draining=draining)
    return WorkerView(spec, Load(reqs, toks), HealthState(health=health), engine)


def ctx(**kw) -> PlacementContext:
    base = dict(request_id="r", model="m", leg="entry", roles=frozenset({Role.BOTH, Role.PREFILL}), now=100.0)
    base.update(kw)
    return PlacementContext(**base)


def test_model_filter_keeps_only_the_requested_model():
    f = ModelFilter()
    assert f.keep(ctx(), worker("a", model="m"))
    assert not f.keep(ctx(), worker("b", model="other"))


def test_role_filter_follows_the_leg():
    f = RoleFilter()
    c = ctx(roles=frozenset({Role.DECODE}))
    assert f.keep(c, worker("d", role=Role.DECODE))
    assert not f.keep(c, worker("p", role=Role.PREFILL))
    assert not f.keep(c, worker("b", role=Role.BOTH))


@pytest.mark.parametrize("health,kept", [(Health.HEALTHY, True), (Health.UNHEALTHY, False), (Health.UNKNOWN, False)])
def test_healthy_filter(health, kept):
    assert HealthyFilter().keep(ctx(), worker("a", health=health)) is kept


def test_drain_and_exclude_filters():
    assert not DrainFilter().keep(ctx(), worker("a", draining=True))
    assert DrainFilter().keep(ctx(), worker("a"))
    assert not ExcludeFilter().keep(ctx(exclude=frozenset({"a"})), worker("a"))
    assert ExcludeFilter().keep(ctx(exclude=frozenset({"a"})), worker("b"))


def test_overload_filter_budget():
    f = OverloadFilter(max_requests=2, max_tokens=100)
    assert f.keep(ctx(), worker("a", reqs=1, toks=50))
    assert not f.keep(ctx(), worker("a", reqs=2, toks=50))
    assert not f.keep(ctx(), worker("a", reqs=0, toks=100))


def test_least_load_scorer_prefers_lighter_and_respects_weight():
    s = LeastLoadScorer(tokens_per_request=0)
    light, heavy = worker("a", toks=10), worker("b", toks=100)
    scores = s.score(ctx(), [light, heavy])
    assert scores[0] > scores[1]
    # Same load, double weight: counts as half as loaded.
    big = worker("c", toks=100, weight=2.0)
    assert s.score(ctx(), [heavy, big])[1] > s.score(ctx(), [heavy, big])[0]
    assert s.score(ctx(), [worker("x"), worker("y")]) == [1.0, 1.0]


def test_engine_metrics_only_raise_the_count_and_only_when_fresh():
    def w(running, waiting, updated_at):
        return worker("a", reqs=3, engine=EngineMetrics(running=running, waiting=waiting, updated_at=updated_at))

    assert effective_requests(w(10, 2, 99.0), ctx(now=100.0, metrics_max_age_s=5)) == 12
    assert effective_requests(w(10, 2, 10.0), ctx(now=100.0, metrics_max_age_s=5)) == 3   # stale: ignored
    assert effective_requests(w(1, 0, 99.0), ctx(now=100.0, metrics_max_age_s=5)) == 3    # lower: ours wins


def test_round_robin_picker_is_smoothly_weighted():
    p = RoundRobinPicker()
    cands = [Candidate(worker("a", weight=2)), Candidate(worker("b", weight=1))]
    picks = [p.pick(ctx(), cands).worker.id for _ in range(6)]
    assert Counter(picks) == {"a": 4, "b": 2}
    assert picks[:3] in (["a", "b", "a"], ["a", "a", "b"])
    assert "".join(picks).count("aaa") == 0  # smooth: never a burst to one worker


def test_random_picker_follows_weights():
    p = WeightedRandomPicker(rng=random.Random(1))
    cands = [Candidate(worker("a", weight=9)), Candidate(worker("b", weight=1))]
    picks = Counter(p.pick(ctx(), cands).worker.id for _ in range(2000))
    assert picks["a"] > 5 * picks["b"] > 0


def test_max_score_picker_breaks_ties_randomly():
    p = MaxScorePicker(rng=random.Random(2))
    cands = [Candidate(worker("a"), score=1.0), Candidate(worker("b"), score=1.0), Candidate(worker("c"), score=0.2)]
    picks = Counter(p.pick(ctx(), cands).worker.id for _ in range(200))
    assert set(picks) == {"a", "b"}


def test_near_best_picker_lets_load_decide_what_the_scores_cannot():
    p = NearBestPicker(rng=random.Random(4))
    # a scores 3 % better (learning noise) but runs 5 requests; b is within 5 % and idle.
    cands = [Candidate(worker("a", reqs=5), score=1.0), Candidate(worker("b", reqs=0), score=0.97),
             Candidate(worker("c", reqs=0), score=0.5)]
    assert all(p.pick(ctx(), cands).worker.id == "b" for _ in range(20))
    # A real difference still wins over load.
    cands[1].score = 0.8
    assert all(p.pick(ctx(), cands).worker.id == "a" for _ in range(20))
    # Equal on both: chance.
    same = [Candidate(worker("x", reqs=1), score=1.0), Candidate(worker("y", reqs=1), score=1.0)]
    assert set(Counter(p.pick(ctx(), same).worker.id for _ in range(100))) == {"x", "y"}


def test_near_best_picker_keeps_a_conversation_on_the_engine_holding_it_beyond_the_common_prefix():
    p = NearBestPicker(rng=random.Random(6))
    # Every engine holds the 4-block system prompt; "a" also holds this conversation (20 blocks)
    # and runs more requests, its cost 3 % worse: the cache decides, not load.
    c = ctx(match_blocks={"a": 20, "b": 4, "c": 4}, common_blocks=4)
    cands = [Candidate(worker("a", reqs=6), score=0.97), Candidate(worker("b", reqs=0), score=1.0),
             Candidate(worker("c", reqs=1), score=0.99)]
    assert all(p.pick(c, cands).worker.id == "a" for _ in range(20))
    # Beyond the band the cost still wins.
    cands[0].score = 0.9
    assert all(p.pick(c, cands).worker.id == "b" for _ in range(20))
    # A new conversation (nothing beyond the common prefix anywhere): load decides.
    new = ctx(match_blocks={"a": 4, "b": 4, "c": 4}, common_blocks=4)
    cands[0].score = 0.97
    assert all(p.pick(new, cands).worker.id == "b" for _ in range(20))


def test_near_best_picker_widens_the_band_by_the_tpot_error_for_decode_legs():
    from controlplane.prediction import Predictor
    predictor = Predictor()
    for wid in ("d1", "d2"):
        model = predictor.model(wid)
        for i in range(20):       # TPOT predictions off by about 40 %
            model.observe_tpot(4, 0.004 if i % 2 else 0.008)
    p = NearBestPicker(rng=random.Random(5))
    cands = [Candidate(worker("d1", reqs=50), score=1.0), Candidate(worker("d2", reqs=1), score=0.75)]
    assert p.pick(ctx(leg="decode", predictor=predictor), cands).worker.id == "d2"
    # The same scores for a prefill leg: 25 % is a real difference.
    assert p.pick(ctx(leg="prefill", predictor=predictor), cands).worker.id == "d1"


def test_power_of_two_never_picks_the_worst_of_three():
    p = PowerOfTwoPicker(rng=random.Random(3))
    cands = [Candidate(worker("a"), score=1.0), Candidate(worker("b"), score=0.5), Candidate(worker("c"), score=0.0)]
    picks = Counter(p.pick(ctx(), cands).worker.id for _ in range(300))
    assert picks["c"] == 0 and picks["a"] > picks["b"] > 0


def test_profile_drops_with_reasons_and_explains():
    prof = build_profile("least_load")
    candidates = [worker("a", toks=10), worker("b", toks=0), worker("x")]
    others = [worker("c", health=Health.UNHEALTHY), worker("d", model="other"), worker("e", draining=True)]
    d = prof.place(ctx(exclude=frozenset({"x"})), candidates)
    assert d.worker.id == "b" and d.dropped == {"x": "excluded"}
    prof.dropped_from(ctx(), others, d.dropped)
    assert d.dropped == {"x": "excluded", "c": "healthy", "d": "model", "e": "draining"}
    text = d.explain()
    assert "*b" in text and "c dropped by healthy" in text


def test_soft_overload_filter_never_empties_the_list():
    prof = build_profile("custom", {"custom": {"filters": [{"name": "overload", "max_requests": 1}],
                                               "scorers": [{"name": "least_load"}], "picker": "max_score"}})
    ws = [worker("a", reqs=5), worker("b", reqs=3)]
    assert prof.place(ctx(), ws).worker.id == "b"
    ws.append(worker("c", reqs=0))
    d = prof.place(ctx(), ws)
    assert d.worker.id == "c" and d.dropped == {"a": "overload", "b": "overload"}


def test_unknown_plugins_are_clear_errors():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        build_profile("nope")
    with pytest.raises(ValueError, match="unknown scorer"):
        build_profile("x", {"x": {"scorers": [{"name": "magic"}]}})
    with pytest.raises(ValueError, match="bad options for filter"):
        build_profile("x", {"x": {"filters": [{"name": "overload", "bogus": 1}]}})


def test_a_profile_sets_its_shared_prefix_rule():
    """``shared`` in a profile: how many different continuations make a prefix shared."""
    from controlplane.scheduling import build_profile
    profile = build_profile("p", {"p": {"scorers": [{"name": "predicted_latency"}], "shared": {"branches": 5}}})
    assert profile.shared.branches == 5
    assert build_profile("predicted_latency").shared.branches == 2
    with pytest.raises(ValueError, match="bad options for shared"):
        build_profile("p", {"p": {"shared": {"nope": 1}}})


def test_near_best_picker_prefers_engines_predicted_to_meet_the_request_slo_within_its_band():
    from controlplane.prediction import Predictor
    p = NearBestPicker(rng=random.Random(3))
    predicted = {"a": (1.5, 0.02), "b": (0.8, 0.02)}     # a misses a 1 s TTFT target, b meets it
    cands = [Candidate(worker("a", reqs=1), score=1.0), Candidate(worker("b", reqs=5), score=0.97)]
    slo = ctx(ttft_slo_s=1.0, predictor=Predictor(), predicted=dict(predicted))
    assert p.pick(slo, cands).worker.id == "b"          # within the band: the one that meets it
    none = ctx(predictor=Predictor(), predicted=dict(predicted))
    assert p.pick(none, cands).worker.id == "a"         # no target named: load decides
    # Beyond the band the scorer's choice stands, target or not.
    far = [Candidate(worker("a", reqs=1), score=1.0), Candidate(worker("b", reqs=5), score=0.8)]
    assert p.pick(ctx(ttft_slo_s=1.0, predictor=Predictor(), predicted=dict(predicted)), far).worker.id == "a"
