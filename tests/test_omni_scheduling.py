"""Omni scheduling in process: latency models, predicted-latency choice, the queue stage."""

from __future__ import annotations

import asyncio
from collections import Counter
import dataclasses
import random
import re

import pytest

from controlplane.fleet import Fleet
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.lifecycle import Lifecycle
from controlplane.placement import PlacementStats, Placer
from controlplane.prediction import EngineModel, OnlineLine, PredictionDefaults, Predictor
from controlplane.scheduling import build_profile
from controlplane.scheduling.latency import SLOFilter
from controlplane.scheduling.queue import HoldQueue
from controlplane.state import MemoryStore
from controlplane.state.base import Charge, RequestRecord
from controlplane.workers import Health, HealthState, Role, WorkerSpec
from protos import omni_proxy_pb2 as pb

# ---------------------------------------------------------------------------- prediction


def test_online_line_learns_a_known_rhythm_and_forgets_the_prior():
    line = OnlineLine(prior_a=0.2, prior_b=1e-3, prior_x=100, half_life=32)   # priors 5-7x off
    rng = random.Random(1)
    for _ in range(300):
        x = rng.uniform(0, 20_000)
        line.add(x, 0.03 + 2e-4 * x + rng.gauss(0, 0.005))   # 5k tokens/s, 30 ms base
    assert line.b == pytest.approx(2e-4, rel=0.1)
    assert line(10_000) == pytest.approx(2.03, rel=0.05)      # where the samples are, the fit is tight
    assert line.a < 0.06                                       # the wrong 0.2 s prior has faded


def test_model_adapts_when_an_engine_slows_down_and_tracks_its_error():
    model = EngineModel.new(PredictionDefaults(half_life=16))
    for i in range(200):
        model.observe_ttft(200 + 160 * (i % 50), 0.01 + 1e-4 * (200 + 160 * (i % 50)))
    fast = model.ttft(4000)
    assert fast == pytest.approx(0.41, rel=0.05)
    assert model.ttft_error.mean < 0.05
    for i in range(200):   # the engine becomes three times slower
        model.observe_ttft(200 + 160 * (i % 50), 0.01 + 3e-4 * (200 + 160 * (i % 50)))
    assert model.ttft(4000) == pytest.approx(1.21, rel=0.05)


def test_an_unobserved_engine_predicts_what_the_observed_ones_do():
    """Static priors slower than the learned engines would keep it unchosen, hence unobserved."""
    predictor = Predictor(PredictionDefaults(prefill_s_per_token=1e-3, tpot_base_s=0.05))
    for i in range(50):
        x = 200 + 100 * i
        predictor.observe_ttft("a", x, 0.01 + 2e-5 * x)
        predictor.observe_tpot("a", 1 + i % 8, 0.004 + 1e-4 * (1 + i % 8))
    learned, fresh = predictor.model("a"), predictor.model("new")
    a_before = learned.ttft(4000)
    assert fresh.ttft.n == 0 and fresh.ttft(4000) == pytest.approx(learned.ttft(4000), rel=0.3)
    assert fresh.tpot(4) == pytest.approx(learned.tpot(4), rel=0.3)
    assert fresh.ttft(4000) < 0.5 * (1e-3 * 4000)          # far from the static prior's 4 s
    # Its own observations take over from there.
    for i in range(50):
        x = 200 + 100 * i
        predictor.observe_ttft("new", x, 0.01 + 2e-4 * x)
    assert predictor.model("new").ttft(4000) == pytest.approx(0.81, rel=0.1)
    assert predictor.model("a").ttft(4000) == a_before      # another engine's samples are not a's


async def test_predicted_latency_tries_an_engine_it_has_not_observed_yet():
    plane = await make(policy="p", p={"scorers": [{"name": "predicted_latency"}]}, workers=("a", "b"))
    plane.placer.predictor = predictor = Predictor(PredictionDefaults(prefill_s_per_token=1e-3, tpot_base_s=0.05))
    for i in range(50):
        predictor.observe_ttft("a", 200 + 100 * i, 0.01 + 2e-5 * (200 + 100 * i))
        predictor.observe_tpot("a", 1 + i % 8, 0.004)
    # a is busy with one request; b, never observed, is idle: b is the better choice.
    await plane.placer.place(entry("first", tokens=1000), "s")
    first = (await plane.store.get("first")).charges[0].worker_id
    second = (await plane.placer.place(entry("second", tokens=1000), "s")).decode.worker_id
    assert {first, second} == {"a", "b"}


def test_prompts_of_one_length_teach_the_slope_not_the_intercept():
    line = OnlineLine(prior_a=0.02, prior_b=1e-4, prior_x=8192)
    for _ in range(6):
        line.add(200, 0.42)          # 2 ms per token, every prompt 200 tokens long
    assert line.b > 1e-3 and line.a < 0.2
    assert line(2000) > 2.5          # a 2k-token prompt is predicted to take seconds (prior: 0.22 s)


def test_bad_samples_are_ignored():
    line = OnlineLine(prior_a=0.1, prior_b=0.001, prior_x=10)
    for x, y in ((float("nan"), 1.0), (1.0, float("inf")), (-1.0, 1.0), (1.0, -1.0)):
        line.add(x, y)
    assert line.n == 0 and line(10) == pytest.approx(0.11)


# ---------------------------------------------------------------------------- harness


@dataclasses.dataclass
class Plane:
    store: MemoryStore
    fleet: Fleet
    placer: Placer
    lifecycle: Lifecycle

    async def load(self, wid):
        return (await self.store.loads([wid]))[wid]


async def make(policy="predicted_latency_queued", workers=("a", "b"), role=Role.BOTH, roles=None, **profiles) -> Plane:
    """``roles``: {worker id: role} for a mixed fleet (else every worker has ``role``)."""
    store, fleet, stats, predictor = MemoryStore(), Fleet(), PlacementStats.new(), Predictor()
    for wid in workers:
        spec = WorkerSpec(id=wid, url=f"http://{wid}", role=(roles or {}).get(wid, role), model="m")
        await store.put_spec(spec)
        fleet.put(spec)
        fleet.set_state(wid, HealthState(health=Health.HEALTHY))
    placer = Placer(store, fleet, build_profile(policy, profiles or None), stats=stats, predictor=predictor)
    return Plane(store, fleet, placer, Lifecycle(store, fleet, stats, predictor=predictor, queue=placer.queue))


def entry(rid, tokens=1000, **kw):
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=tokens, max_tokens=10, **kw)


def teach(plane: Plane, wid: str, s_per_token: float, tpot: float = 0.02, tpot_per_req: float = 0.0):
    model = plane.placer.predictor.model(wid)
    for i in range(100):
        model.observe_ttft(500 + 100 * i, 0.01 + s_per_token * (500 + 100 * i))
        model.observe_tpot(1 + i % 30, tpot + tpot_per_req * (1 + i % 30))


# ---------------------------------------------------------------------------- predicted latency


async def test_predicted_latency_prefers_the_engine_that_answers_first_not_the_idle_one():
    plane = await make(policy="nohold", nohold={"scorers": [{"name": "predicted_latency"}]})
    teach(plane, "a", 1e-4)        # fast engine
    teach(plane, "b", 1e-3)        # ten times slower prefill
    # a already has 3k tokens to prefill (0.3 s); b is idle but would take 1 s for 1k tokens.
    await plane.placer.place(entry("busy", tokens=3000), "s")
    assert (await plane.load("a")).prefill_tokens == 3000 or (await plane.load("b")).prefill_tokens == 3000
    first = (await plane.store.get("busy")).charges[0].worker_id
    assert first == "a"                 # both idle: the fast one
    p = await plane.placer.place(entry("next", tokens=1000), "s")
    assert p.decode.worker_id == "a"    # 0.41 s on a beats 1.01 s on b
    explained = await plane.placer.place(entry("x", tokens=1000, explain=True), dry_run=True)
    assert "ttft=" in explained.explanation and "tpot=" in explained.explanation


async def _follow_up_placement(recompute_weight: float) -> str:
    """a holds 3,000 of a 4,000-token follow-up's tokens but has 4,000 tokens queued; b is idle."""
    scorer = {"name": "predicted_latency", "recompute_weight": recompute_weight, "tpot_weight": 0.0}
    plane = await make(policy="p", p={"scorers": [scorer]})
    teach(plane, "a", 1e-4)
    teach(plane, "b", 1e-4)
    await plane.store.reserve(RequestRecord(request_id="queued", model="m", prompt_tokens=4000, max_tokens=1),
                              (Charge("a", "aggregated", 4000, prefill_tokens=4000),))
    chain = list(range(1, 251))                    # 250 blocks of 16 tokens = the 4,000 tokens
    plane.placer.kv = KVCache(KVCacheConfig())
    plane.placer.kv.placed(plane.fleet.get("a"), chain[:188], 0)      # a holds 188 blocks (3,008 tokens) of it
    p = await plane.placer.place(entry("follow", tokens=4000, block_hashes=chain), "s")
    return p.decode.worker_id


async def _follow_up_behind_queued_prompts(queued_weight: float) -> str:
    """a holds 3,008 of a 4,000-token follow-up's tokens and has 8,000 tokens queued (one
    prompt); b has three short prompts (300 tokens) still to compute."""
    scorer = {"name": "predicted_latency", "queued_weight": queued_weight, "tpot_weight": 0.0}
    plane = await make(policy="p", p={"scorers": [scorer]})
    teach(plane, "a", 1e-4)
    teach(plane, "b", 1e-4)
    await plane.store.reserve(RequestRecord(request_id="long", model="m", prompt_tokens=8000, max_tokens=1),
                              (Charge("a", "aggregated", 8000, prefill_tokens=8000),))
    for i in range(3):
        await plane.store.reserve(RequestRecord(request_id=f"short{i}", model="m", prompt_tokens=100, max_tokens=1),
                                  (Charge("b", "aggregated", 100, prefill_tokens=100),))
    chain = list(range(1, 251))
    plane.placer.kv = KVCache(KVCacheConfig())
    plane.placer.kv.placed(plane.fleet.get("a"), chain[:188], 0)
    p = await plane.placer.place(entry("follow", tokens=4000, block_hashes=chain), "s")
    return p.decode.worker_id


async def test_predicted_latency_counts_the_prompts_that_wait_behind_a_recompute():
    # Recompute counted once: b's 0.03 + 0.4 s (+0.4 recomputed) beats a's 0.8 + 0.1 (+0.1).
    assert await _follow_up_behind_queued_prompts(0.0) == "b"
    # The three prompts still to be computed on b wait for the 4,000 recomputed tokens too
    # (1.2 s more); on a, one prompt waits for 992: the follow-up stays with its prefix.
    assert await _follow_up_behind_queued_prompts(1.0) == "a"


async def test_predicted_latency_counts_the_recompute_a_placement_costs_the_fleet():
    # Its own TTFT alone: 0.1 + 0.4 (queue) on a vs 0.4 on b: it leaves its conversation.
    assert await _follow_up_placement(0.0) == "b"
    # Counting the 4,000 tokens b would compute again (0.4 s of b's capacity) against a's
    # 992: it stays where its prefix is.
    assert await _follow_up_placement(1.0) == "a"


async def test_decode_legs_within_the_tpot_target_are_balanced_by_load():
    plane = await make(workers=("d1", "d2"), role=Role.DECODE)
    teach(plane, "d1", 1e-4, tpot=0.004)      # d1's fit came out faster, both far below 100 ms
    teach(plane, "d2", 1e-4, tpot=0.009)
    got = Counter()
    for i in range(20):
        p = await plane.placer.place(pb.PlaceRequest(request_id=f"r{i}", model="m", leg=pb.LEG_DECODE,
                                                     prompt_tokens=1000, max_tokens=10), "s")
        got[p.decode.worker_id] += 1
    assert got == {"d1": 10, "d2": 10}
    # One predicted to miss the target is avoided whatever its load.
    teach(plane, "d2", 1e-4, tpot=0.3)
    p = await plane.placer.place(pb.PlaceRequest(request_id="x", model="m", leg=pb.LEG_DECODE,
                                                 prompt_tokens=1000, max_tokens=10), "s")
    assert p.decode.worker_id == "d1"


async def test_first_token_settles_prefill_work_and_teaches_the_engine():
    plane = await make(policy="least_load", workers=("a",))
    await plane.placer.place(entry("r", tokens=2000), "s")
    assert (await plane.load("a")).prefill_tokens == 2000
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=250,
                                                   streamed=True))
    assert (await plane.load("a")).prefill_tokens == 0 and (await plane.load("a")).requests == 1
    model = plane.placer.predictor.model("a")
    assert model.ttft.n == 1 and model.ttft_error.n == 1
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_FINISHED, ttft_ms=250,
                                                   latency_ms=250 + 9 * 30, completion_tokens=10))
    assert model.tpot.n == 1 and (await plane.load("a")).requests == 0


async def test_whole_response_times_do_not_teach_ttft():
    plane = await make(policy="least_load", workers=("a",))
    await plane.placer.place(entry("r", tokens=2000), "s")
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=5000,
                                                   streamed=False))
    assert plane.placer.predictor.model("a").ttft.n == 0
    assert (await plane.load("a")).prefill_tokens == 0


async def test_slo_filter_keeps_engines_predicted_to_meet_the_request_target():
    plane = await make(policy="slo_only", slo_only={"filters": [{"name": "slo"}], "picker": "round_robin"})
    teach(plane, "a", 1e-3)     # 1 s per 1k tokens
    teach(plane, "b", 1e-4)
    for i in range(6):
        p = await plane.placer.place(entry(f"r{i}", tokens=1000, ttft_slo_ms=500), "s")
        assert p.decode.worker_id == "b"
        await plane.store.end(f"r{i}")
    # Without targets, round robin uses both.
    seen = {(await plane.placer.place(entry(f"n{i}"), "s")).decode.worker_id for i in range(4)}
    assert seen == {"a", "b"}


async def test_a_named_slo_does_not_move_a_follow_up_off_its_conversation():
    """a holds 3,008 of a 4,000-token follow-up's tokens behind 4,000 queued; b is idle. A
    450 ms TTFT target: a is predicted to miss it (0.51 s), b to meet it (0.41 s) by computing
    all 4,000 tokens again, which the prompt queued there would wait for too. The default
    policy keeps the follow-up where the scorer puts it (the ``slo`` filter moved it to b)."""
    plane = await make(policy="predicted_latency")
    teach(plane, "a", 1e-4)
    teach(plane, "b", 1e-4)
    await plane.store.reserve(RequestRecord(request_id="queued", model="m", prompt_tokens=4000, max_tokens=1),
                              (Charge("a", "aggregated", 4000, prefill_tokens=4000),))
    chain = list(range(1, 251))
    plane.placer.kv = KVCache(KVCacheConfig())
    plane.placer.kv.placed(plane.fleet.get("a"), chain[:188], 0)
    p = await plane.placer.place(entry("follow", tokens=4000, block_hashes=chain, ttft_slo_ms=450, explain=True),
                                 dry_run=True)
    assert p.decode.worker_id == "a", p.explanation
    assert "dropped by slo" not in p.explanation
    # Opt-in, the filter still does what it says.
    plane.placer.profile.filters = [SLOFilter()]
    p = await plane.placer.place(entry("follow2", tokens=4000, block_hashes=chain, ttft_slo_ms=450, explain=True),
                                 dry_run=True)
    assert p.decode.worker_id == "b" and "a dropped by slo" in p.explanation, p.explanation


# ---------------------------------------------------------------------------- queue stage


class W:
    def __init__(self, work_tokens, enqueued_at):
        self.work_tokens, self.enqueued_at = work_tokens, enqueued_at


def test_queue_order_prefers_short_prompts_then_long_waiters_and_starvation_overrides():
    q = HoldQueue(starvation_s=20.0)
    short, long_, old_long = W(100, 9.0), W(8000, 9.0), W(8000, 1.0)
    order = q.order([long_, short, old_long], now=10.0)
    assert order[0] is short                     # 0.8 * shortness dominates
    assert order.index(old_long) < order.index(long_)   # waiting breaks the tie between long ones
    starved = W(9000, -11.0)                     # waited 21 s > starvation_s
    assert q.order([short, starved], now=10.0)[0] is starved


def test_queue_stage_refuses_bad_settings():
    with pytest.raises(ValueError):
        HoldQueue(on_timeout="drop")
    with pytest.raises(ValueError):
        HoldQueue(max_size=0)


async def _busy(plane: Plane, wid: str, tokens: int, rid: str):
    """Put ``tokens`` of prefill work on ``wid`` directly through the ledger."""
    from controlplane.state import Charge, RequestRecord

    await plane.store.reserve(RequestRecord(request_id=rid, model="m", prompt_tokens=tokens, max_tokens=1,
                                            session="s"), (Charge(wid, "aggregated", tokens, tokens),))


async def test_late_binding_holds_until_an_engine_frees_and_goes_to_that_engine():
    plane = await make()
    teach(plane, "a", 1e-3)
    teach(plane, "b", 1e-3)
    await _busy(plane, "a", 2000, "wa")        # 2 s of work ahead on each engine
    await _busy(plane, "b", 3000, "wb")
    answer = await plane.placer.submit(entry("held", tokens=500), "s")
    assert isinstance(answer, asyncio.Future) and len(plane.placer.queue) == 1
    await plane.placer.queue.dispatch()
    assert not answer.done()                    # still nobody free
    # b finishes its prefill first: the held request goes there, although a looked better.
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="wb", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=10))
    placement = await asyncio.wait_for(answer, 2)
    assert placement.decode.worker_id == "b" and placement.queued_ms >= 0
    assert len(plane.placer.queue) == 0
    await plane.placer.queue.stop()


async def test_cancelled_waiting_request_leaves_the_queue_at_once():
    plane = await make()
    teach(plane, "a", 1e-3)
    teach(plane, "b", 1e-3)
    await _busy(plane, "a", 5000, "wa")
    await _busy(plane, "b", 5000, "wb")
    answer = await plane.placer.submit(entry("gone"), "s")
    assert isinstance(answer, asyncio.Future)
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="gone", kind=pb.EVENT_CANCELLED))
    assert answer.cancelled() and len(plane.placer.queue) == 0
    assert plane.placer.queue.counters["cancelled"] == 1
    await plane.placer.queue.stop()


async def test_queue_bounds_full_is_overloaded_and_a_long_wait_places_anyway():
    plane = await make(policy="q", q={"scorers": [{"name": "predicted_latency"}],
                                      "queue": {"name": "omni", "max_size": 2, "max_wait_s": 0.05}})
    teach(plane, "a", 1e-3)
    teach(plane, "b", 1e-3)
    await _busy(plane, "a", 5000, "wa")
    await _busy(plane, "b", 5000, "wb")
    first = await plane.placer.submit(entry("q1"), "s")
    second = await plane.placer.submit(entry("q2"), "s")
    third = await plane.placer.submit(entry("q3"), "s")
    assert isinstance(first, asyncio.Future) and isinstance(second, asyncio.Future)
    assert isinstance(third, pb.Placement) and third.error == pb.OVERLOADED and third.retry_after_s > 0
    placed = await asyncio.wait_for(first, 2)   # max_wait_s passed: placed on the best engine anyway
    assert placed.decode.worker_id in ("a", "b") and not placed.error and placed.queued_ms >= 50
    await asyncio.wait_for(second, 2)
    assert plane.placer.queue.counters["timed_out"] == 2
    await plane.placer.queue.stop()


async def test_session_end_removes_its_waiting_requests():
    plane = await make()
    teach(plane, "a", 1e-3)
    teach(plane, "b", 1e-3)
    await _busy(plane, "a", 5000, "wa")
    await _busy(plane, "b", 5000, "wb")
    answer = await plane.placer.submit(entry("w1"), "s9")
    await plane.lifecycle.orphan_session("s9")
    assert answer.cancelled() and len(plane.placer.queue) == 0
    await plane.placer.queue.stop()


async def test_sequential_pd_releases_a_held_request_when_a_prefill_answers_not_at_the_decodes_first_token():
    """Issue 17: with the prefill engines saturated, a held request waited for D's first token
    (D's queue, the KV pull) while P sat idle. P's answer (the data plane asking for D) is
    what frees P's compute; P keeps its KV, and so its load, until D has pulled it."""
    plane = await make(workers=("p1", "p2", "d1"), roles={"p1": Role.PREFILL, "p2": Role.PREFILL,
                                                           "d1": Role.DECODE})
    for wid in ("p1", "p2"):
        teach(plane, wid, 1e-3)
    placed = {}
    for rid in ("r1", "r2"):                     # 2 s of prefill on each prefill engine
        p = await plane.placer.submit(entry(rid, tokens=2000), "s")
        assert isinstance(p, pb.Placement) and p.flow == pb.FLOW_SEQUENTIAL
        placed[rid] = p.prefill.worker_id
    assert set(placed.values()) == {"p1", "p2"}
    answer = await plane.placer.submit(entry("held", tokens=500), "s")
    assert isinstance(answer, asyncio.Future)
    await plane.placer.queue.dispatch()
    assert not answer.done()
    learned = plane.placer.predictor.model(placed["r2"]).ttft.n
    # r2's prefill engine answers; the data plane asks where D is.
    d = await plane.placer.place(pb.PlaceRequest(request_id="r2", model="m", leg=pb.LEG_DECODE,
                                                 prompt_tokens=2000, max_tokens=10), "s")
    assert d.decode.worker_id == "d1"
    p_load = await plane.load(placed["r2"])
    assert p_load.prefill_tokens == 0 and p_load.prefills == 0 and p_load.requests == 1   # KV still held
    placement = await asyncio.wait_for(answer, 2)          # before D's first token, which never comes
    assert placement.prefill.worker_id == placed["r2"]
    # P's prefill time is learned from its own answer, once: D's first token teaches it nothing.
    model = plane.placer.predictor.model(placed["r2"])
    assert model.ttft.n == learned + 1
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=9000,
                                                   streamed=True))
    assert model.ttft.n == learned + 1
    await plane.placer.queue.stop()


def test_queue_running_cap_counts_a_prefill_engines_prompts_in_progress_not_kv_it_keeps():
    from controlplane.workers import Load, WorkerView

    from controlplane.scheduling import PlacementContext

    q = HoldQueue(max_running=2)
    ctx = PlacementContext(request_id="r", model="m", leg="entry", prompt_tokens=1000)
    spec = WorkerSpec(id="p", url="http://p", role=Role.PREFILL, model="m")
    keeping = WorkerView(spec, Load(requests=5, tokens=5000, prefill_tokens=0, prefills=0))
    assert not q.should_hold(ctx, keeping)        # 5 prompts computed, KV waiting for their decodes
    assert q.should_hold(ctx, WorkerView(spec, Load(requests=5, tokens=5000, prefill_tokens=900, prefills=2)))
    both = WorkerView(dataclasses.replace(spec, role=Role.BOTH), keeping.load)
    assert q.should_hold(ctx, both)               # an aggregated engine runs what it holds


def test_a_held_engine_is_released_when_its_admitted_prefills_are_predicted_done():
    """The ledger counts a prompt's prefill until its first token is reported; the work ahead
    the queue holds by (EngineModel.pending_s) also counts the time since the engine started
    it, so the next request reaches the engine as its prefill ends, not after (held, the
    engine ran its queue dry between prompts)."""
    from controlplane.prediction import Predictor
    from controlplane.scheduling import PlacementContext
    from controlplane.workers import Load, WorkerView

    predictor = Predictor()
    model = predictor.model("a")
    for i in range(100):
        model.observe_ttft(500 + 100 * i, 0.01 + 1e-3 * (500 + 100 * i))     # 1 ms a token
    spec = WorkerSpec(id="a", url="http://a", role=Role.BOTH, model="m")
    q = HoldQueue(hold_s=0.15, bind_long_s=0.0)   # (a 2 s prompt of its own would be bound: test_hold_queue)

    def ctx(now: float) -> PlacementContext:
        return PlacementContext(request_id="r", model="m", leg="entry", prompt_tokens=2000, predictor=predictor,
                                now=now)

    done = 100.0 + 2000 * model.ttft.b                    # when the first prompt's prefill is predicted done
    assert 101.8 < done < 102.2
    idle = WorkerView(spec, Load())
    assert not q.should_hold(ctx(100.0), idle)            # admitted: ~2 s of prefill from t=100
    predictor.progressed("a", 100.0)                      # (the commit's word: nothing was ahead)
    busy = WorkerView(spec, Load(requests=1, tokens=2000, prefill_tokens=2000, prefills=1))
    assert q.should_hold(ctx(100.5), busy)                # ~1.5 s of it left
    assert q.should_hold(ctx(done - 0.2), busy)           # 0.2 s left: still more than hold_s
    # 0.1 s left, no first token reported yet (the ledger still counts 2 s): released now.
    assert not q.should_hold(ctx(done - 0.1), busy)
    # Work whose start the predictor has not seen counts whole.
    other = WorkerView(dataclasses.replace(spec, id="b"), busy.load)
    predictor.model("b").ttft = model.ttft
    assert q.should_hold(ctx(200.0), other)
    assert not q.should_hold(ctx(200.0), WorkerView(other.spec, Load(prefill_tokens=100)))   # 0.1 s: none


# ---------------------------------------------------------------------------- PD pairs


def decode_leg(rid, tokens, chain=(), **kw):
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_DECODE, prompt_tokens=tokens, max_tokens=10,
                           block_hashes=list(chain), **kw)


async def test_decode_leg_prefers_the_engine_holding_the_prefix_unless_its_tpot_misses_the_target():
    plane = await make(workers=("d1", "d2"), role=Role.DECODE)
    teach(plane, "d1", 1e-4, tpot=0.01)
    teach(plane, "d2", 1e-4, tpot=0.01)
    chain = list(range(1, 2001))                 # 32,000 tokens: 160 ms to pull at 5 us a token
    plane.placer.kv = KVCache(KVCacheConfig())
    plane.placer.kv.placed(plane.fleet.get("d1"), chain, 0)        # d1 decoded the previous turn
    for i in range(3):                           # d1 is the busier one
        await plane.store.reserve(RequestRecord(request_id=f"busy{i}", model="m", prompt_tokens=10, max_tokens=10),
                                  (Charge("d1", "decode", 20),))
    for i in range(5):
        p = await plane.placer.place(decode_leg(f"r{i}", 32000, chain), "s")
        assert p.decode.worker_id == "d1"        # it pulls nothing, and has TPOT headroom
        await plane.store.end(f"r{i}")
    # A prefix holder predicted to miss the TPOT target loses to one that pulls everything.
    teach(plane, "d1", 1e-4, tpot=0.3)
    assert (await plane.placer.place(decode_leg("x", 32000, chain), "s")).decode.worker_id == "d2"


async def test_a_prefill_worker_is_judged_with_its_paired_decode_engines_pull_and_tpot():
    """A PD path costs P's prefill, D's pull and D's TPOT: an aggregated engine as fast as P
    with the same TPOT wins (without the pull it was a tie)."""
    plane = await make(policy="nohold", nohold={"scorers": [{"name": "predicted_latency"}], "picker": "max_score"},
                       workers=("p1", "d1", "a1"), roles={"p1": Role.PREFILL, "d1": Role.DECODE, "a1": Role.BOTH})
    for wid in ("p1", "d1", "a1"):
        teach(plane, wid, 1e-4, tpot=0.03)
    p = await plane.placer.place(entry("r", tokens=32000, explain=True), "s")
    assert p.flow == pb.FLOW_AGGREGATED and p.decode.worker_id == "a1", p.explanation
    assert "paired decode: d1" in p.explanation
    pull = re.search(r"paired decode: d1 \(kv pull (\d+)ms", p.explanation)
    line = plane.placer.predictor.model("d1").pull
    assert pull and int(pull.group(1)) == round((line.a + line.b * 32000) * 1000)


def test_the_paired_decode_engine_is_the_one_that_pulls_least_with_tpot_headroom():
    from controlplane.scheduling.base import PlacementContext
    from controlplane.scheduling.latency import pair_decode
    from controlplane.workers import Load, WorkerView

    predictor = Predictor()

    def views(d2_requests):
        return [WorkerView(WorkerSpec(id=d, url=f"http://{d}", role=Role.DECODE, model="m"), Load(requests=n))
                for d, n in (("d1", 0), ("d2", d2_requests))]

    ctx = PlacementContext(request_id="r", model="m", leg="entry", prompt_tokens=32000, predictor=predictor)
    pair_decode(ctx, views(10), {})
    assert ctx.pair_decode == "d1"               # nobody holds it: the less loaded one
    line = predictor.model("d1").pull
    assert ctx.pair[0] == pytest.approx(line.a + line.b * 32000)
    pair_decode(ctx, views(10), {"d2": 2000})    # d2 holds the whole prompt: no pull
    assert ctx.pair_decode == "d2" and ctx.pair[0] == pytest.approx(predictor.model("d2").pull.a)
    pair_decode(ctx, views(40), {"d2": 2000})    # ... but its batch would cost more TPOT than the pull
    assert ctx.pair_decode == "d1"


async def test_a_decodes_first_token_teaches_its_kv_pull_of_the_tokens_it_lacked():
    plane = await make(workers=("p1", "d1"), roles={"p1": Role.PREFILL, "d1": Role.DECODE})
    chain = list(range(1, 101))                  # 1,600 tokens; d1 holds the first 60 blocks
    plane.placer.kv = KVCache(KVCacheConfig())
    plane.placer.kv.placed(plane.fleet.get("d1"), chain[:60], 0)
    await plane.placer.place(entry("r", tokens=1600, block_hashes=chain), "s")
    await plane.placer.place(decode_leg("r", 1600, chain), "s")
    record = await plane.store.get("r")
    assert record.pull_tokens == 1600 - 60 * 16 and record.decode_placed_at > 0
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=80,
                                                   streamed=True))
    model = plane.placer.predictor.model("d1")
    assert model.pull.n == 1 and model.pull_error.n == 1
    assert plane.placer.predictor.model("p1").pull.n == 0
