"""What happens to a placed request after its placement: reports, sessions, safety nets.

The data planes report how each request's legs end; this module turns those reports into
ledger releases and failure notes. It also owns the rule for sessions that end while
their requests may still be streaming: a request keeps its load until its data plane
claims it back on a new session or a grace period passes (see ``orphan_session``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from controlplane.fleet import Fleet
from controlplane.hooks import Hook
from controlplane.placement import PlacementStats
from controlplane.prediction import Predictor
from controlplane.queueing import PlacementQueue
from controlplane.state import RequestRecord, StateStore
from controlplane.workers import Health
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

_ENDINGS = frozenset({pb.EVENT_FINISHED, pb.EVENT_FAILED, pb.EVENT_CANCELLED})


@dataclass(frozen=True)
class BreakerConfig:
    """When real requests eject a worker that still passes health checks."""

    failures: int = 5          # failed requests in a row
    base_s: float = 10.0       # first ejection; doubles with each one in a row
    max_s: float = 300.0


def _counts_for_breaker(status: int) -> bool:
    """Engine errors (5xx), overload (429), timeouts and unreachable engines (0) count;
    the client's own 4xx do not."""
    return status == 0 or status >= 500 or status == 429


class Lifecycle:
    def __init__(self, store: StateStore, fleet: Fleet, stats: PlacementStats, *,
                 session_grace_s: float = 30.0, max_request_age_s: float = 3600.0,
                 predictor: Predictor | None = None, queue: PlacementQueue | None = None,
                 breaker: BreakerConfig | None = None) -> None:
        self.store = store
        self.breaker = breaker or BreakerConfig()
        self.predictor = predictor or Predictor()
        self.queue = queue
        self.fleet = fleet
        self.stats = stats
        self.session_grace_s = session_grace_s
        self.max_request_age_s = max_request_age_s
        # Emitted with the request id when a placed request ends, whatever ended it (a report,
        # an orphan's release, the stale sweep): the metaserver drops its pending prefill.
        self.request_ended: Hook[[str]] = Hook("request ended")

    # ------------------------------------------------------------------ reports

    async def report(self, event: pb.LifecycleEvent) -> None:
        kind = event.kind
        store = self.store
        if kind == pb.EVENT_FIRST_TOKEN:
            record = await store.get(event.request_id)
            if record is not None:
                self.predictor.prompts_computed(record.charges, time.monotonic())   # (pending_s)
                self._learn_ttft(record, event)
                self._learn_pull(record, event)
                self._note_success(record)
                await store.settle_prefill(event.request_id)
        elif kind == pb.EVENT_PREFILL_DONE:
            await store.release(event.request_id, leg="prefill")
        elif kind == pb.EVENT_LEG_FAILED:
            await store.release(event.request_id, worker_id=event.worker_id or "\0")
            if event.worker_id:
                self._note_failure(event)
        elif kind in _ENDINGS:
            self._ended(await store.end(event.request_id), event)
        else:
            return
        if self.queue is not None:
            self.queue.kick()

    def settle(self, record: RequestRecord, event: pb.LifecycleEvent) -> None:
        """A request whose end came with the notice of its placement (``PlaceRequest.ended``,
        ``Placer.settle``): learned from as an ending ``report`` learns, with ``record`` as
        the ledger would have held it (it was never charged, so nothing is released)."""
        if event.kind in _ENDINGS:
            self._ended(record, event)
            if self.queue is not None:
                self.queue.kick()

    def _ended(self, record: RequestRecord | None, event: pb.LifecycleEvent) -> None:
        """What a request's end teaches, once its ``record`` left the ledger (None: it held none)."""
        kind = event.kind
        if record is not None:
            # (a prompt not settled at a first token: done now)
            self.predictor.prompts_computed(record.charges, time.monotonic())
            if event.first_token:
                # Its FIRST_TOKEN report was folded into this one (the data plane had not
                # sent it yet): learned now, the pull timed back to the first token.
                self._learn_ttft(record, event)
                self._learn_pull(record, event, since_first_s=max(event.latency_ms - event.ttft_ms, 0.0) / 1000)
            if kind == pb.EVENT_FINISHED:
                # A non-streamed answer sends no first-token report: its end is its success.
                self._note_success(record)
                self._learn_tpot(record, event)
            self.request_ended.emit(event.request_id)
        elif self.queue is not None:
            self.queue.cancel(event.request_id)   # it was still waiting for an engine
        if kind == pb.EVENT_FAILED and event.worker_id:
            self._note_failure(event)

    def _learn_ttft(self, record: RequestRecord, event: pb.LifecycleEvent) -> None:
        """A real time to first token teaches the engine that computed the prompt (sequential
        PD: learned from P's own answer instead, see ``Placer._prefill_answered``)."""
        if not event.streamed or event.ttft_ms <= 0 or record.work_ahead_tokens <= 0 \
                or record.flow == pb.FLOW_SEQUENTIAL:
            return
        for charge in record.charges:
            if charge.leg != "decode" and charge.prefill_tokens >= 0:
                self.predictor.observe_ttft(charge.worker_id, record.work_ahead_tokens, event.ttft_ms / 1000)
                return

    def _learn_pull(self, record: RequestRecord, event: pb.LifecycleEvent, since_first_s: float = 0.0) -> None:
        """Sequential PD: from D's placement (P had answered) to the first token is D's pull
        of the prompt tokens it lacked, and its first step (see ``Predictor``).
        ``since_first_s``: how long ago the first token came (a folded report)."""
        if not event.streamed or record.decode_placed_at <= 0:
            return
        for charge in record.charges:
            if charge.leg == "decode":
                self.predictor.observe_pull(charge.worker_id, record.pull_tokens,
                                            time.monotonic() - since_first_s - record.decode_placed_at)
                return

    def _learn_tpot(self, record: RequestRecord, event: pb.LifecycleEvent) -> None:
        """Time per output token after the first, against the decode batch at placement."""
        n = event.completion_tokens
        if n < 2 or event.ttft_ms <= 0 or event.latency_ms <= event.ttft_ms or record.decode_batch <= 0:
            return
        for charge in record.charges:
            if charge.leg != "prefill":
                decode_s = (event.latency_ms - event.ttft_ms) / 1000
                self.predictor.observe_tpot(charge.worker_id, record.decode_batch, decode_s / (n - 1))
                self.predictor.observe_decode(charge.worker_id, decode_s)   # how long a seat is held
                return

    def _note_failure(self, event: pb.LifecycleEvent) -> None:
        wid = event.worker_id
        if wid not in self.fleet:
            return
        state = self.fleet.state(wid)
        now = time.monotonic()
        status = event.upstream_status
        streak = state.failure_streak + 1 if _counts_for_breaker(status) else state.failure_streak
        changes: dict[str, Any] = dict(failures_total=state.failures_total + 1, last_error=event.message[:300],
                       failure_streak=streak)
        if status == 0 and state.health is not Health.UNHEALTHY:
            # The data plane could not reach the engine at all: stop routing there now
            # instead of waiting for the next health check to notice.
            changes["health"] = Health.UNHEALTHY
            log.warning("worker %s unreachable from data plane (%s): marked unhealthy", wid, event.message[:200])
        elif status and _counts_for_breaker(status) and streak >= self.breaker.failures and not state.ejected(now):
            # It answers health checks but fails real requests: eject it for a while
            # (doubling with each ejection in a row); one more failure after it returns
            # ejects it again.
            b = self.breaker
            period = min(b.base_s * (2 ** state.ejections), b.max_s)
            changes.update(ejected_until=now + period, ejections=state.ejections + 1, failure_streak=b.failures - 1)
            log.warning("worker %s ejected for %.0fs after %d failed requests in a row (last: %s %s)",
                        wid, period, streak, status, event.message[:200])
        if event.retry_after_s > 0:
            # The engine said when to come back: no request goes there before then.
            until = now + min(event.retry_after_s, self.breaker.max_s)
            if until > max(state.ejected_until, changes.get("ejected_until", 0.0)):
                changes["ejected_until"] = until
        self.fleet.set_state(wid, dataclasses.replace(state, **changes))

    def _note_success(self, record: RequestRecord) -> None:
        """A request got its first token: its workers' circuit breakers close."""
        fleet = self.fleet
        for charge in record.charges:
            state = fleet.state(charge.worker_id)
            if state.failure_streak or state.ejections:
                fleet.set_state(charge.worker_id, dataclasses.replace(state, failure_streak=0, ejections=0))

    # ------------------------------------------------------------------ sessions

    async def orphan_session(self, session: str) -> int:
        """A data plane's session ended: its requests may still be streaming.

        A session can end while the node lives on (a network blip, a keepalive GOAWAY, a
        restart of the stream). Releasing its load there would make every request it still
        serves invisible to placement, so the records only lose their owner; the node
        claims them back when it reconnects (``claim``), and whatever is still unclaimed
        after ``session_grace_s`` is released (``release_orphans``).
        """
        orphaned = await self.store.orphan(session, time.monotonic())
        if self.queue is not None:
            self.queue.cancel_session(session)   # nobody is left to answer them; the node re-asks
        self.stats.sessions["closed"] += 1
        self.stats.sessions["requests_orphaned"] += orphaned
        return orphaned

    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        """A (re)connecting data plane names the requests it still serves."""
        claimed = await self.store.claim(session, request_ids)
        self.stats.sessions["opened"] += 1
        self.stats.sessions["requests_claimed"] += claimed
        return claimed

    async def release_orphans(self, older_than_s: float | None = None) -> int:
        """Release records whose data plane has not come back within the grace period."""
        grace = self.session_grace_s if older_than_s is None else older_than_s
        ids = await self.store.orphans(time.monotonic() - grace)
        released = 0
        for request_id in ids:
            released += await self._end(request_id)   # another release may have ended it first
        self.stats.sessions["requests_released"] += released
        return released

    async def sweep_stale(self) -> int:
        """Release records whose reports never came (a safety net, not the normal path)."""
        cutoff = time.monotonic() - self.max_request_age_s
        stale = [r.request_id for r in await self.store.records() if r.created_at < cutoff]
        for request_id in stale:
            await self._end(request_id)
        return len(stale)

    async def _end(self, request_id: str) -> bool:
        """End the request's record; False if it had already ended."""
        ended = await self.store.end(request_id) is not None
        if ended:
            self.request_ended.emit(request_id)
        if self.queue is not None:
            self.queue.kick()
        return ended
