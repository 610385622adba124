"""What the learned lines predict where they have seen no data (controlplane.prediction): a
decode step's line beyond the batches it has seen, and what the scorer does with it. In
process, fixed numbers, no engines."""

from __future__ import annotations

import pytest

from controlplane.prediction import EngineModel, OnlineLine, PredictionDefaults, Predictor
from controlplane.scheduling import PlacementContext
from controlplane.scheduling.latency import PredictedLatencyScorer
from controlplane.workers import Load, Role, WorkerSpec, WorkerView


def steep_start(line: OnlineLine) -> None:
    """TPOT samples at batches 1-10 that climb 2 ms a request (prefill chunks sharing the steps)."""
    for i in range(40):
        x = 1 + i % 10
        line.add(x, 0.008 + 2e-3 * x)


def test_a_tpot_line_goes_on_at_no_more_than_the_prior_slope_beyond_the_batches_seen():
    bounded = OnlineLine(prior_a=0.02, prior_b=5e-4, prior_x=32.0, bounded_slope=True)
    free = OnlineLine(prior_a=0.02, prior_b=5e-4, prior_x=32.0)
    steep_start(bounded)
    steep_start(free)
    assert bounded.b > 1.5e-3 and bounded.x_hi == 10          # the fit: steep, as the samples
    # Where the samples are, the same fit.
    assert bounded(6) == pytest.approx(free(6)) == pytest.approx(0.02, rel=0.1)
    # At a batch of 100: the fit's 0.18 s extrapolated, against the largest batch seen's 0.027 s
    # plus the prior's 0.5 ms for each request beyond it.
    assert free(100) > 0.17
    assert bounded(100) == pytest.approx(bounded(bounded.x_hi) + 5e-4 * (100 - bounded.x_hi))
    assert bounded(100) < 0.08


def test_a_flatter_fit_than_the_prior_is_kept_beyond_the_batches_seen():
    line = OnlineLine(prior_a=0.02, prior_b=5e-4, prior_x=32.0, bounded_slope=True)
    for i in range(40):
        line.add(1 + i % 10, 0.01 + 1e-4 * (1 + i % 10))
    assert line.b < 5e-4 and line(100) == pytest.approx(line.a + line.b * 100)


def test_the_batches_seen_fade_with_the_samples():
    line = OnlineLine(prior_a=0.02, prior_b=5e-4, prior_x=32.0, half_life=16, bounded_slope=True)
    line.add(100, 0.03)
    for _ in range(64):            # four half-lives at batches of 5
        line.add(5, 0.02)
    assert 5 <= line.x_hi < 100 / 8


def test_before_any_sample_the_bounded_line_is_the_prior():
    line = OnlineLine(prior_a=0.02, prior_b=5e-4, prior_x=32.0, bounded_slope=True)
    assert line(40) == pytest.approx(0.02 + 5e-4 * 40)


def test_an_engine_model_bounds_its_tpot_line_not_its_ttft_line():
    m = EngineModel.new(PredictionDefaults())
    assert m.tpot.bounded_slope and not m.ttft.bounded_slope and not m.pull.bounded_slope


def view(wid: str, *, requests: int, prefill_tokens: int) -> WorkerView:
    load = Load(requests=requests, tokens=prefill_tokens, prefill_tokens=prefill_tokens,
                prefills=1 if prefill_tokens else 0)
    return WorkerView(WorkerSpec(id=wid, url=f"http://{wid}", role=Role.BOTH, model="m"), load)


def test_a_busy_decoder_with_no_prefill_ahead_wins_over_a_queue_of_prompts():
    """The hetero case's failure: engine a, 100 requests decoding and no prompt ahead; engine b,
    1.5 s of prompts ahead. Both learned TPOT at batches 1-10 only (2 ms a request)."""
    p = Predictor()
    for wid in ("a", "b"):
        m = p.model(wid)
        for i in range(40):
            m.observe_ttft(1000 + 100 * i, 0.01 + 2e-4 * (1000 + 100 * i))
        steep_start(m.tpot)
    c = PlacementContext(request_id="q", model="m", leg="entry", roles=frozenset({Role.BOTH}), prompt_tokens=2000,
                         block_size=16, predictor=p, now=100.0)
    a, b = view("a", requests=100, prefill_tokens=0), view("b", requests=20, prefill_tokens=7500)
    scores = PredictedLatencyScorer().score(c, [a, b])
    assert scores[0] == 1.0 and scores[1] < 0.8


def test_an_unobserved_engine_starts_from_the_fleets_median_line():
    """One vote per engine: neither the busiest engine's samples nor the one slow engine decide."""
    p = Predictor()
    for i in range(200):                      # a: slow (4e-4 s a token), and the busiest by far
        x = 500 + 50 * (i % 40)
        p.observe_ttft("slow", x, 0.01 + 4e-4 * x)
    for wid in ("b", "c"):                    # b, c: 2e-4 s a token, a few samples each
        for i in range(8):
            x = 500 + 250 * i
            p.observe_ttft(wid, x, 0.01 + 2e-4 * x)
    fresh = p.model("new")
    assert fresh.ttft.n == 0
    assert fresh.ttft.b == pytest.approx(p.model("b").ttft.b) == pytest.approx(2e-4, rel=0.15)
    assert fresh.ttft(4000) == pytest.approx(p.model("c").ttft(4000), rel=0.05)


def test_before_any_sample_every_engine_has_the_static_priors():
    p = Predictor(PredictionDefaults(prefill_s_per_token=3e-4, ttft_base_s=0.05))
    assert p.model("a").ttft(1000) == pytest.approx(0.35)
    assert p.fleet_tpot(1) == pytest.approx(p.defaults.tpot_base_s + p.defaults.tpot_s_per_request)


def test_the_median_is_over_the_engines_serving_the_same_model():
    """A new engine of the big model starts from the big model's engines, not the small one's;
    an engine of a model nobody has observed starts from the static priors."""
    p = Predictor()
    for wid, served, s_per_token in (("big-1", "big", 8e-4), ("small-1", "small", 1e-4), ("small-2", "small", 1e-4)):
        p.model(wid, served)
        for i in range(20):
            x = 500 + 100 * i
            p.observe_ttft(wid, x, 0.01 + s_per_token * x)
            p.observe_tpot(wid, 1 + i % 8, (0.03 if served == "big" else 0.01) + 1e-4 * (1 + i % 8))
    big, small, other = p.model("big-2", "big"), p.model("small-3", "small"), p.model("x-1", "other")
    assert big.ttft(4000) == pytest.approx(p.model("big-1").ttft(4000), rel=0.01)
    assert small.ttft(4000) == pytest.approx(p.model("small-1").ttft(4000), rel=0.05)
    assert big.ttft(4000) > 5 * small.ttft(4000)
    assert other.ttft(4000) == pytest.approx(p.defaults.ttft_base_s + p.defaults.prefill_s_per_token * 4000)
    assert p.fleet_tpot(1, "big") > 2 * p.fleet_tpot(1, "small")
    # The served model is kept from the first call that names it.
    assert p.model("big-2").served == "big"


def test_an_unobserved_engine_adopts_the_fleets_tpot_line_but_not_its_slope_as_the_bound():
    """The mixed case's failure: one engine's first TPOT samples (small batches, prefill chunks in
    their steps) fitted 2 ms a request; the engines not observed yet took that slope as their
    prior and so as their bound, and with no batch of their own seen, a busy one was predicted
    0.23 s at a batch of 84. The bound stays the configured prior's slope."""
    p = Predictor()
    steep_start(p.model("seen").tpot)
    p.observe_tpot("seen", 10, 0.028)      # (through the predictor: the fleet's line moves)
    seen = p.model("seen").tpot
    assert seen.b > 1.5e-3
    fresh = p.model("fresh").tpot
    assert fresh.n == 0 and fresh.b == pytest.approx(seen.b) and fresh.a == pytest.approx(seen.a)
    assert fresh.cap_b == p.defaults.tpot_s_per_request
    # Beyond the batches it has seen (none), no faster than the configured prior's 0.5 ms a request.
    assert fresh(85) == pytest.approx(fresh.a + p.defaults.tpot_s_per_request * 85)
    assert fresh(85) < 0.07 < fresh.a + fresh.b * 85
    # Its own first samples (small batches again) do not lift the bound either.
    for i in range(8):
        fresh.add(1 + i % 4, 0.01 + 2e-3 * (1 + i % 4))
    assert fresh.cap_b == p.defaults.tpot_s_per_request
    assert fresh(85) == pytest.approx(fresh(fresh.x_hi) + fresh.cap_b * (85 - fresh.x_hi))


def test_a_busy_engine_not_observed_yet_wins_over_an_observed_one_with_a_long_queue():
    """The decision the bound changes: engine a, 84 requests decoding, no prompt ahead, not
    observed yet; engine b, observed at small batches (2 ms a request), 1.9 s of prompts ahead."""
    p = Predictor()
    p.model("b", "m")
    for i in range(40):
        p.observe_ttft("b", 1000 + 100 * i, 0.01 + 2e-4 * (1000 + 100 * i))
    steep_start(p.model("b").tpot)
    p.observe_tpot("b", 10, 0.028)
    c = PlacementContext(request_id="q", model="m", leg="entry", roles=frozenset({Role.BOTH}), prompt_tokens=300,
                         block_size=16, predictor=p, now=100.0)
    a, b = view("a", requests=84, prefill_tokens=0), view("b", requests=60, prefill_tokens=9500)
    scores = PredictedLatencyScorer().score(c, [a, b])
    assert scores[0] == 1.0 and scores[1] < 0.8
