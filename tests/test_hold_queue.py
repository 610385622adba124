"""The queue stage's hold rule and its runner's order, with a fake clock and a fake placer.

What a held request waits for is its engine's work (``HoldQueue.should_hold``); what it is
ordered by is its own work there, not its prompt's length; and a request its engine's prefix
cache ties to is bound at once (``bind_affine``). The runner (``PlacementQueue``) is driven
by a placement function that applies the real hold rule to one busy engine.
"""

from __future__ import annotations

import pytest

from controlplane.prediction import Predictor
from controlplane.queueing import PlacementQueue
from controlplane.scheduling import PlacementContext, build_profile
from controlplane.scheduling.latency import predict
from controlplane.scheduling.queue import HoldQueue
from controlplane.workers import Load, Role, WorkerSpec, WorkerView
from protos import omni_proxy_pb2 as pb

S_PER_TOKEN = 1e-4     # 0.1 ms a token: a 10,000-token prompt's prefill takes 1 s


def _predictor(*wids: str) -> Predictor:
    predictor = Predictor()
    for wid in wids:
        model = predictor.model(wid)
        for i in range(100):
            model.observe_ttft(500 + 100 * i, 0.01 + S_PER_TOKEN * (500 + 100 * i))
    return predictor


def _view(wid: str, prefill_tokens: int) -> WorkerView:
    spec = WorkerSpec(id=wid, url=f"http://{wid}", role=Role.BOTH, model="m")
    return WorkerView(spec, Load(requests=1 if prefill_tokens else 0, tokens=prefill_tokens,
                                 prefill_tokens=prefill_tokens, prefills=1 if prefill_tokens else 0))


def _ctx(predictor: Predictor, rid: str, tokens: int, now: float, match: dict[str, int] | None = None,
         floor: int = 0) -> PlacementContext:
    return PlacementContext(request_id=rid, model="m", leg="entry", prompt_tokens=tokens, predictor=predictor,
                            now=now, match_blocks=dict(match or {}), floor_blocks=floor, block_size=16)


def test_a_request_its_engines_cache_ties_to_is_bound_at_once_others_wait():
    predictor = _predictor("a")
    busy = _view("a", 3000)                        # 0.3 s of prefill ahead
    q = HoldQueue(hold_s=0.15)
    # A follow-up: a holds 500 of its 600 blocks, the least-matched candidate 0: 0.8 s of compute saved.
    assert not q.should_hold(_ctx(predictor, "turn2", 9600, 100.0, {"a": 500, "b": 0}), busy)
    assert q.take_work("turn2") is None
    # A match every candidate has (a shared system prompt) ties it to no one: held.
    assert q.should_hold(_ctx(predictor, "first", 9600, 100.0, {"a": 32, "b": 32}, floor=32), busy)
    assert q.take_work("first") == (9600 - 32 * 16, "a", 2.0)   # (no target: the default 2 s budget)
    # A few blocks more than the others (3 ms of compute, under hold_s) tie it to no one either.
    assert q.should_hold(_ctx(predictor, "near", 9600, 100.0, {"a": 2, "b": 0}), busy)
    # The rule can be turned off: then it is held like any other.
    assert HoldQueue(hold_s=0.15, bind_affine=False).should_hold(
        _ctx(predictor, "turn2", 9600, 100.0, {"a": 500, "b": 0}), busy)


def test_the_work_ahead_is_the_predictions_and_runs_down_while_the_engine_computes():
    """What holds a request is the prediction's work ahead (``EngineModel.pending_s``): the
    ledger's tokens stand still until a prompt's first token, the work ahead does not."""
    predictor = _predictor("a")
    busy = _view("a", 3000)                        # 0.3 s of prefill placed and not yet computed
    q = HoldQueue(hold_s=0.15, bind_affine=False)
    predictor.progressed("a", 100.0)               # computing it since t=100
    assert q.should_hold(_ctx(predictor, "early", 2000, 100.1), busy)       # ~0.2 s left: held
    assert not q.should_hold(_ctx(predictor, "later", 2000, 100.2), busy)   # ~0.1 s left: bound
    # An engine whose progress is not known yet counts its tokens whole, at any time.
    other = _predictor("b")
    assert q.should_hold(_ctx(other, "whole", 2000, 1e6), _view("b", 3000))
    # The same tokens on an engine learned twice as fast hold nothing.
    fast = Predictor()
    for i in range(100):
        fast.model("c").observe_ttft(500 + 100 * i, 0.01 + S_PER_TOKEN / 2 * (500 + 100 * i))
    assert not q.should_hold(_ctx(fast, "fast", 2000, 100.0), _view("c", 2500))


def test_a_request_whose_own_prefill_is_long_is_bound_at_once():
    """Where a long new prompt lands decides for seconds how long the requests tied to that
    engine's cache wait; late binding could save it only the gap between engines' free times."""
    predictor = _predictor("a")
    busy = _view("a", 3000)
    q = HoldQueue(hold_s=0.15, bind_long_s=1.0)
    assert not q.should_hold(_ctx(predictor, "document", 12000, 100.0), busy)       # 1.2 s of its own
    assert q.should_hold(_ctx(predictor, "question", 8000, 100.0), busy)            # 0.8 s: held
    assert HoldQueue(hold_s=0.15, bind_long_s=0.0).should_hold(_ctx(predictor, "document", 12000, 100.0), busy)


def test_the_work_a_held_request_waits_with_is_what_its_engine_would_compute():
    predictor = _predictor("a")
    q = HoldQueue(hold_s=0.15, bind_affine=False)
    assert q.should_hold(_ctx(predictor, "doc", 8000, 50.0, {"a": 490}), _view("a", 3000))
    assert q.take_work("doc") == (8000 - 490 * 16, "a", 2.0)
    assert q.take_work("doc") is None             # taken once
    assert not q.should_hold(_ctx(predictor, "idle", 8000, 50.0), _view("b", 0))
    assert q.take_work("idle") is None            # not held: nothing noted


def test_with_hold_frac_a_request_is_held_only_while_its_engine_is_behind_its_own_ttft_budget():
    """Below overload binding at once (first come, first served on the engine) is what wins;
    holding reorders requests that would all have made it. With ``hold_frac`` a request is held
    only while its best engine's work ahead exceeds that fraction of the request's TTFT budget:
    its own target (header or [slo]) or the scorer's default, never less than ``hold_s``."""
    predictor = _predictor("a")

    def held(ahead_tokens: int, ttft_slo_s: float = 0.0, **options) -> bool:
        q = HoldQueue(**{"hold_s": 0.15, "hold_frac": 0.25, "bind_affine": False, "bind_long_s": 0.0, **options})
        ctx = _ctx(predictor, "r", 1000, 100.0)
        ctx.ttft_slo_s = ttft_slo_s
        return q.should_hold(ctx, _view("a", ahead_tokens))

    # No target given: a quarter of the default 2 s is 0.5 s: 0.3 s ahead binds, 0.8 s holds.
    assert not held(3000)
    assert held(8000)
    # The request's own target: a quarter of 1 s is 0.25 s, so 0.3 s ahead holds it ...
    assert held(3000, ttft_slo_s=1.0)
    # ... and a quarter of 4 s is 1 s, so 0.8 s ahead does not.
    assert not held(8000, ttft_slo_s=4.0)
    # Never below hold_s: a tenth of 1 s would hold 0.12 s ahead; hold_s (0.15) does not.
    assert not held(1200, ttft_slo_s=1.0, hold_frac=0.1)
    assert held(1200, ttft_slo_s=1.0, hold_frac=0.1, hold_s=0.1)
    # 0 (the default): hold_s alone, 0.3 s ahead holds.
    assert held(3000, hold_frac=0.0)


def test_with_hold_frac_a_request_bound_at_once_counts_in_the_queues_own_estimate():
    """Bound at once below the gate, a request's prefill counts in this queue's estimate of when
    the engine frees up, and the clock runs it down: the next request is held while the two
    together exceed the gate, and bound again once the engine has computed enough."""
    predictor = _predictor("a")
    q = HoldQueue(hold_s=0.15, hold_frac=0.5, bind_affine=False, bind_long_s=0.0)
    idle = _view("a", 0)
    first = _ctx(predictor, "first", 8000, 100.0)
    first.ttft_slo_s = 2.0                           # gate: 1 s of work ahead
    assert not q.should_hold(first, idle)            # nothing ahead: bound, a busy until ~100.8
    second = _ctx(predictor, "second", 8000, 100.0)
    second.ttft_slo_s = 2.0
    assert not q.should_hold(second, _view("a", 8000))   # 0.8 s ahead: bound, busy until ~101.6
    third = _ctx(predictor, "third", 1000, 100.1)
    third.ttft_slo_s = 2.0
    assert q.should_hold(third, _view("a", 16000))   # ~1.5 s ahead by both estimates: held
    later = _ctx(predictor, "third", 1000, 100.7)
    later.ttft_slo_s = 2.0
    predictor.progressed("a", 100.0)                 # computing since t=100
    assert not q.should_hold(later, _view("a", 16000))   # ~0.9 s left: bound


def test_with_bind_on_target_a_request_predicted_to_make_its_ttft_is_bound_although_its_engine_is_behind():
    """Reordering pays only when not every request can make it. Held behind the gate, chats
    whose engine was predicted to answer them within their 1 s budget waited 0.5 s and more
    in the control plane and missed (mixed chat and summaries at 4x). With ``bind_on_target``
    a request predicted, bound now, to have its first token within that fraction of its
    budget is bound; one predicted beyond it is still held."""
    predictor = _predictor("a")

    def held(ahead_tokens: int, prompt: int, **options) -> bool:
        q = HoldQueue(**{"hold_s": 0.15, "hold_frac": 0.25, "bind_affine": False, "bind_long_s": 0.0, **options})
        ctx = _ctx(predictor, "r", prompt, 100.0)
        ctx.ttft_slo_s = 1.0                     # gate: 0.25 s of work ahead
        return q.should_hold(ctx, _view("a", ahead_tokens))

    # 0.4 s ahead and a 300-token chat (0.04 s): predicted ~0.45 s, beyond the gate.
    assert held(4000, 300)                                     # off (the default): held
    assert not held(4000, 300, bind_on_target=1.0)             # within the budget: bound
    assert held(4000, 300, bind_on_target=0.4)                 # beyond 0.4 of it: held
    # 0.8 s ahead and a 3000-token prompt (0.3 s): predicted ~1.1 s, past the budget: held.
    assert held(8000, 3000, bind_on_target=1.0)
    # Below the gate nothing changes: bound either way.
    assert not held(2000, 300, bind_on_target=1.0) and not held(2000, 300)
    with pytest.raises(ValueError, match="bind_on_target"):
        HoldQueue(bind_on_target=-1.0)


def test_without_starved_first_a_starved_request_keeps_its_place_by_the_weights():
    """A request that has waited starvation_s has, at the suite's SLO, already missed its TTFT;
    put first it takes its engine for its whole prefill while those behind it starve in turn
    (mixed chat and summaries at 4x). ``starved_first = False`` leaves it to the weights."""
    short, starved = _Waiting(100, 9.5), _Waiting(9000, 8.0)      # waited 0.5 s and 2 s
    assert HoldQueue(starvation_s=1.0).order([short, starved], now=10.0) == [starved, short]
    assert HoldQueue(starvation_s=1.0, starved_first=False).order([short, starved], now=10.0) == [short, starved]


def test_hold_frac_must_not_be_negative():
    with pytest.raises(ValueError, match="hold_frac"):
        HoldQueue(hold_frac=-0.5)


class _Waiting:
    def __init__(self, work_tokens: int, enqueued_at: float, engine: str = "a", budget_s: float = 1.0) -> None:
        self.work_tokens, self.enqueued_at, self.engine, self.budget_s = work_tokens, enqueued_at, engine, budget_s


def test_with_late_last_requests_that_can_no_longer_make_their_budget_go_last():
    """Past an engine's capacity, a request that has waited so long that its prefill, started
    now, would end beyond its TTFT budget misses whatever is done; served before one that can
    still make it, both miss. ``late_last`` puts such requests after every other, first come first served
    among them (the starved too, who at the suite's SLO have waited their whole budget); one
    PD prefill engine at 1.5x: 86-88 % against 73-75 (docs/benchmarks/workloads_notes.md)."""
    predictor = _predictor("a")
    q = HoldQueue(hold_s=0.15, starvation_s=1.0, bind_affine=False, bind_long_s=0.0, late_last=True)
    assert q.should_hold(_ctx(predictor, "x", 1000, 100.0), _view("a", 9000))   # learns a's speed
    on_time_long = _Waiting(4800, 99.5)          # waited 0.5 s + 0.48 s of prefill: just in time
    on_time_short = _Waiting(500, 99.8)
    late = _Waiting(3000, 99.2)                  # waited 0.8 s + 0.3 s > 1 s
    starved = _Waiting(500, 98.9)                # waited 1.1 s: starved, and late
    patient = _Waiting(500, 98.9, budget_s=4.0)  # starved, but its 4 s budget still holds
    unknown = _Waiting(9000, 98.0, engine="")    # never held: its engine and speed unknown
    got = q.order([late, on_time_long, starved, on_time_short, patient, unknown], now=100.0)
    assert got == [unknown, patient, on_time_short, on_time_long, starved, late]
    # The engine's work ahead does not count (its estimate marked agents' turns late that would
    # have made it): behind 0.2 s of prefill let through, the long one still keeps its place.
    assert not q.should_hold(_ctx(predictor, "bound", 2000, 100.0), _view("a", 0))
    got = q.order([late, on_time_long, starved, on_time_short], now=100.0)
    assert got == [on_time_short, on_time_long, starved, late]
    # Off (the default): the starved first, then the weights, the late one among them.
    q.late_last = False
    assert q.order([late, on_time_long, starved, on_time_short, patient], now=100.0)[:2] == [starved, patient]
    assert q.order([late, on_time_long, on_time_short], now=100.0) == [on_time_short, late, on_time_long]


def test_held_requests_that_all_make_it_in_time_go_first_come_first_served():
    """Shortest first only reorders requests that would all have made it, and the longer ones
    miss: on 2 prefill + 2 decode engines at 3x held requests met the SLO 5 points below not
    held. While an engine finishes the prefill of every request held for it within
    starvation_s of its arrival, first come first served; once one would be late the engine
    is behind, and the weights (shortest first) decide, which is what gains at overload.
    Opt-in (``on_time_first``): it lost on mixed chat and summaries at 4x."""
    predictor = _predictor("a")
    q = HoldQueue(hold_s=0.15, starvation_s=1.0, bind_affine=False, bind_long_s=0.0, on_time_first=True)
    assert not q.should_hold(_ctx(predictor, "first", 5000, 100.0), _view("a", 0))   # a busy until ~100.5
    # Done at ~100.8 and ~100.85: both within 1 s of arrival.
    long_, short = _Waiting(3000, 99.9), _Waiting(500, 99.95)
    assert q.order([short, long_], now=100.0) == [long_, short]
    # 0.8 s ahead of the short one would finish it 1.4 s after it came: the weights decide.
    longer = _Waiting(8000, 99.9)
    assert q.order([longer, short], now=100.0) == [short, longer]
    # One that would leave the queue in time (its engine down to hold_s at ~100.35) but finish
    # its own prefill at ~100.95, 1.05 s after it came, is late too.
    mid = _Waiting(4500, 99.9)
    assert q.order([mid, short], now=100.0) == [short, mid]
    # One late request puts all of its engine's behind the weights, not only itself: the
    # short one goes before the long one that came first.
    late = _Waiting(8000, 99.91)
    assert q.order([long_, late, short], now=100.0) == [short, long_, late]
    # Another engine's late request does not.
    q.should_hold(_ctx(predictor, "b-first", 5000, 100.0), _view("b", 0))
    other = _Waiting(8000, 99.91, engine="b")
    assert q.order([short, other, long_], now=100.0) == [long_, short, other]
    # A request not held yet (no engine) keeps its place by the weights, after those on time.
    new = _Waiting(100, 99.99, engine="")
    assert q.order([new, long_, short], now=100.0) == [long_, short, new]
    # A starved one still goes first.
    old = _Waiting(9000, 98.5)
    assert q.order([long_, short, old], now=100.0)[0] is old
    # Off (the default): the weights alone, shortest first.
    q.on_time_first = False
    assert q.order([long_, short], now=100.0) == [short, long_]


def test_with_show_held_the_work_held_for_an_engine_counts_in_its_predicted_ttft_for_others():
    """Held work is in no ledger: without it the engine a conversation's cache follows looks no
    busier than hold_s, and its next turns wait for it while another engine is free (PD 2:2 at
    3x: the held misses waited 1.7-1.9 s while 10-15 later requests went to the other P)."""
    predictor = _predictor("a", "b")
    idle_a = _view("a", 0)
    q = HoldQueue(hold_s=0.15, bind_affine=False, bind_long_s=0.0, show_held=True)
    before = predict(_ctx(predictor, "next", 1000, 100.0), idle_a)[0]
    assert q.should_hold(_ctx(predictor, "held", 3000, 100.0), _view("a", 5000))
    assert predictor.model("a").held_tokens == 3000 and predictor.model("b").held_tokens == 0
    # Another request sees 3000 tokens (0.3 s) more ahead on a; the held one not its own work.
    assert abs(predict(_ctx(predictor, "next", 1000, 100.0), idle_a)[0] - before - 0.3) < 0.01
    assert abs(predict(_ctx(predictor, "held", 1000, 100.0), idle_a)[0] - before) < 1e-9
    # Held again for b (its best engine changed): the work moves with it.
    assert q.should_hold(_ctx(predictor, "held", 2000, 100.0), _view("b", 5000))
    assert predictor.model("a").held_tokens == 0 and predictor.model("b").held_tokens == 2000
    # Placed (not held): it leaves the prediction.
    assert not q.should_hold(_ctx(predictor, "held", 2000, 100.0), _view("b", 0))
    assert predictor.model("b").held_tokens == 0 and not predictor.held
    # Off (the default): nothing is published.
    off = HoldQueue(hold_s=0.15, bind_affine=False, bind_long_s=0.0)
    assert off.should_hold(_ctx(predictor, "quiet", 3000, 100.0), _view("a", 5000))
    assert predictor.model("a").held_tokens == 0


def test_held_work_counts_in_the_prediction_up_to_starvation_s():
    """What waits ahead of a request held for an engine is at most what that engine finishes
    within starvation_s (first come, first served for those on time; the rest go after it by
    the weights). Counted whole, at overload every engine's backlog outweighed its cache and
    held requests met the SLO no more often than not held (one shared system prompt at 16x)."""
    predictor = _predictor("a", "b")
    idle_a = _view("a", 0)
    q = HoldQueue(hold_s=0.15, bind_affine=False, bind_long_s=0.0, starvation_s=1.0, show_held=True)
    before = predict(_ctx(predictor, "next", 1000, 100.0), idle_a)[0]
    assert q.should_hold(_ctx(predictor, "h1", 6000, 100.0), _view("a", 5000))      # 0.6 s held for a
    assert abs(predict(_ctx(predictor, "next", 1000, 100.0), idle_a)[0] - before - 0.6) < 0.01
    assert q.should_hold(_ctx(predictor, "h2", 9000, 100.0), _view("a", 5000))      # 1.5 s held for a
    assert abs(predict(_ctx(predictor, "next", 1000, 100.0), idle_a)[0] - before - 1.0) < 1e-9
    q.forget("h2")
    assert abs(predict(_ctx(predictor, "next", 1000, 100.0), idle_a)[0] - before - 0.6) < 0.01


class _OneBusyEngine:
    """A placer with one engine, busy until ``free`` is set; it records what it placed."""

    def __init__(self, stage: HoldQueue, cached: dict[str, int]) -> None:
        self.stage, self.cached, self.free, self.placed = stage, cached, False, []
        self.predictor = _predictor("a")
        self.now = 10.0

    async def __call__(self, req: pb.PlaceRequest, session: str, may_hold: bool) -> pb.Placement | None:
        ctx = _ctx(self.predictor, req.request_id, req.prompt_tokens, self.now,
                   {"a": self.cached.get(req.request_id, 0)})
        if may_hold and self.stage.should_hold(ctx, _view("a", 0 if self.free else 5000)):
            return None
        self.placed.append(req.request_id)
        return pb.Placement(request_id=req.request_id)


def _entry(rid: str, tokens: int) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=tokens, max_tokens=1)


async def test_held_requests_go_in_order_of_their_work_not_their_prompts_length():
    """A question on an 8,000-token document its engine holds computes 100 tokens; a new
    1,000-token prompt computes all of it. Ordered by prompt length the question went last."""
    # (the weights alone: with starvation_s this long both are on time, first come first served)
    stage = HoldQueue(hold_s=0.15, starvation_s=60.0, bind_affine=False, show_held=True, on_time_first=False)
    placer = _OneBusyEngine(stage, cached={"question": 494})      # 7,904 of 8,000 tokens held
    queue = PlacementQueue(stage, placer)
    try:
        futures = [queue.enqueue(_entry("question", 8000), "s"), queue.enqueue(_entry("new", 1000), "s")]
        assert await queue.dispatch() == 0       # both tried and held: their work is known now
        assert [w.work_tokens for w in queue._waiting.values()] == [96, 1000]
        assert placer.predictor.model("a").held_tokens == 96 + 1000   # held work is published
        placer.free = True
        assert await queue.dispatch() == 2
        assert placer.placed == ["question", "new"]
        assert all(f.done() for f in futures)    # type: ignore[union-attr]
        assert placer.predictor.model("a").held_tokens == 0 and not placer.predictor.held   # and leaves
    finally:
        await queue.stop()


def test_the_default_policy_puts_the_late_ones_last():
    """The built-in predicted_latency (and its old name) holds with the gate and orders the
    requests that can no longer make their budget last."""
    for name in ("predicted_latency", "predicted_latency_queued"):
        queue = build_profile(name).queue
        assert queue is not None and queue.late_last and queue.hold_frac == 0.25
    assert not HoldQueue().late_last          # a custom profile's omni queue: off


async def test_with_late_last_the_runner_places_one_that_can_still_make_it_first():
    """The budget a held request is judged by is its own (its target, else the scorer's 2 s),
    noted when it was held and carried by the runner's waiter."""
    stage = HoldQueue(hold_s=0.15, starvation_s=60.0, bind_affine=False, late_last=True)
    placer = _OneBusyEngine(stage, cached={})
    queue = PlacementQueue(stage, placer)
    try:
        queue.enqueue(_entry("late", 1000), "s")
        queue.enqueue(_entry("fresh", 1000), "s")
        assert await queue.dispatch() == 0       # both held (their work and budget known now)
        assert [w.budget_s for w in queue._waiting.values()] == [2.0, 2.0]
        queue._waiting["late"].enqueued_at -= 1.95   # waited 1.95 s: with 0.1 s of prefill, late
        placer.free = True
        assert await queue.dispatch() == 2
        assert placer.placed == ["fresh", "late"]
    finally:
        await queue.stop()


async def test_a_request_never_tried_is_tried_although_the_first_in_order_are_held():
    """Requests that came while others waited are ordered by their prompt's length until a
    placement has held them once; beyond the round's first eight they must still be tried,
    or one whose engine is free waits behind eight held for a busy one."""
    stage = HoldQueue(hold_s=0.15, starvation_s=60.0, bind_affine=False)
    placer = _OneBusyEngine(stage, cached={})
    queue = PlacementQueue(stage, placer)
    try:
        for i in range(8):
            queue.enqueue(_entry(f"short{i}", 100), "s")
        assert await queue.dispatch() == 0
        queue.enqueue(_entry("long", 9000), "s")   # would be ninth in order
        placer.free = True
        placer.placed.clear()
        stage.hold_s = 1e9                         # whatever is tried now is placed
        await queue.dispatch()
        assert "long" in placer.placed
    finally:
        await queue.stop()

