"""The commit step of a placement: everything a decision changes once it is made.

Deciding reads (candidates, loads, the prefix index) and changes nothing but the policy's own
memory; an explanation (``omni-ctl explain``) is the same decision, not committed. Committing
is the one place that writes, in this order:

1. **the ledger**: every charge of the decision (the worker's, and its DP rank's beside it,
   ``dp_rank.rank_key``) in one ``reserve`` call, with what placement predicted noted on the
   request's record (``ledger_charges``): what the outcome later teaches the latency models;
2. **the fleet's least-loaded order**, when the store does not tell the fleet of each load
   change itself (a store with load listeners has already);
3. **the prefix bookkeeping**: the worker that computes the prompt now holds it (pending until
   its KV events say so, or routed for a worker without events);
4. **the counters** for /metrics (placements per worker and leg, predicted hit blocks).

The ledger comes first: if it fails (a store outage), nothing else claims a placement that
never happened.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

from controlplane.dp_rank import rank_key
from controlplane.fleet import Fleet
from controlplane.placement_stats import PlacementStats
from controlplane.prediction import Predictor
from controlplane.scheduling import PlacementContext
from controlplane.scheduling.pd_flow import FlowPlan
from controlplane.state import Charge, RequestRecord, StateStore
from controlplane.workers import Load, WorkerSpec, WorkerView
from protos import omni_proxy_pb2 as pb


class PlacedPrefixes(Protocol):
    """What the commit step needs of the prefix index (``kvcache.manager.KVCache``)."""

    def placed(self, worker: WorkerSpec | WorkerView, chain: Sequence[int], predicted_depth: int,
               dp_rank: int = 0) -> None: ...


def ledger_charges(ctx: PlacementContext, charges: Sequence[tuple[WorkerView, str]], *, flow: int,
                   ranks: dict[str, int], record: RequestRecord | None,
                   now: float) -> tuple[list[Charge], dict[str, Any]]:
    """The ledger's charges of a decided placement and the notes for its record (a pure function).

    ``ctx`` is the placed leg's context (the request's tokens, the leg, the candidates' matches
    and predictions); ``charges`` the (worker, leg it is charged for) pairs in charge order;
    ``ranks`` the DP rank of each data-parallel worker among them; ``record`` the request's
    record when this is a later leg. A worker that computes the prompt (prefill, aggregated)
    is charged the tokens it lacks as prefill work; the one that decodes holds the whole
    request's tokens. The notes say what placement predicted: the prefill work ahead and the
    predicted TTFT on the computing worker, the decode batch joined, and for a sequential
    decode leg when D started pulling, and how much.
    """
    prompt = ctx.prompt_tokens
    total = prompt + ctx.max_tokens
    charge_list: list[Charge] = []
    notes: dict[str, Any] = {}
    for w, charge_leg in charges:
        wid = w.spec.id
        computes = charge_leg != "decode"
        uncached = ctx.uncached_tokens(wid) if computes else 0
        charge_list.append(Charge(worker_id=wid, leg=charge_leg, tokens=prompt if charge_leg == "prefill" else total,
                                  prefill_tokens=uncached))
        if wid in ranks:   # the rank's own load, released with the worker's (see rank_key)
            charge_list.append(dataclasses.replace(charge_list[-1], worker_id=rank_key(wid, ranks[wid])))
        if computes:
            pending = w.load.prefill_tokens
            if pending and ctx.predictor is not None:    # what is left of it (EngineModel.pending_s)
                pending = ctx.predictor.pending_tokens(wid, pending, now)
            notes["work_ahead_tokens"] = pending + uncached
            notes["predicted_ttft_s"] = ctx.predicted.get(wid, (0.0, 0.0))[0]
            if record is not None:
                notes["placed_at"] = now   # a prefill tried again elsewhere: timed from here
        if charge_leg != "prefill":
            notes["decode_batch"] = w.load.requests + 1
        if charge_leg == "decode" and ctx.leg == "decode" and flow == pb.FLOW_SEQUENTIAL:
            notes["decode_placed_at"] = now     # P has answered: D pulls from here on
            notes["pull_tokens"] = ctx.uncached_tokens(wid)
    return charge_list, notes


def _new_record(ctx: PlacementContext, session: str, flow: int, charged: tuple[Charge, ...], notes: dict[str, Any],
                now: float) -> RequestRecord:
    """A new request's record, holding its charges, with what placement predicted (``notes``)."""
    return RequestRecord(ctx.request_id, ctx.model, ctx.prompt_tokens, ctx.max_tokens, session, flow, charged, now,
                         0.0, now, notes.get("predicted_ttft_s", 0.0), notes.get("work_ahead_tokens", 0),
                         notes.get("decode_batch", 0), notes.get("decode_placed_at", 0.0), notes.get("pull_tokens", 0))


class PlacementCommit:
    """Commits decided placements for one placer (see the module's docstring for the order)."""

    def __init__(self, store: StateStore, fleet: Fleet, stats: PlacementStats, *, store_notes_loads: bool) -> None:
        self.store = store
        self.fleet = fleet
        self.stats = stats
        # Whether the store tells the fleet of every load change itself (a load listener).
        self.store_notes_loads = store_notes_loads

    async def write(self, ctx: PlacementContext, charges: Sequence[tuple[WorkerView, str]], flow: int,
                    ranks: dict[str, int], record: RequestRecord | None, session: str,
                    kv: PlacedPrefixes | None) -> None:
        """Reserve a decided placement in the ledger, then account for it. The arguments are
        ``ledger_charges``'s, with the data-plane ``session`` that owns the request and ``kv``,
        the prefix index (None when placement ignores caches). Plain arguments and a plain
        method, called positionally: this runs for every request, and an object built per
        placement or a call through ``__call__`` with keywords cost 1.5-3 us of a 55 us
        placement (bench/placement.py, least_load)."""
        now = ctx.now or time.monotonic()    # the placement's own time (Placer.clock)
        charge_list, notes = ledger_charges(ctx, charges, flow=flow, ranks=ranks, record=record, now=now)
        charged = tuple(charge_list)
        if record is None:
            # A new request: its record built once, holding its charges (``charged``), not
            # once here and again in the store (a frozen record of 15 fields costs ~2 us).
            await self.store.reserve(_new_record(ctx, session, flow, charged, notes, now), charged, charged=True)
        else:
            await self.store.reserve(record, charged, **notes)
        self._progressed(ctx, charges, now)
        self.account(ctx, charges, charge_list, ranks, kv)

    def settled(self, request_id: str, model: str, prompt: int, max_tokens: int, worker: WorkerView, plan: FlowPlan,
                session: str, now: float, predictor: Predictor) -> RequestRecord:
        """A new request that had already ended when this control plane heard of it (a data
        plane's local placement on ``worker`` with its end folded in, ``PlaceRequest.ended``):
        accounted as :meth:`write` accounts it (the counters, the predictor told the engine
        computes from ``now`` if nothing was ahead), but never charged: a charge and its
        release in one turn change no load. Its record, as the ledger would have held it, for
        what its end teaches (``Lifecycle.settle``).

        What ``ledger_charges`` and :meth:`account` compute for such a placement, written out:
        it has no prefix chain (no match, so every prompt token is computed, and no prefix
        bookkeeping), no predictions, no DP rank and no earlier record. Runs once per local
        request: no context, no generic charge list (tests/test_settle_path.py compares it
        with the general path's state)."""
        leg = plan.chosen_leg
        charges: tuple[Charge, ...] = ()
        work_ahead = decode_batch = 0
        if leg:
            wid = worker.spec.id
            load = worker.load
            if leg != "decode":     # it computes the prompt: all of it (no prefix matched)
                charges = (Charge(wid, leg, prompt if leg == "prefill" else prompt + max_tokens, prompt),)
                pending = load.prefill_tokens
                if pending:         # what is left of it (EngineModel.pending_s)
                    work_ahead = predictor.pending_tokens(wid, pending, now) + prompt
                else:               # nothing ahead: the engine computes from now
                    work_ahead = prompt
                    predictor.progressed(wid, now)
            else:
                charges = (Charge(wid, leg, prompt + max_tokens, 0),)
            if leg != "prefill":
                decode_batch = load.requests + 1
            self.fleet.placements[wid] += 1
            self.stats.placed[(wid, leg)] += 1
        return RequestRecord(request_id, model, prompt, max_tokens, session, plan.flow, charges, now, 0.0, now,
                             0.0, work_ahead, decode_batch, 0.0, 0)

    @staticmethod
    def _progressed(ctx: PlacementContext, charges: Sequence[tuple[WorkerView, str]], now: float) -> None:
        if ctx.predictor is not None:
            for w, charge_leg in charges:
                if charge_leg != "decode" and not w.load.prefill_tokens:
                    # Nothing was ahead: the engine computes from now (EngineModel.pending_s).
                    ctx.predictor.progressed(w.spec.id, now)

    def account(self, ctx: PlacementContext, charges: Sequence[tuple[WorkerView, str]],
                charge_list: Sequence[Charge], ranks: dict[str, int], kv: PlacedPrefixes | None, *,
                loads: bool = True) -> None:
        """After the ledger: the fleet's load order (``loads``: the placement was charged),
        the prefix bookkeeping and the counters."""
        fleet, stats, chain = self.fleet, self.stats, ctx.chain
        for worker, charge_leg in charges:
            wid = worker.spec.id
            if loads and not self.store_notes_loads:
                # The least-loaded order learns of this charge now (a store with a load
                # listener has told the fleet already).
                c = next(c for c in charge_list if c.worker_id == wid)
                load = worker.load
                fleet.note_load(wid, Load(load.requests + 1, load.tokens + c.tokens, load.prefill_tokens,
                                          load.prefills))
            fleet.placements[wid] += 1
            stats.placed[(wid, charge_leg)] += 1
            if chain and kv is not None and charge_leg != "decode":
                # The worker that computes the prompt is the one whose cache counts.
                depth = ctx.match_blocks.get(wid, 0)
                kv.placed(worker.spec, chain, depth, ranks.get(wid, 0))
                stats.predicted_hit_blocks[wid] += depth
                stats.query_blocks[wid] += len(chain)
