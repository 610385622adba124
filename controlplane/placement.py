"""Placement: the control plane's answer to "where does this run?".

A placement reads this replica's routable index for its candidates, a snapshot of their
loads from the ledger, and (only when the policy uses it) the prefix index for those
candidates; the policy decides; then every charge of the decision is reserved in one
ledger call. Load is counted at the moment of each placement and released by the data
planes' lifecycle reports (``controlplane.lifecycle``), so a burst sees each earlier
placement of the same burst, which a policy reading engine metrics seconds old cannot.

``Placer.place`` is a short sequence of decisions, each in a module of its own so that it can
be read, changed and tested alone: the policy's choice (``scheduling/``), the flow and whether
a decode worker is chosen with the entry (the PD-flow decider ``pd_flow`` names:
``scheduling/pd_flow.py``), the rank of a data-parallel worker (``dp_rank.py``), then the one
step that writes the decision to the ledger, the fleet's load order, the prefix index and the
counters (``commit.py``). What stays here is their order, explanations and refusals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from controlplane.commit import PlacementCommit
from controlplane.dp_rank import RankChooser, rank_key
from controlplane.fleet import Fleet
from controlplane.hooks import Hook
from controlplane.kvcache.manager import KVCache
from controlplane.placement_stats import LATENCY_BUCKETS, LatencyHistogram, PlacementStats
from controlplane.prediction import Predictor
from controlplane.queueing import PlacementQueue
from controlplane.scheduling import Decision, PlacementContext, Profile
from controlplane.scheduling.latency import pair_decode
from controlplane.scheduling.pd_flow import PD_FLOWS, FlowPlan, build_pd_flow, later_leg
from controlplane.state import NotifiesLoads, RequestRecord, StateStore
from controlplane.workers import IDLE, ROLE_TO_PB, Role, WorkerView
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

# Importable from here as before (controlplane.metrics, lifecycle, server, tests).
__all__ = ["LATENCY_BUCKETS", "MAX_TOKENS", "PD_FLOWS", "LatencyHistogram", "PlacementStats", "Placer", "rank_key"]

_LEG_NAMES = {pb.LEG_ENTRY: "entry", pb.LEG_PREFILL: "prefill", pb.LEG_DECODE: "decode"}
_LEG_ROLES = {"prefill": (Role.PREFILL,), "decode": (Role.DECODE,)}
_ROLE_SETS = {roles: frozenset(roles) for roles in ((Role.BOTH, Role.PREFILL), (Role.BOTH,), *_LEG_ROLES.values())}
_NONE: frozenset[str] = frozenset()
_NO_RANKS: dict[str, int] = {}   # no data-parallel worker charged (never written to)
MAX_TOKENS = 1 << 40   # per request: far above any context, far below int64 sums of many requests
NO_WORKER_RETRY_S = 1.0   # Retry-After for a known model with no worker at the moment


def _endpoint(worker: WorkerView) -> pb.Endpoint:
    spec = worker.spec
    return pb.Endpoint(worker_id=spec.id, url=spec.url, role=ROLE_TO_PB[spec.role],
                       bootstrap_port=spec.bootstrap_port, dp_size=spec.dp_size if spec.dp_size > 1 else 0)


def _invalid_values(leg: str | None, prompt_tokens: int, max_tokens: int, request_id: str, dry_run: bool) -> str | None:
    """Why a request of these fields cannot be placed as it stands (None: it can)."""
    if leg is None:
        return "leg must be ENTRY, PREFILL or DECODE"
    if not (0 <= prompt_tokens <= MAX_TOKENS and 0 <= max_tokens <= MAX_TOKENS):
        return f"prompt_tokens and max_tokens must be 0 to {MAX_TOKENS}"
    if (not request_id and not dry_run) or len(request_id) > 256:
        return "request_id must be 1 to 256 characters"
    return None


class Placer:
    def __init__(self, store: StateStore, fleet: Fleet, profile: Profile, *, pd_flow: str = "sequential",
                 metrics_max_age_s: float = 5.0, stats: PlacementStats | None = None,
                 predictor: Predictor | None = None, block_size: int = 16, kv: KVCache | None = None,
                 clock: Callable[[], float] = time.monotonic, ttft_slo_s: float = 0.0,
                 tpot_slo_s: float = 0.0) -> None:
        # Which flow a request takes: the PD-flow decider ``pd_flow`` names (scheduling.pd_flow).
        self.flows = build_pd_flow(pd_flow)
        self.store = store
        self.fleet = fleet
        self.profile = profile
        self.pd_flow = self.flows.flow
        self.metrics_max_age_s = metrics_max_age_s
        self.stats = stats or PlacementStats.new()
        self.kv = kv     # prefix-cache view; None = placement ignores caches
        self.predictor = predictor or Predictor()
        self.block_size = block_size
        # The one clock placement reads (a context's ``now``, the ledger's times, what the
        # prediction computes since): tests give a fake one, so decisions replay exactly.
        self.clock = clock
        # The deployment's targets ([slo], seconds; 0 = none): what a request that sends no
        # X-SLO-* header of its own is placed with (_context), target by target.
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self._endpoints: dict[str, tuple[object, pb.Endpoint]] = {}   # see _endpoint()
        # The DP rank of a data-parallel worker, by the profile's rule (balance | phase_aligned).
        self.ranks = RankChooser(store, profile.shared, profile.dp_rank, block_size)
        # The fleet's least-loaded order follows the ledger: told by the store on every change
        # when the store can (MemoryStore), else by this placer whenever it reads or charges a load.
        self._store_notes_loads = isinstance(store, NotifiesLoads)
        if isinstance(store, NotifiesLoads) and fleet.note_load not in store.load_listeners:
            store.load_listeners.append(fleet.note_load)
        # The one step that writes: ledger, fleet order, prefix bookkeeping, counters.
        self.commit = PlacementCommit(store, fleet, self.stats, store_notes_loads=self._store_notes_loads)
        # The queue stage's runner, when the policy has one (late binding).
        self.queue = PlacementQueue(profile.queue, self.place) if profile.queue is not None else None
        self.metaserver_url = ""
        # Emitted when a layerwise request's entry leg is placed (its decode engine chosen):
        # the metaserver waits for that engine's call and may add to the placement (its token).
        self.layerwise_placed: Hook[[pb.PlaceRequest, pb.Placement]] = Hook("layerwise request placed")

    # ------------------------------------------------------------------ placement

    async def submit(self, req: pb.PlaceRequest, session: str = "") -> pb.Placement | asyncio.Future[pb.Placement]:
        """A data plane's placement: answered now, or (queue stage) a future answered when
        an engine can take the request."""
        queue = self.queue
        if queue is None or req.leg != pb.LEG_ENTRY:
            placement = await self.place(req, session)
            assert placement is not None   # None only with may_hold
            return placement
        if len(queue):
            # Others are already waiting: the queue's order decides who goes first.
            waiting = queue.enqueue(req, session)
            if isinstance(waiting, pb.Placement):
                self.stats.errors[pb.ErrorCode.Name(waiting.error)] += 1
            return waiting
        placement = await self.place(req, session, may_hold=True)
        if placement is not None:
            return placement
        waiting = queue.enqueue(req, session)
        if isinstance(waiting, pb.Placement):
            self.stats.errors[pb.ErrorCode.Name(waiting.error)] += 1
        return waiting

    async def place(self, req: pb.PlaceRequest, session: str = "", may_hold: bool = False, *,
                    dry_run: bool = False) -> pb.Placement | None:
        """Decide and reserve. With ``may_hold``, returns None instead when the queue stage
        says even the best engine is too busy to start the request soon.

        The decisions, in order: the request is valid; the policy chooses a worker among those
        the leg's roles allow (the PD-flow decider's, for an entry); the queue stage may hold
        it; the decider's plan says the flow and whether a decode worker is chosen now too;
        each data-parallel worker charged gets its rank; then the one commit step writes."""
        count = not dry_run     # an explanation (omni-ctl explain) changes no metric
        leg = _LEG_NAMES.get(req.leg)
        invalid = self._invalid(req, leg, dry_run)
        if invalid is not None or leg is None:   # (an unknown leg is invalid: the test narrows its type)
            return self._error(req, pb.INVALID_REQUEST, invalid or "", count=count)
        record = await self.store.get(req.request_id) if leg != "entry" else None
        if record is not None and leg == "decode" and record.flow == pb.FLOW_SEQUENTIAL and not dry_run:
            record = await self._prefill_answered(req, record)
        roles = self.flows.entry_roles(bool(self.fleet.routable(req.model, Role.DECODE))) if leg == "entry" \
            else _LEG_ROLES[leg]
        explain = req.explain or dry_run
        # (a slice copies upb's repeated field faster than list())
        chain = req.block_hashes[:] if self.kv is not None and self.profile.uses_prefix_cache else []
        ctx = self._context(req, leg, roles, chain, explain)
        if Role.PREFILL in roles and leg == "entry" and self.profile.uses_predictions:
            await self._pair_context(req.model, ctx, chain)
        decision = await self._decide(req.model, roles, ctx, chain)
        explanation = self._explain_choice(decision, ctx, roles) if explain else ""
        chosen = decision.worker
        if chosen is None:
            return self._refusal(req, leg, ctx, roles, decision.dropped, explanation, count=count)
        if may_hold and leg == "entry" and self.profile.queue is not None and \
                self.profile.queue.should_hold(ctx, chosen):
            return None
        plan = self.flows.entry(chosen) if leg == "entry" else \
            later_leg(chosen.spec.role, record.flow if record is not None and record.flow else self.pd_flow)
        flow = plan.flow
        decode: WorkerView | None = None
        if plan.with_decode:
            paired, explanation = await self._decode_now(req, chain, explanation, explain, count)
            if isinstance(paired, pb.Placement):
                return paired          # no decode worker: refused
            decode = paired
        out, charges = self._placement(req, plan, chosen, decode)
        ranks = _NO_RANKS
        if chosen.spec.dp_size > 1 or (decode is not None and decode.spec.dp_size > 1):
            ranks, explanation = await self._dp_ranks(out, charges, chain, req.prompt_tokens, explanation,
                                                      explain, advance=not dry_run)
        out.explanation = explanation
        if dry_run:
            return out

        await self.commit.write(ctx, charges, flow, ranks, record, session, self.kv)
        if flow == pb.FLOW_LAYERWISE and leg == "entry":
            self.layerwise_placed.emit(req, out)
        return out

    @property
    def places_anywhere(self) -> bool:
        """The policy needs no shared state: plain round robin (no scorer, filter or queue
        stage), which a data plane can run itself over the routable workers this control
        plane lists (``SessionInfo.local_placement``, ``dataplane.fallback``), telling it
        afterwards (:meth:`record`) instead of asking. ``random`` is not offered: a data
        plane cycles, it does not draw."""
        p = self.profile
        return p.picker.name == "round_robin" and not p.scorers and not p.filters and p.queue is None

    async def record(self, req: pb.PlaceRequest, session: str) -> bool:
        """Commit an entry leg a data plane placed itself on ``req.placed_on`` (aggregated):
        its charge in the ledger, the fleet's order, the counters, as if decided here; no
        answer. False (nothing recorded, an error counted) when the request is invalid or
        the worker is no longer known: the request runs there anyway, and its end finds no
        record, as after a release."""
        local = await self._local(req)
        if local is None:
            return False
        ctx, charges, flow = local
        await self.commit.write(ctx, charges, flow, _NO_RANKS, None, session, self.kv)
        return True

    async def settle(self, req: pb.PlaceRequest, session: str) -> RequestRecord | None:
        """Count an entry leg a data plane placed itself and whose end came with the notice
        (``req.ended``): the counters as :meth:`record` counts it, no charge in the ledger
        (``PlacementCommit.settled``); its record as the ledger would have held it, for
        ``Lifecycle.settle``. None (an error counted) as :meth:`record` refuses.

        A direct path, not :meth:`_local`'s: a local placement has no prefix chain, no
        candidates and no prediction, so the placement context (15 fields) and the generic
        ``ledger_charges`` it feeds would compute constants at a third of the control plane's
        cost per request (bench/call_map.py); tests/test_settle_path.py checks both paths
        leave the same state."""
        # (each field read once: a read of a protobuf field builds its value)
        spec = self.fleet.get(req.placed_on)
        request_id, prompt, max_tokens = req.request_id, req.prompt_tokens, req.max_tokens
        if spec is None or spec.role is not Role.BOTH or \
                _invalid_values("entry", prompt, max_tokens, request_id, False) is not None:
            self.stats.errors["LOCAL_PLACEMENT_UNRECORDED"] += 1
            return None
        wid = spec.id
        view = self.fleet.views((wid,), await self.store.loads((wid,)))[0]
        return self.commit.settled(request_id, req.model, prompt, max_tokens, view, self.flows.entry(view), session,
                                   self.clock() or time.monotonic(), self.predictor)

    async def _local(self, req: pb.PlaceRequest) -> tuple[PlacementContext, list[tuple[WorkerView, str]], int] | None:
        """A local placement's context, charges and flow, as if decided here; None (counted)
        when the request is invalid or its worker no longer known."""
        spec = self.fleet.get(req.placed_on)
        if spec is None or spec.role is not Role.BOTH or self._invalid(req, "entry", False) is not None:
            self.stats.errors["LOCAL_PLACEMENT_UNRECORDED"] += 1
            return None
        wid = spec.id
        view = self.fleet.views((wid,), await self.store.loads((wid,)))[0]
        ctx = self._context(req, "entry", (Role.BOTH,), [])
        plan = self.flows.entry(view)
        return ctx, [(view, plan.chosen_leg)] if plan.chosen_leg else [], plan.flow

    @staticmethod
    def _invalid(req: pb.PlaceRequest, leg: str | None, dry_run: bool) -> str | None:
        """Why the request cannot be placed as it stands (None: it can)."""
        return _invalid_values(leg, req.prompt_tokens, req.max_tokens, req.request_id, dry_run)

    def _explain_choice(self, decision: Decision, ctx: PlacementContext, roles: tuple[Role, ...]) -> str:
        """The policy's choice explained, with the decode engine an entry's prefill worker
        would be paired with (``_pair_context``) when it was predicted."""
        explanation = self._explain(decision, ctx, roles)
        if ctx.pair_decode and ctx.pair is not None:
            explanation += (f" | paired decode: {ctx.pair_decode} (kv pull {ctx.pair[0] * 1000:.0f}ms "
                            f"tpot={ctx.pair[1] * 1000:.1f}ms)")
        return explanation

    async def _decode_now(self, req: pb.PlaceRequest, chain: list[int], explanation: str, explain: bool,
                          count: bool) -> tuple[WorkerView | pb.Placement, str]:
        """The decode worker chosen with the entry (parallel sends to P and D at once; layerwise
        sends to D first and lets the metaserver choose P when D asks for its prefill), or the
        refusal when there is none; and the explanation with the decode leg's part."""
        d_roles = _LEG_ROLES["decode"]
        d_ctx = self._context(req, "decode", d_roles, chain, explain)
        d_decision = await self._decide(req.model, d_roles, d_ctx, chain)
        if explain:
            explanation += " | decode: " + self._explain(d_decision, d_ctx, d_roles)
        if d_decision.worker is None:
            return self._refusal(req, "decode", d_ctx, d_roles, d_decision.dropped, explanation,
                                 count=count), explanation
        return d_decision.worker, explanation

    async def _dp_ranks(self, out: pb.Placement, charges: list[tuple[WorkerView, str]], chain: list[int],
                        prompt_tokens: int, explanation: str, explain: bool, *,
                        advance: bool) -> tuple[dict[str, int], str]:
        """The rank of each data-parallel worker charged (``dp_rank.RankChooser``), set on its
        endpoints; and the explanation with why. A worker that computes the prompt (not a
        decode leg) is told how long it is (the ``phase_aligned`` rule weighs its prefill)."""
        ranks: dict[str, int] = {}
        for w, leg in charges:
            if w.spec.dp_size > 1 and w.spec.id not in ranks:
                ranks[w.spec.id], why = await self.ranks.choose(
                    w, chain, self.kv, advance=advance, prefill_tokens=prompt_tokens if leg != "decode" else 0)
                for ep in (out.prefill, out.decode):
                    if ep.worker_id == w.spec.id:
                        ep.dp_rank = ranks[w.spec.id]
                if explain:
                    explanation += f" | dp_rank: {w.spec.id} rank {ranks[w.spec.id]} of {w.spec.dp_size} ({why})"
        return ranks, explanation

    def _placement(self, req: pb.PlaceRequest, plan: FlowPlan, chosen: WorkerView,
                   decode: WorkerView | None) -> tuple[pb.Placement, list[tuple[WorkerView, str]]]:
        """The placement message of ``plan`` and its charges, in charge order: the chosen
        worker's leg (if it has one here), then the decode worker chosen with it."""
        out = pb.Placement(seq=req.seq, request_id=req.request_id)
        out.flow = plan.flow
        charges: list[tuple[WorkerView, str]] = []
        if plan.chosen_leg:
            (out.prefill if plan.chosen_leg == "prefill" else out.decode).CopyFrom(self._endpoint(chosen))
            charges.append((chosen, plan.chosen_leg))
        if decode is not None:
            out.decode.CopyFrom(self._endpoint(decode))
            charges.append((decode, "decode"))
        if plan.via_metaserver:
            out.metaserver_url = self.metaserver_url
        return out, charges

    async def _prefill_answered(self, req: pb.PlaceRequest, record: RequestRecord) -> RequestRecord:
        """Sequential PD: the data plane asks for D only once P has answered, so P's prompt is
        computed. Its prefill work leaves P's queue now, not at D's first token.

        P keeps the request's load (``requests``, ``tokens``) until D has pulled the KV (the
        data plane's PREFILL_DONE at D's first chunk), but the engine is free to compute the
        next prompt. Counting the prompt as work still ahead until D's first token (D's own
        queue, the pull, its first step) made every new request look stuck behind it: the
        queue stage held requests while the prefill engines idled (issue 17: 1.6 s median
        waits for 0.17 s prefills, SLO attainment a third of the same policy without the
        queue). P's prefill time is learned here too, from its own answer: the first token's
        time would teach P's line D's queue and pull.
        """
        if any(c.prefill_tokens for c in record.charges):
            self.predictor.prompts_computed(record.charges, self.clock())   # P is done with it (pending_s)
            record = await self.store.settle_prefill(req.request_id) or record
        first = not req.exclude_workers and not any(c.leg == "decode" for c in record.charges)
        if first and record.work_ahead_tokens > 0 and record.placed_at > 0:
            for c in record.charges:
                if c.leg == "prefill":
                    self.predictor.observe_ttft(c.worker_id, record.work_ahead_tokens,
                                                self.clock() - record.placed_at)
                    break
        if self.queue is not None:
            self.queue.kick()
        return record

    async def _pair_context(self, model: str, ctx: PlacementContext, chain: list[int]) -> None:
        """Entry leg with prefill workers among the candidates: predict the decode engine each
        would be paired with (``latency.pair_decode``), from the decode engines' loads and their
        own prefix caches (what they hold, they need not pull). A large decode group is
        sampled by the profile's candidate stage, as a decode leg's candidates are."""
        group = self.fleet.group(model, _LEG_ROLES["decode"])
        ids: Sequence[str] = group.ids
        if not ids:
            return
        stage = self.profile.candidates
        if stage is not None and stage.applies(len(ids)):
            # A scratch context: the stage notes its matches there, not in the entry's.
            scratch = dataclasses.replace(ctx, leg="decode", match_blocks={}, matched=False, predicted={})
            ids = stage.select(scratch, group, self.kv if chain else None, chain)
        loads = await self.store.loads(ids)
        views = self.fleet.views(ids, loads)
        pair_decode(ctx, views, self.kv.match(chain, views) if chain and self.kv is not None else {})

    def _endpoint(self, worker: WorkerView) -> pb.Endpoint:
        """The worker's endpoint message, built once per spec (specs are immutable; callers
        copy it into their placement)."""
        spec = worker.spec
        got = self._endpoints.get(spec.id)
        if got is None or got[0] is not spec:
            if len(self._endpoints) >= 65536:
                self._endpoints.clear()
            got = self._endpoints[spec.id] = (spec, _endpoint(worker))
        return got[1]

    async def _decide(self, model: str, roles: tuple[Role, ...], ctx: PlacementContext,
                      chain: list[int]) -> Decision:
        """Run the profile over this leg's candidates: a bounded sample of the routable group when
        it is large (the candidate stage), else all of it; the whole group again if a sample left
        nothing (hard filters), so sampling alone never refuses."""
        group = self.fleet.group(model, roles)
        stage = self.profile.candidates
        if stage is not None and stage.applies(len(group.ids)):
            ids = stage.select(ctx, group, self.kv if chain else None, chain)
            ctx.sampled = (len(ids), len(group.ids))
            decision = self.profile.place(ctx, await self._candidates(ids, ctx, chain))
            if decision.worker is not None:
                return decision
            ctx.sampled, ctx.matched = (0, 0), False
            ctx.match_blocks, ctx.cached_blocks, ctx.predicted = {}, {}, {}
        return self.profile.place(ctx, await self._candidates(group.ids, ctx, chain))

    async def _candidates(self, ids: Sequence[str], ctx: PlacementContext, chain: list[int]) -> list[WorkerView]:
        """Views of ``ids`` with their loads (and cache depths, if used): O(len(ids))."""
        fleet = self.fleet
        loads = await self.store.loads(ids)
        if not self._store_notes_loads:
            for wid, load in loads.items():
                fleet.note_load(wid, load)
        views = fleet.views(ids, loads)
        kv = self.kv
        if chain and kv is not None:   # (a chain is hashed only with a KV view)
            if not ctx.matched:
                ctx.match_blocks = kv.match(chain, views)
            if self.profile.uses_tree_sizes:
                # Only the cache-aware picker's "no match anywhere" case reads them: on demand.
                ctx.tree_sizes = lambda: kv.cached_blocks([v.spec.id for v in views])
        return views

    def _context(self, req: pb.PlaceRequest, leg: str, roles: tuple[Role, ...], chain: list[int],
                 explain: bool = True) -> PlacementContext:
        return PlacementContext(
            request_id=req.request_id, model=req.model, leg=leg, prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens, exclude=frozenset(req.exclude_workers) if req.exclude_workers else _NONE,
            now=self.clock(), metrics_max_age_s=self.metrics_max_age_s, roles=_ROLE_SETS[roles],
            chain_blocks=len(chain), chain=chain,
            block_size=self.block_size, predictor=self.predictor,
            ttft_slo_s=req.ttft_slo_ms / 1000 if req.ttft_slo_ms > 0 else self.ttft_slo_s,
            tpot_slo_s=req.tpot_slo_ms / 1000 if req.tpot_slo_ms > 0 else self.tpot_slo_s, keep_scores=explain)

    def _everyone(self) -> list[WorkerView]:
        """Every worker, with no load read: only for explanations of what was not a candidate."""
        return [self.fleet.view(spec, IDLE) for spec in self.fleet.specs()]

    def _explain(self, decision: Decision, ctx: PlacementContext, roles: tuple[Role, ...]) -> str:
        considered = {c.worker.id for c in decision.candidates}
        self.profile.dropped_from(ctx, [w for w in self._everyone() if w.id not in considered], decision.dropped)
        return decision.explain()

    def _refusal(self, req: pb.PlaceRequest, leg: str, ctx: PlacementContext, roles: tuple[Role, ...],
                 dropped: dict[str, str], explanation: str, count: bool = True) -> pb.Placement:
        if not self.fleet.serves_model(req.model):
            if not self.fleet.knew_model(req.model):
                return self._error(req, pb.UNKNOWN_MODEL, f"model {req.model!r} is not served here", explanation,
                                   count=count)
            # It was served here: its workers are away for now (503 and a retry, not 404).
            refusal = self._error(req, pb.NO_HEALTHY_WORKER, f"no worker serves model {req.model!r} right now",
                                  explanation, count=count)
            refusal.retry_after_s = NO_WORKER_RETRY_S
            return refusal
        reasons_by_id = self.profile.dropped_from(ctx, self._everyone(), dict(dropped))
        why = Counter(reasons_by_id.values())
        reasons = ", ".join(f"{n} {r}" for r, n in why.most_common()) or "no candidates"
        refusal = self._error(req, pb.NO_HEALTHY_WORKER,
                              f"no available {leg} worker for model {req.model!r} ({reasons})", explanation,
                              count=count)
        ejected = [self.fleet.state(wid).ejected_until for wid, r in reasons_by_id.items() if r == "ejected"]
        if ejected:   # the circuit breaker holds them back: say when the first one returns
            refusal.retry_after_s = max(min(ejected) - self.clock(), 0.001)
        return refusal

    def internal_error(self, req: pb.PlaceRequest, exc: BaseException) -> pb.Placement:
        return self._error(req, pb.INTERNAL, f"placement failed in the control plane: {type(exc).__name__}")

    def _error(self, req: pb.PlaceRequest, code: pb.ErrorCode, message: str, explanation: str = "", *,
               count: bool = True) -> pb.Placement:
        if count:
            self.stats.errors[pb.ErrorCode.Name(code)] += 1
        return pb.Placement(seq=req.seq, request_id=req.request_id, error=code, error_message=message,
                            explanation=explanation)
