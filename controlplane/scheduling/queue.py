"""The queue stage: late binding (Omni's request holding), as a policy.

Committing a request to an engine the moment it arrives piles a burst into engine queues
that are first come, first served, and the engine that frees up first is rarely the one
that was chosen. With this stage a request whose best engine is predicted to be busy for
longer than ``hold_s`` (with ``hold_frac``, and than that fraction of the request's own TTFT
target) waits in the control plane instead, and is bound to an engine only when one can start
it soon. Waiting requests are ordered by Omni's weight of shortness and
waiting time (0.8 / 0.2), which is what gains when not all can make it; with
``on_time_first`` (off) those held for an engine that finishes all of them within
``starvation_s`` go first come, first served. A request that has waited ``starvation_s``
goes ahead of every other one; with ``late_last`` (off) one that can no longer meet its TTFT
budget goes after every other instead. With ``show_held`` (off) the work held for each engine counts in the prediction,
so the policy does not keep choosing an engine whose turns already wait here. The queue is
bounded in size (beyond: refused, HTTP 429) and in wait (beyond: placed on the best engine
anyway, or refused: ``on_timeout``).

The constants are seconds of wall-clock time, not parts of the request's TTFT target nor
of the engines' speed. ``hold_s`` is how much work an engine keeps queued so that it never
runs dry while a released request reaches it; an engine twice as fast has its work ahead
predicted in half the seconds already (its learned line). Scaled by a request's own TTFT
target (``X-SLO-TTFT-Ms``), ``starvation_s``, ``max_wait_s`` and ``bind_long_s`` cost
attainment: mixed chat and summaries at 4x with the targets sent as headers, held requests
met the SLO 28-40 % in four runs against 46.7 % in two unscaled: a shorter ``max_wait_s`` places
more late requests on engines already behind, ahead of requests that could still make it
(docs/benchmarks/pd_queue.md).

This class is the policy; ``controlplane.queueing`` runs it. ``PhaseWindow`` (queue
``phase_window``) holds for another reason: to dispatch the prefills of a data-parallel
engine whose ranks step together in one window (seed 003's PD-hybrid; see its docstring).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from controlplane.scheduling.base import PlacementContext
from controlplane.scheduling.latency import TTFT_TARGET_S, predict
from controlplane.workers import Role, WorkerView


class HeldWork(NamedTuple):
    """What a held request would compute on the engine it was last held for, that engine, and
    the request's TTFT budget in seconds (its target, else the scorer's default)."""

    tokens: int
    worker: str
    budget_s: float = TTFT_TARGET_S


@dataclass
class HoldQueue:
    max_size: int = 1024
    max_wait_s: float = 3.0
    hold_s: float = 0.15
    max_running: int = 0            # also hold while the best engine runs this many (0: off)
    shortness_weight: float = 0.8
    wait_weight: float = 0.2
    starvation_s: float = 1.0
    on_timeout: str = "place"       # place | reject
    # Bind at once a request whose chosen engine holds more of its prompt than the others
    # would, by more than hold_s of compute (see should_hold); False: hold it like any other.
    bind_affine: bool = True
    # Bind at once a request whose own prefill on its chosen engine is predicted to take
    # longer than this (0: off; see should_hold).
    bind_long_s: float = 1.0
    # Order first come, first served the requests held for an engine whose queue, so ordered,
    # finishes every one's prefill within starvation_s (see order). Off: it brought PD 2:2 at
    # 3x from 5 points below not held to about 1, but lost 10 on mixed chat and summaries at 4x
    # (64.7, 64.3 % against 74.3, 75.7 not held; the weights alone were level there)
    # (docs/benchmarks/pd_queue.md, sixth session); False: Omni's weights alone.
    on_time_first: bool = False
    # Hold only while the best engine's work ahead exceeds this fraction of the request's own
    # TTFT budget (its X-SLO-TTFT-Ms, else the deployment's [slo] ttft_ms, else the scorer's
    # default target), and never below hold_s (see _threshold). 0: hold_s alone; the built-in
    # predicted_latency_queued sets 0.25.
    hold_frac: float = 0.0
    # A request that has waited starvation_s goes ahead of every other one (see order); False:
    # the weights alone (its waiting time still counts), max_wait_s bounds its wait.
    starved_first: bool = True
    # Bind at once a request predicted, on its chosen engine, to have its first token within
    # this fraction of its TTFT budget (the budget as for hold_frac; 0: off; see _on_target).
    bind_on_target: float = 0.0
    name: str = "omni"
    # per worker: when the prefills this queue let through are predicted done (see should_hold)
    _busy_until: dict[str, float] = field(default_factory=dict, repr=False)
    # per request held: the prompt tokens its best engine would compute, and which (see take_work)
    _work: dict[str, HeldWork] = field(default_factory=dict, repr=False)
    # per worker: its learned seconds per prompt token, as of its last hold decision (see order)
    _rate: dict[str, float] = field(default_factory=dict, repr=False)
    # Publish the work held for each engine to the prediction, up to starvation_s of it (see
    # _publish). Off: on mixed chat and summaries at 4x it cost 13-17 points (held requests met
    # the SLO 51.3, 64.7 % with it against 70.3, 79.7 without; not held 73.3, 77.0), and its
    # gain on 2 prefill + 2 decode engines at 3x did not show through this session's noise
    # (docs/benchmarks/pd_queue.md, sixth session).
    show_held: bool = False
    # Order last (first come, first served among them) the held requests that can no longer
    # meet their TTFT budget: waited + their own prefill on their engine beyond it (see _late).
    # Off: the starved go first, then the weights.
    late_last: bool = False
    _predictor: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.on_timeout not in ("place", "reject"):
            raise ValueError(f"on_timeout must be place or reject, got {self.on_timeout!r}")
        for key in ("max_wait_s", "hold_s", "starvation_s", "bind_long_s", "hold_frac", "bind_on_target"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0")
        if self.max_size < 1:
            raise ValueError("max_size must be >= 1")

    def should_hold(self, ctx: PlacementContext, chosen: WorkerView) -> bool:
        """Hold while even the best engine has more than ``hold_s`` of prefill work ahead;
        when not held, the request is placed there, and its prefill counts from now on.

        Work ahead is the smaller of two estimates, and a request is released as soon as
        either says the engine frees up within ``hold_s``, so it reaches the engine before its
        queue runs dry. One is the prediction's (``EngineModel.pending_s``, what the scorer
        adds to a candidate's TTFT): the uncached tokens placed and not yet computed at the
        engine's learned speed, less what it has computed since its last prompt was done. The
        other is this queue's own: when the prompts it let through are predicted done, each
        after the previous ones, running down with the clock from their admission. Alone, the
        first held requests for longer (it restarts at every first token, and a prompt's first
        token is reported after its prefill): on one shared system prompt at 8x and 16x held
        requests met the SLO 70-73 and 49-51 % with it alone, against 77-80 and 54-58 % with
        both (docs/benchmarks/pd_queue.md). Before either, the ledger's count alone (which
        stands still until a prompt's first token) kept every request behind a 40k-token
        prompt held for its whole prefill, and the engine idled between prompts
        (docs/benchmarks/workloads_notes.md).
        """
        if self.max_running:
            # A prefill engine is busy with the prompts it still computes, not with those whose
            # KV it only keeps until a decode engine pulls it (sequential PD).
            load = chosen.load
            if (load.prefills if chosen.spec.role is Role.PREFILL else load.requests) >= self.max_running:
                return self._held(ctx, chosen.id)
        if ctx.predictor is None:
            return False
        wid = chosen.id
        model = ctx.predictor.model(wid)
        s_per_token = model.ttft.b
        now = ctx.now or time.monotonic()
        ahead = model.pending_s(chosen.load.prefill_tokens, now)
        # (work this queue did not admit, placed before it saw the engine or by another
        # replica, is taken as started now)
        busy_until = self._busy_until.get(wid, now + ahead)
        if len(self._rate) >= 65536 and wid not in self._rate:
            self._rate.clear()
        self._rate[wid] = s_per_token
        threshold = self._threshold(ctx)
        if ahead > threshold and busy_until - now > threshold and not self._affine(ctx, wid, s_per_token) \
                and not self._long(ctx, wid, s_per_token) and not self._on_target(ctx, chosen):
            return self._held(ctx, wid)
        self.forget(ctx.request_id)
        if len(self._busy_until) >= 65536 and wid not in self._busy_until:
            self._busy_until.clear()
        self._busy_until[wid] = (busy_until if busy_until > now else now) + s_per_token * ctx.uncached_tokens(wid)
        return False

    def _threshold(self, ctx: PlacementContext) -> float:
        """The work ahead beyond which the request is held: ``hold_s``, or with ``hold_frac``
        that fraction of the request's TTFT budget if more.

        Below overload, binding at once (first come, first served on the engine) is what
        wins: holding at ``hold_s`` reorders, shortest first, requests that would all have met
        their TTFT, and the longer ones miss (2 prefill + 2 decode engines at 3x: 89.4 % held
        against 93.7 % not held). Reordering pays only when not every request can make it,
        i.e. when the engine is behind by a part of the request's own budget. The budget is
        the request's (``ttft_slo_s``: its X-SLO-TTFT-Ms, else the deployment's [slo]), else
        the scorer's default target. A quarter (``predicted_latency_queued``) kept the gains at
        overload and brought that cell level (92.5 % held against 93.0 over 8 runs each); half
        or three quarters of it bound so much at once that the control plane had little left
        to reorder (one shared system prompt at 16x: 43-53 % against 57-59 with a quarter).
        Holding every request for an engine down to ``hold_s`` once one is held for it lost
        22-26 points on mixed chat and summaries at 4x (docs/benchmarks/pd_queue.md, seventh
        session).
        """
        if not self.hold_frac:
            return self.hold_s
        budget = ctx.ttft_slo_s or TTFT_TARGET_S
        return max(self.hold_s, self.hold_frac * budget)

    def _on_target(self, ctx: PlacementContext, chosen: WorkerView) -> bool:
        """The request is predicted, bound now, to have its first token on its chosen engine
        within ``bind_on_target`` of its TTFT budget (``predict``: the engine's work ahead and
        the request's own prefill, what the scorer chose it by): holding it can only make it
        later.

        Reordering pays when not every request can make it; a request that can is what it would
        reorder. On mixed chat and summaries at 4x (the summaries' prompts keep every engine
        more than a quarter of the 1 s budget behind) the default held most chats although
        their best engine was predicted to answer them in 0.1-0.9 s: of the chats that missed
        their TTFT in three runs, 91-95 % had been held and predicted within the budget when
        they arrived, and 86-91 % took under 1 s once on the engine; bound on arrival, 2-7 chats
        of 260 missed. With 0.5 of the budget mixed at 4x met the SLO 86.5 % against 64.1 %;
        with 1.0, so much was bound at overload that one shared system prompt at 16x lost 9
        points (docs/benchmarks/workloads_notes.md, "Mixed traffic at 4x: the queue held chats
        that would have made it").
        """
        if not self.bind_on_target:
            return False
        budget = ctx.ttft_slo_s or TTFT_TARGET_S
        return predict(ctx, chosen)[0] <= self.bind_on_target * budget

    def _affine(self, ctx: PlacementContext, wid: str, s_per_token: float) -> bool:
        """The chosen engine holds more of the prompt than the least-matched candidate by more
        than ``hold_s`` of compute: binding now is what pays.

        Late binding gains when any engine that frees first will do. A request its engine's
        prefix cache ties to (a conversation's next turn, an agent's next step, a question on
        a document) has nowhere better to go; held, it is placed again at every round, and
        the first round in which another engine looks free (the ledger counts the busy one's
        prompts until their first tokens) sends it there to compute its prefix again. Held,
        such requests met the SLO less often than bound at once: long-document QA 47.5 %
        against 63.3 % at 8x, agents 69.7 % against 76.3 % at 16x (docs/benchmarks/pd_queue.md).
        """
        if not self.bind_affine or not ctx.match_blocks:
            return False
        ahead = ctx.match_blocks.get(wid, 0) - ctx.floor_blocks
        return ahead > 0 and ahead * ctx.block_size * s_per_token > self.hold_s

    def _long(self, ctx: PlacementContext, wid: str, s_per_token: float) -> bool:
        """The request's own prefill on the chosen engine is predicted to take more than
        ``bind_long_s``: it is bound now, where the policy weighs it against the ledger as it
        stands.

        Late binding can save such a prompt at most the gap between the engines' free times,
        a fraction of its own prefill, while where it lands decides for seconds how long every
        request tied to that engine's cache waits. Held, the first question on each long
        document (8-12k simulated tokens, 2 of 120 requests held at 4x) went to whichever
        engine freed first, often the one holding a hot document, whose next questions were
        then copied elsewhere: long-document QA held met the SLO 73.3-75.8 % against 80.8 %
        unheld at 4x; with this rule 80.8 % (docs/benchmarks/pd_queue.md).
        """
        return self.bind_long_s > 0 and ctx.uncached_tokens(wid) * s_per_token > self.bind_long_s

    def _held(self, ctx: PlacementContext, wid: str) -> bool:
        """Note the held request's work on the engine it waits for (``take_work``)."""
        if len(self._work) >= 65536:
            self._work.clear()
        work = self._work[ctx.request_id] = HeldWork(ctx.uncached_tokens(wid), wid, ctx.ttft_slo_s or TTFT_TARGET_S)
        if self.show_held and ctx.predictor is not None:
            self._publish(ctx.predictor, ctx.request_id, work)
        return True

    def _publish(self, predictor: Any, request_id: str, work: HeldWork) -> None:
        """Count a held request's work on the engine it waits for in the prediction
        (``EngineModel.held_tokens``), which the ``predicted_latency`` scorer adds to that
        engine's work ahead.

        Work held here is work no ledger shows: the engine whose prefix cache a conversation
        follows looks no busier than ``hold_s``, so the policy keeps choosing it for every next
        turn, and they wait in the control plane while another engine takes later arrivals.
        On 2 prefill + 2 decode engines at 3x, the held requests that missed their TTFT waited
        1.7-1.9 s for one prefill engine while 10-15 later ones went to the other; not held,
        that engine's queue shows in the ledger and the policy sends the next turns elsewhere
        (docs/benchmarks/pd_queue.md, fifth session).

        It counts up to ``starvation_s`` of it (``Predictor.held_cap_s``): while an engine
        finishes its held requests within ``starvation_s`` they go first come, first served
        (``_on_time``), so no more than that is ahead of a new one; beyond, the engine is
        behind and the weights put shorter work first, not the backlog. Counted whole, at
        overload every engine's backlog decided instead of its cache, conversations were
        computed again elsewhere, and held requests met the SLO no more often than not held
        (one shared system prompt at 16x: 46.7, 47.0 % against 47.7, 47.3; capped 49.3, 53.3;
        docs/benchmarks/pd_queue.md, sixth session)."""
        self.forget(request_id)
        self._predictor = predictor
        predictor.held_cap_s = self.starvation_s
        if len(predictor.held) >= 65536:
            for wid, _ in predictor.held.values():
                predictor.model(wid).held_tokens = 0
            predictor.held.clear()
        predictor.held[request_id] = (work.worker, work.tokens)
        predictor.model(work.worker).held_tokens += work.tokens

    def forget(self, request_id: str) -> None:
        """The request is no longer held (placed, or gone): its work leaves the prediction."""
        predictor = self._predictor
        if predictor is None:
            return
        old = predictor.held.pop(request_id, None)
        if old is not None:
            model = predictor.model(old[0])
            model.held_tokens = max(model.held_tokens - old[1], 0)

    def take_work(self, request_id: str) -> HeldWork | None:
        """The prompt tokens the engine a request was last held for would compute (what it
        does not hold in its prefix cache) and that engine, or None if it was not held since
        the last call.

        The runner orders waiting requests by it. A prompt's length is not its cost: a
        question on a 10k-token document its engine holds, or an agent's next turn, computes
        a few hundred tokens. Ordered by prompt length, every question on the longest
        document waited behind every other until ``starvation_s`` (long-document QA held
        met the SLO 47.5 % against 63.3 % unheld at 8x, docs/benchmarks/pd_queue.md)."""
        return self._work.pop(request_id, None)

    def order(self, waiting: list, now: float) -> list:
        """Waiting requests (objects with ``work_tokens``, the prompt tokens they would have
        computed where they were last held, ``enqueued_at`` and, read only with
        ``on_time_first`` or ``late_last``, ``engine``, the engine they were held for, "" if
        none yet, and ``budget_s``, their TTFT budget), best first: the starved, first come
        first served; then (``on_time_first``) those held for an engine whose queue so ordered
        finishes every one's prefill before it starves (``_on_time``), first come first
        served; then the rest by Omni's weights of shortness and waiting time; with
        ``late_last``, those that can no longer meet their budget (``_late``) after all of
        these, first come first served, the starved among them too.

        Shortest first is what gains when not every request can make it (on one shared system
        prompt at 16x, held requests met the SLO 55-57 % against 46-47 % not held), but below
        that it reorders requests that would all have made it, and the longer ones, pushed back
        behind every shorter arrival for the same engine until ``starvation_s``, miss: on 2
        prefill and 2 decode engines at 3x, the held requests that missed waited 1.7-1.9 s in
        this queue while 11-14 later ones went to the same engine, and held met the SLO 5
        points below not held. First come, first served while all can make it removed that
        (docs/benchmarks/pd_queue.md, fifth and sixth sessions)."""
        if len(waiting) < 2:
            return list(waiting)
        longest = max(w.work_tokens for w in waiting) or 1
        oldest = max(now - w.enqueued_at for w in waiting) or 1e-9
        sw, ww, starve = self.shortness_weight, self.wait_weight, self.starvation_s
        on_time = self._on_time(waiting, now) if self.on_time_first else set()
        late = self._late(waiting, now) if self.late_last else set()

        def key(w):
            waited = now - w.enqueued_at
            if id(w) in late:
                return (3, w.enqueued_at, 0.0)       # can no longer make it: last, in arrival order
            if waited >= starve and self.starved_first:
                return (0, w.enqueued_at, 0.0)       # starved: first come, first served
            if id(w) in on_time:
                return (1, w.enqueued_at, 0.0)       # all of these leave in time: arrival order
            return (2, 0.0, -(sw * (1.0 - w.work_tokens / longest) + ww * waited / oldest))

        return sorted(waiting, key=key)

    def _late(self, waiting: list, now: float) -> set[int]:
        """The waiting requests (their ``id()``) that can no longer meet their TTFT budget
        (``budget_s``) even if their prefill started now: what they have waited plus their own
        prefill on the engine they were held for (their ``work_tokens`` at its learned speed)
        is beyond it. Requests not held yet (no engine known) are not counted.

        Past an engine's capacity, serving such a request before one that can still make it
        costs the other its TTFT and saves nothing. With the suite's shared system prompt and
        the fleet's prefill pooled in one server (bench/slo_bound.py's model), 1 engine at
        1.5x: shortest first with the late ones last met 91.7 % against 70.0 first come, first
        served, 86.0 shortest first and 65.0 shortest first with the starved (waited the whole
        budget) ahead. Through the control plane, one PD prefill engine at 1.5x: 86-88 %
        against 73-75. The engine's work ahead counted as well (this queue's estimate of when
        the prefills it let through are done) gained a point or two in PD, but marked late
        agents' turns that would have made it (agent loops at 12x: 90.2 % over five runs
        against 92.3 without the option, 94.8 over three counting the request's own prefill
        alone) (docs/benchmarks/workloads_notes.md, "PD at the 80 % rate")."""
        late: set[int] = set()
        rate = self._rate
        for w in waiting:
            engine = getattr(w, "engine", "")
            budget = getattr(w, "budget_s", 0.0)
            if engine and budget > 0 and engine in rate and \
                    now - w.enqueued_at + w.work_tokens * rate[engine] > budget:
                late.add(id(w))
        return late

    def _on_time(self, waiting: list, now: float) -> set[int]:
        """The waiting requests (their ``id()``) held for an engine that, taking those held for
        it first come, first served, finishes every one's prefill within ``starvation_s`` of
        its arrival. An engine where one would be late is behind: for its requests the
        weights decide (shortest first gains when not all can make it).

        A request held for engine e is done at e's predicted free time (this queue's own,
        ``_busy_until``) plus the work of those before it and its own, each its tokens at e's
        learned speed. Two rules lost at overload, one shared system prompt at 16x
        (docs/benchmarks/pd_queue.md, sixth session): judged by when it would leave the queue
        (its prefill not counted), requests that then missed their first token counted as on
        time (48.0, 48.0 % against 54.7, 57.3 with the weights alone); first come, first
        served for the most an engine can finish in time (Moore and Hodgson's rule, the
        longest left out) met the weights' gains no better than not holding on one prefill
        engine at 2x (49.0, 49.3 % against 48.3, 48.0 not held; this rule 54.0, 54.3), the
        estimates being too rough to pick who makes it. Requests not held yet (no engine
        known) are not counted here: their place is the weights'."""
        by_engine: dict[str, list] = {}
        for w in waiting:
            engine = getattr(w, "engine", "")
            if engine and engine in self._rate and now - w.enqueued_at < self.starvation_s:
                by_engine.setdefault(engine, []).append(w)
        kept: set[int] = set()
        for engine, ws in by_engine.items():
            rate = self._rate[engine]
            done = max(self._busy_until.get(engine, now), now)
            ws.sort(key=lambda w: w.enqueued_at)
            for w in ws:
                done += w.work_tokens * rate
                if done - w.enqueued_at > self.starvation_s:
                    break
            else:
                kept.update(id(w) for w in ws)
        return kept


@dataclass
class PhaseWindow(HoldQueue):
    """Phase-aligned dispatch for engines whose DP ranks step together (DP attention before
    MoE layers: a step lasts as long as the slowest rank's, ``simulator.dp_barrier``).

    Every prefill started while the other ranks only decode holds all their decodes for as
    long as it runs; prefills that run in the same steps on different ranks hold them once.
    So a long prompt (``min_tokens`` or more) bound for a DP worker with no prefill under
    way waits, up to ``window_s``, for the window to fill: once ``dp_size`` such prompts
    wait for the worker, or the window has run out, they are dispatched together (the
    queue's next round), and the ``phase_aligned`` rank rule spreads them over the ranks.
    A long prompt for a worker already prefilling joins that phase at once, and short
    prompts are never held. (``max_wait_s`` still bounds any wait.) It replaces the ``omni``
    stage's rule rather than adding to it: a busy engine alone holds nothing here.
    """

    window_s: float = 0.3
    min_tokens: int = 2048
    name: str = "phase_window"
    # Per DP worker: when its window opened, and the requests waiting in it.
    _windows: dict[str, tuple[float, set[str]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.window_s >= 0:
            raise ValueError("window_s must be >= 0")
        if self.min_tokens < 1:
            raise ValueError("min_tokens must be >= 1")

    def should_hold(self, ctx: PlacementContext, chosen: WorkerView) -> bool:
        spec = chosen.spec
        if spec.dp_size <= 1 or ctx.prompt_tokens < self.min_tokens or ctx.leg == "decode":
            return False
        now = time.monotonic()
        opened, members = self._windows.get(spec.id, (now, set()))
        if chosen.load.prefill_tokens >= self.min_tokens or now - opened >= self.window_s:
            # A phase is under way (join it), or the window ran out: it closes, all go.
            self._windows.pop(spec.id, None)
            return False
        members.add(ctx.request_id)
        if len(members) >= spec.dp_size:
            self._windows.pop(spec.id, None)   # full: this one goes, the others join its phase
            return False
        self._windows[spec.id] = (opened, members)
        return True


QUEUES: dict[str, type[HoldQueue]] = {"omni": HoldQueue, "phase_window": PhaseWindow}
