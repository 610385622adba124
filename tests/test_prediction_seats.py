"""The engine's seats in the TTFT prediction (controlplane.prediction ``seats_of``,
``EngineModel.seat_wait_s``; controlplane.scheduling.latency ``predict``): a request placed on
an engine already running its max_num_seqs waits for a sequence to end. In process, fixed
numbers, no engines."""

from __future__ import annotations

import pytest

from controlplane.config import WorkerSpec as WorkerConfig
from controlplane.prediction import Predictor, seats_of
from controlplane.scheduling import PlacementContext
from controlplane.scheduling.latency import PredictedLatencyScorer, predict
from controlplane.workers import Load, Role, WorkerSpec, WorkerView


def view(wid: str, *, requests: int, prefill_tokens: int = 0, seats: int = 128) -> WorkerView:
    load = Load(requests=requests, tokens=prefill_tokens, prefill_tokens=prefill_tokens,
                prefills=1 if prefill_tokens else 0)
    return WorkerView(WorkerSpec(id=wid, url=f"http://{wid}", role=Role.BOTH, model="m",
                                 labels={"max_num_seqs": str(seats)}), load)


def learned(*wids: str) -> Predictor:
    """Engines that computed prompts at 5k tokens/s, decoded at 20 ms a token, and whose
    requests decoded for 4 s."""
    p = Predictor()
    for wid in wids:
        p.model(wid, "m")
        for i in range(40):
            p.observe_ttft(wid, 1000 + 100 * i, 0.01 + 2e-4 * (1000 + 100 * i))
            p.observe_tpot(wid, 10 + i, 0.02)
            p.observe_decode(wid, 4.0)
    return p


def base(p: Predictor, wid: str) -> float:
    """The predicted TTFT of this prompt (300 tokens) on an idle engine."""
    line = p.model(wid).ttft
    return line.a + line.b * 300


def ctx(p: Predictor) -> PlacementContext:
    return PlacementContext(request_id="q", model="m", leg="entry", roles=frozenset({Role.BOTH}),
                            prompt_tokens=300, block_size=16, max_tokens=200, predictor=p, now=100.0)


def test_a_full_engine_loses_to_one_with_seats_and_a_short_queue():
    """Engine a: 150 requests on 128 seats, no prompt ahead; engine b: 100 requests, 0.3 s of
    prompts ahead. a's 23 requests beyond its seats each wait for a sequence to end, one every
    4 s / 128: ~0.72 s. Without the seat term a looked idle for prefill and won."""
    p = learned("a", "b")
    a, b = view("a", requests=150), view("b", requests=100, prefill_tokens=1500)
    c = ctx(p)
    ttft_a, ttft_b = predict(c, a)[0], predict(c, b)[0]
    assert ttft_a == pytest.approx(base(p, "a") + 23 * 4.0 / 128, rel=1e-6)
    assert ttft_a > ttft_b
    scores = PredictedLatencyScorer().score(ctx(p), [a, b])
    assert scores[1] == 1.0 and scores[0] < 1.0


def test_below_its_seats_an_engine_waits_for_none():
    p = learned("a")
    c = ctx(p)
    assert predict(c, view("a", requests=127))[0] == pytest.approx(base(p, "a"))
    c = ctx(p)
    assert predict(c, view("a", requests=127, seats=100))[0] == pytest.approx(
        base(p, "a") + 28 * 4.0 / 100)


def test_before_any_decode_is_observed_a_seat_lives_the_requests_output_at_the_tpot_line():
    p = Predictor()
    c = ctx(p)
    m = p.model("a", "m")
    wait = predict(c, view("a", requests=130))[0] - base(p, "a")
    assert wait == pytest.approx(3 * 200 * m.tpot(128) / 128)


def test_the_seats_come_from_the_workers_label_else_the_default():
    assert seats_of({"max_num_seqs": "64"}, 256) == 64
    assert seats_of({}, 256) == 256
    assert seats_of({"max_num_seqs": "lots"}, 256) == 256
    assert seats_of({"max_num_seqs": "0"}, 256) == 256
    p = Predictor()
    c = ctx(p)
    assert predict(c, view("a", requests=200, seats=256))[0] == pytest.approx(base(p, "a"))


def test_a_decode_time_is_followed_not_replaced():
    p = Predictor()
    p.observe_decode("a", 4.0)
    p.observe_decode("a", 8.0)
    p.observe_decode("a", float("nan"))
    assert p.model("a").decode_s == pytest.approx(4.2)


def test_a_workers_max_num_seqs_is_checked_and_kept_as_its_label():
    w = WorkerConfig.parse_flag("http://127.0.0.1:8000,max_num_seqs=128")
    assert w.labels["max_num_seqs"] == "128"
    w = WorkerConfig.from_dict({"url": "http://127.0.0.1:8000", "max_num_seqs": 64, "labels": {"zone": "a"}})
    assert w.labels == {"zone": "a", "max_num_seqs": "64"}
    with pytest.raises(ValueError, match="max_num_seqs"):
        WorkerConfig.parse_flag("http://127.0.0.1:8000,max_num_seqs=0")
    with pytest.raises(ValueError, match="max_num_seqs"):
        WorkerConfig.parse_flag("http://127.0.0.1:8000,max_num_seqs=many")
