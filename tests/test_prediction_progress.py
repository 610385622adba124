"""The prefill work ahead of a new prompt, less what the engine has computed of it since its
last finished prompt (``EngineModel.pending_s``): in the prediction, in what a TTFT is later
fitted against (the commit's notes), and where the marks come from (a placement onto an
engine with nothing ahead, a first token, a request's end). In process, no engines."""

from __future__ import annotations

import pytest

from controlplane.commit import ledger_charges
from controlplane.fleet import Fleet
from controlplane.lifecycle import Lifecycle
from controlplane.placement_stats import PlacementStats
from controlplane.prediction import Predictor
from controlplane.scheduling import PlacementContext
from controlplane.scheduling.latency import predict
from controlplane.state import Charge, MemoryStore, RequestRecord
from controlplane.workers import Load, Role, WorkerSpec, WorkerView
from protos import omni_proxy_pb2 as pb


def view(wid: str, prefill_tokens: int) -> WorkerView:
    load = Load(requests=1, tokens=prefill_tokens, prefill_tokens=prefill_tokens, prefills=1 if prefill_tokens else 0)
    return WorkerView(WorkerSpec(id=wid, url=f"http://{wid}", role=Role.BOTH, model="m"), load)


def ctx(predictor: Predictor, now: float) -> PlacementContext:
    return PlacementContext(request_id="q", model="m", leg="entry", roles=frozenset({Role.BOTH}), prompt_tokens=160,
                            block_size=16, predictor=predictor, now=now)


def test_pending_work_shrinks_with_the_time_the_engine_has_computed_it():
    p = Predictor()                 # priors: 1e-4 s a token
    m = p.model("a")
    assert m.pending_s(10_000, now=5.0) == pytest.approx(1.0)      # no mark yet: all of it
    p.progressed("a", 10.0)
    assert m.pending_s(10_000, now=10.4) == pytest.approx(0.6)
    assert m.pending_s(10_000, now=12.0) == 0.0                     # overdue: nothing known left
    assert m.pending_s(0, now=10.4) == 0.0
    assert p.pending_tokens("a", 10_000, 10.4) == 6_000
    p.progressed("rank-key-without-model", 10.0)                    # no model is made for it
    assert "rank-key-without-model" not in dict(p.items())


def test_predicted_ttft_counts_only_what_is_left_ahead():
    p = Predictor()
    p.model("a")
    p.progressed("a", 100.0)
    a = view("a", prefill_tokens=10_000)
    fresh, _ = predict(ctx(p, now=100.0), a)
    later, _ = predict(ctx(p, now=100.7), a)
    assert fresh == pytest.approx(0.02 + 1.0 + 0.016)
    assert later == pytest.approx(fresh - 0.7)


def test_the_commit_notes_the_work_left_ahead_for_the_fit():
    p = Predictor()
    p.model("a")
    p.progressed("a", 100.0)
    c = ctx(p, now=100.5)
    _, notes = ledger_charges(c, [(view("a", prefill_tokens=10_000), "aggregated")], flow=pb.FLOW_AGGREGATED,
                              ranks={}, record=None, now=100.5)
    assert notes["work_ahead_tokens"] == 5_000 + 160


async def test_a_first_token_and_an_end_mark_the_engine_that_computed_the_prompt():
    store, p = MemoryStore(), Predictor()
    p.model("a")
    fleet = Fleet()
    fleet.put(WorkerSpec(id="a", url="http://a", role=Role.BOTH, model="m"))
    life = Lifecycle(store, fleet, PlacementStats.new(), predictor=p)
    record = RequestRecord(request_id="r1", model="m", prompt_tokens=1000, max_tokens=10, work_ahead_tokens=1000)
    await store.reserve(record, (Charge(worker_id="a", leg="aggregated", tokens=1010, prefill_tokens=1000),))
    await life.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FIRST_TOKEN, streamed=True, ttft_ms=50))
    first = p.model("a").busy_since
    assert first > 0
    # Settled at the first token: its end is no news about the prefill queue.
    await life.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, completion_tokens=10))
    assert p.model("a").busy_since == first
    # A non-streamed request settles its prompt only at its end: that marks the engine.
    await store.reserve(RequestRecord(request_id="r2", model="m", prompt_tokens=1000, max_tokens=10),
                        (Charge(worker_id="a", leg="aggregated", tokens=1010, prefill_tokens=1000),))
    await life.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FINISHED, completion_tokens=10))
    assert p.model("a").busy_since > first
