"""Placement and load accounting: the control plane's answer to "where does this run?".

Load is counted here, at the moment of each placement, and released by the data planes'
lifecycle reports. A burst of requests therefore sees each earlier placement of the same
burst, which a policy reading engine metrics seconds old cannot.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.kvcache.manager import KVCache
from controlplane.scheduling import PlacementContext, Profile
from controlplane.state import Charge, RequestRecord, StateStore
from controlplane.workers import Health, Role, Worker
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

_LEG_NAMES = {pb.LEG_ENTRY: "entry", pb.LEG_PREFILL: "prefill", pb.LEG_DECODE: "decode"}
_LEG_ROLES = {"prefill": frozenset({Role.PREFILL}), "decode": frozenset({Role.DECODE})}
MAX_TOKENS = 1 << 40   # per request: far above any context, far below int64 sums of many requests
PD_FLOWS = {"sequential": pb.FLOW_SEQUENTIAL, "parallel": pb.FLOW_PARALLEL, "layerwise": pb.FLOW_LAYERWISE}
ROLE_TO_PB = {Role.BOTH: pb.ROLE_BOTH, Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE}


def _endpoint(worker: Worker) -> pb.Endpoint:
    return pb.Endpoint(worker_id=worker.id, url=worker.url, role=ROLE_TO_PB[worker.role],
                       bootstrap_port=worker.bootstrap_port)


@dataclass
class PlacementStats:
    """Counters the control plane exports on /metrics."""

    placed: Counter
    errors: Counter
    predicted_hit_blocks: Counter   # per worker: blocks the index said it held at placement
    query_blocks: Counter           # per worker: blocks of the prompts placed on it
    sessions: Counter               # data-plane sessions: opened, closed; requests claimed, released

    @classmethod
    def new(cls) -> "PlacementStats":
        return cls(placed=Counter(), errors=Counter(), predicted_hit_blocks=Counter(), query_blocks=Counter(),
                   sessions=Counter())


class Placer:
    def __init__(self, store: StateStore, profile: Profile, *, pd_flow: str = "sequential",
                 metrics_max_age_s: float = 5.0, max_request_age_s: float = 3600.0,
                 session_grace_s: float = 30.0) -> None:
        if pd_flow not in PD_FLOWS:
            raise ValueError(f"unknown pd flow {pd_flow!r}; expected one of {', '.join(PD_FLOWS)}")
        self.store = store
        self.profile = profile
        self.pd_flow = PD_FLOWS[pd_flow]
        self.metrics_max_age_s = metrics_max_age_s
        self.max_request_age_s = max_request_age_s
        self.session_grace_s = session_grace_s
        self.stats = PlacementStats.new()
        self.kv: KVCache | None = None     # prefix-cache view; None = placement ignores caches
        self.metaserver_url = ""
        # Hooks for the metaserver: a layerwise request was placed / a request ended.
        self.on_layerwise: Callable[[pb.PlaceRequest, pb.Placement], None] | None = None
        self.on_request_end: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ placement

    async def place(self, req: pb.PlaceRequest, session: str = "", *, dry_run: bool = False) -> pb.Placement:
        leg = _LEG_NAMES.get(req.leg)
        if leg is None:
            return self._error(req, pb.INVALID_REQUEST, "leg must be ENTRY, PREFILL or DECODE")
        if not (0 <= req.prompt_tokens <= MAX_TOKENS and 0 <= req.max_tokens <= MAX_TOKENS):
            return self._error(req, pb.INVALID_REQUEST, f"prompt_tokens and max_tokens must be 0 to {MAX_TOKENS}")
        if not req.request_id or len(req.request_id) > 256:
            return self._error(req, pb.INVALID_REQUEST, "request_id must be 1 to 256 characters")
        workers = await self.store.list_workers()
        record = await self.store.get_request(req.request_id) if leg != "entry" else None
        if leg == "entry":
            roles = frozenset({Role.BOTH, Role.PREFILL}) if self._decode_ready(workers, req.model) \
                else frozenset({Role.BOTH})
        else:
            roles = _LEG_ROLES[leg]
        want_explain = req.explain or dry_run
        chain = list(req.block_hashes) if self.kv is not None else []
        serving = [w for w in workers if w.serves(req.model)] if chain else []
        match = self.kv.match(chain, serving) if chain else {}
        cached = self.kv.cached_blocks() if chain else {}
        decision = self.profile.place(self._context(req, leg, roles, chain, match, cached), workers)
        explanation = decision.explain() if want_explain else ""
        chosen = decision.worker
        if chosen is None:
            return self._refusal(req, leg, workers, decision.dropped, explanation)

        out = pb.Placement(seq=req.seq, request_id=req.request_id)
        charges: list[tuple[Worker, str]] = []
        flow = record.flow if record is not None and record.flow else self.pd_flow
        if chosen.role is Role.BOTH:
            out.flow = flow = pb.FLOW_AGGREGATED
            out.decode.CopyFrom(_endpoint(chosen))
            charges.append((chosen, "aggregated"))
        elif chosen.role is Role.PREFILL and leg == "entry" and flow in (pb.FLOW_PARALLEL, pb.FLOW_LAYERWISE):
            # Both flows need D now: parallel sends to P and D at once; layerwise sends
            # to D first and lets the metaserver choose P when D asks for its prefill.
            d_decision = self.profile.place(self._context(req, "decode", _LEG_ROLES["decode"], chain, match,
                                                          cached), workers)
            if want_explain:
                explanation += " | decode: " + d_decision.explain()
            if d_decision.worker is None:
                return self._refusal(req, "decode", workers, d_decision.dropped, explanation)
            out.flow = flow
            out.decode.CopyFrom(_endpoint(d_decision.worker))
            charges.append((d_decision.worker, "decode"))
            if flow == pb.FLOW_PARALLEL:
                out.prefill.CopyFrom(_endpoint(chosen))
                charges.insert(0, (chosen, "prefill"))
            else:
                out.metaserver_url = self.metaserver_url
        elif chosen.role is Role.PREFILL:
            out.flow = flow
            out.prefill.CopyFrom(_endpoint(chosen))
            charges.append((chosen, "prefill"))
        else:
            out.flow = flow
            out.decode.CopyFrom(_endpoint(chosen))
            charges.append((chosen, "decode"))
        out.explanation = explanation
        if dry_run:
            return out

        if record is None:
            record = RequestRecord(request_id=req.request_id, model=req.model,
                                   prompt_tokens=req.prompt_tokens, max_tokens=req.max_tokens,
                                   session=session, flow=flow, created_at=time.monotonic())
            await self.store.put_request(record)
        for worker, charge_leg in charges:
            await self.charge(record, worker, charge_leg)
            if chain and charge_leg in ("aggregated", "prefill") and self.kv is not None:
                # The worker that computes the prompt is the one whose cache counts.
                self.kv.placed(worker, chain, match.get(worker.id, 0))
                self.stats.predicted_hit_blocks[worker.id] += match.get(worker.id, 0)
                self.stats.query_blocks[worker.id] += len(chain)
        if flow == pb.FLOW_LAYERWISE and leg == "entry" and self.on_layerwise is not None:
            self.on_layerwise(req, out)
        return out

    async def charge(self, record: RequestRecord, worker: Worker, leg: str) -> None:
        tokens = record.prompt_tokens if leg == "prefill" else record.prompt_tokens + record.max_tokens
        record.charges.append(Charge(worker_id=worker.id, leg=leg, tokens=tokens))
        await self.store.add_load(worker.id, 1, tokens)
        worker.placements_total += 1
        self.stats.placed[(worker.id, leg)] += 1

    def _context(self, req: pb.PlaceRequest, leg: str, roles: frozenset[Role], chain: list[int] = (),
                 match: dict[str, int] | None = None, cached: dict[str, int] | None = None) -> PlacementContext:
        return PlacementContext(
            request_id=req.request_id, model=req.model, leg=leg, prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens, exclude=frozenset(req.exclude_workers), now=time.monotonic(),
            metrics_max_age_s=self.metrics_max_age_s, roles=roles, chain_blocks=len(chain),
            match_blocks=match or {}, cached_blocks=cached or {})

    def _refusal(self, req: pb.PlaceRequest, leg: str, workers: list[Worker], dropped: dict[str, str],
                 explanation: str) -> pb.Placement:
        if not any(w.serves(req.model) for w in workers):
            return self._error(req, pb.UNKNOWN_MODEL, f"model {req.model!r} is not served here", explanation)
        why = Counter(dropped.values())
        reasons = ", ".join(f"{n} {r}" for r, n in why.most_common()) or "no candidates"
        return self._error(req, pb.NO_HEALTHY_WORKER,
                           f"no available {leg} worker for model {req.model!r} ({reasons})", explanation)

    @staticmethod
    def _decode_ready(workers: list[Worker], model: str) -> bool:
        return any(w.role is Role.DECODE and w.routable and w.weight > 0 and w.serves(model) for w in workers)

    def internal_error(self, req: pb.PlaceRequest, exc: BaseException) -> pb.Placement:
        return self._error(req, pb.INTERNAL, f"placement failed in the control plane: {type(exc).__name__}")

    def _error(self, req: pb.PlaceRequest, code: int, message: str, explanation: str = "") -> pb.Placement:
        self.stats.errors[pb.ErrorCode.Name(code)] += 1
        return pb.Placement(seq=req.seq, request_id=req.request_id, error=code, error_message=message,
                            explanation=explanation)

    # ------------------------------------------------------------------ lifecycle reports

    async def report(self, event: pb.LifecycleEvent) -> None:
        kind = event.kind
        if kind == pb.EVENT_PREFILL_DONE:
            record = await self.store.get_request(event.request_id)
            if record is not None:
                await self._release(record, leg="prefill")
            return
        if kind == pb.EVENT_LEG_FAILED:
            record = await self.store.get_request(event.request_id)
            if record is not None:
                await self._release(record, worker_id=event.worker_id)
            if event.worker_id:
                await self._note_failure(event)
            return
        if kind in (pb.EVENT_FINISHED, pb.EVENT_FAILED, pb.EVENT_CANCELLED):
            record = await self.store.pop_request(event.request_id)
            if record is not None:
                await self._release(record)
            if kind == pb.EVENT_FAILED and event.worker_id:
                await self._note_failure(event)
            if self.on_request_end is not None:
                self.on_request_end(event.request_id)

    async def _note_failure(self, event: pb.LifecycleEvent) -> None:
        worker = await self.store.get_worker(event.worker_id)
        if worker is None:
            return
        worker.failures_total += 1
        worker.last_error = event.message[:300]
        if event.upstream_status == 0:
            # The data plane could not reach the engine at all: stop routing there now
            # instead of waiting for the next health check to notice.
            worker.health = Health.UNHEALTHY
            log.warning("worker %s unreachable from data plane (%s): marked unhealthy",
                        worker.id, event.message[:200])

    async def _release(self, record: RequestRecord, leg: str | None = None, worker_id: str = "") -> None:
        keep = []
        for charge in record.charges:
            if (leg is None or charge.leg == leg) and (not worker_id or charge.worker_id == worker_id):
                await self.store.add_load(charge.worker_id, -1, -charge.tokens)
            else:
                keep.append(charge)
        record.charges = keep

    async def orphan_session(self, session: str) -> int:
        """A data plane's session ended: its requests may still be streaming.

        A session can end while the node lives on (a network blip, a keepalive GOAWAY, a
        control-plane restart of the stream). Releasing its load there would make every
        request it still serves invisible to placement, so the records only lose their
        owner; the node claims them back when it reconnects (``claim``), and whatever is
        still unclaimed after ``session_grace_s`` is released (``release_orphans``).
        """
        orphaned = 0
        now = time.monotonic()
        for record in await self.store.list_requests():
            if record.session == session:
                record.session = ""
                record.orphaned_at = now
                orphaned += 1
        self.stats.sessions["closed"] += 1
        self.stats.sessions["requests_orphaned"] += orphaned
        return orphaned

    async def claim(self, session: str, request_ids) -> int:
        """A reconnecting data plane names the requests it still serves."""
        claimed = 0
        for request_id in request_ids:
            record = await self.store.get_request(request_id)
            if record is not None and (not record.session or record.orphaned_at):
                record.session = session
                record.orphaned_at = 0.0
                claimed += 1
        self.stats.sessions["opened"] += 1
        self.stats.sessions["requests_claimed"] += claimed
        return claimed

    async def release_orphans(self, older_than_s: float | None = None) -> int:
        """Release records whose data plane has not come back within the grace period."""
        grace = self.session_grace_s if older_than_s is None else older_than_s
        cutoff = time.monotonic() - grace
        stale = [r for r in await self.store.list_requests() if r.orphaned_at and r.orphaned_at <= cutoff]
        for record in stale:
            await self._end(record)
        self.stats.sessions["requests_released"] += len(stale)
        return len(stale)

    async def _end(self, record: RequestRecord) -> None:
        await self.store.pop_request(record.request_id)
        await self._release(record)
        if self.on_request_end is not None:
            self.on_request_end(record.request_id)

    async def sweep_stale(self) -> int:
        """Release records whose reports never came (a safety net, not the normal path)."""
        cutoff = time.monotonic() - self.max_request_age_s
        stale = [r for r in await self.store.list_requests() if r.created_at < cutoff]
        for record in stale:
            await self._end(record)
        return len(stale)
