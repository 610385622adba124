"""One request's lifecycle: its stage timestamps, and exactly one ending for the control plane.

The ledger on the control plane frees a worker's load only when it hears how a request
ended, so every path out of a handler (success, failure, client gone) goes through here.

The tracker also carries the request's stage timestamps (``time.perf_counter()`` floats,
0.0 until reached), read once at the end for the metrics, the access log and the trace
(``dataplane.observe``). They are plain slots: nothing is allocated per stage.

    received -> tokenized -> matched (block hashes) -> placed (placement answered;
    ``queued_ms`` of it in the control plane's queue) -> dispatched (first leg sent:
    the prefill leg in PD, the only leg in aggregated) -> prefill_answered (sequential:
    P returned its kv_transfer_params) -> decode_dispatched -> first_token ->
    last_token -> done (finished, failed or cancelled)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dataplane.requests import ClientRequest
from protos import omni_proxy_pb2 as pb

if TYPE_CHECKING:   # OpenTelemetry is an optional dependency, imported only with --otel-endpoint
    from opentelemetry.trace import Span

    from dataplane.otel import Tracing

_now = time.perf_counter

# Leg kinds (tracker.leg): what the leg stands for in the request's stages.
LEG_PREFILL = "prefill"    # P: sets dispatched (first attempt; a later one is a retry)
LEG_DECODE = "decode"      # D: sets decode_dispatched
LEG_WHOLE = "whole"        # aggregated, or layerwise D (P is the control plane's): both

FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"


class RequestTracker:
    __slots__ = ("client", "req", "placed", "started", "first_token_at", "ended", "prefill_released",
                 "received", "tokenized", "matched", "placed_at", "queued_ms", "dispatched",
                 "prefill_answered", "decode_dispatched", "last_token", "done",
                 "outcome", "completion_tokens", "cached_tokens", "flow", "prefill_worker", "decode_worker",
                 "error", "upstream_status", "retries", "recomputes", "stream", "trace", "tracing", "span", "legs",
                 "admitted")

    def __init__(self, client, req: ClientRequest | None = None, *, received: float = 0.0) -> None:
        self.client = client
        self.req = req
        self.placed = False            # lifecycle events go to the control plane only once placed
        self.received = received or _now()
        self.started = 0.0             # when the placement answered (reference of the events' ttft_ms)
        self.tokenized = self.matched = self.placed_at = self.dispatched = 0.0
        self.prefill_answered = self.decode_dispatched = self.first_token_at = 0.0
        self.last_token = self.done = 0.0
        self.queued_ms = 0.0
        self.ended = False
        self.prefill_released = False
        self.outcome = ""
        self.completion_tokens = 0
        self.cached_tokens = -1        # -1: the engine did not say
        self.flow = ""
        self.prefill_worker = self.decode_worker = ""
        self.error = ""
        self.upstream_status = 0
        self.retries = 0
        self.recomputes = 0
        self.stream = False
        self.trace: dict[str, str] | None = None   # {"traceparent": .., "tracestate": ..} forwarded as is
        self.tracing: Tracing | None = None        # dataplane.otel.Tracing when spans are on
        self.span: Span | None = None              # the request's span (tracing on)
        self.legs: dict[str, Span] | None = None   # open leg spans (tracing on)
        self.admitted = False          # holds an admission slot (the data plane releases it at the end)

    # ------------------------------------------------------------------ stages

    def attach(self, req: ClientRequest, placement: pb.Placement, flow: str) -> None:
        """The placement answered: from here on the control plane hears how it ends."""
        self.placed_at = self.started = _now()
        self.req = req
        self.placed = True
        self.queued_ms = placement.queued_ms
        self.flow = flow
        self.stream = req.stream

    def leg(self, kind: str, worker_id: str) -> dict[str, str] | None:
        """A leg is about to be sent: stamp it; the trace headers it must carry (or None).

        A leg sent again before its answer is a retry; legs of a recompute (after the first
        token) keep the first attempt's stamps, so the stages stay in order.
        """
        now = _now()
        if kind == LEG_PREFILL:
            if not self.dispatched:
                self.dispatched = now
            elif not self.prefill_answered and not self.first_token_at:
                self.retries += 1
            self.prefill_worker = worker_id
        else:
            if kind == LEG_WHOLE:
                if not self.dispatched:
                    self.dispatched = now
                elif not self.first_token_at:
                    self.retries += 1
            if not self.first_token_at:
                self.decode_dispatched = now
            self.decode_worker = worker_id
        if self.tracing is not None:
            return self.tracing.leg(self, kind, worker_id)
        return self.trace

    def prefill_answer(self) -> None:
        """Sequential: P answered with the KV parameters D needs."""
        if not self.first_token_at:
            self.prefill_answered = _now()
        if self.legs and self.tracing is not None:
            self.tracing.end_leg(self, LEG_PREFILL, "")

    def stream_ended(self) -> None:
        self.last_token = _now()

    # ------------------------------------------------------------------ control-plane events

    def _event(self, kind: pb.EventKind, **kw) -> None:
        if self.placed:
            self.client.report(pb.LifecycleEvent(request_id=self._placed_req().placement_id, kind=kind, **kw))

    def _placed_req(self) -> ClientRequest:
        """The request placed (set by ``attach``, before any event is reported)."""
        req = self.req
        assert req is not None, "no request attached"
        return req

    def first_token(self, streamed: bool = True) -> None:
        """The prompt is computed: the control plane stops counting it as prefill work
        ahead of later requests, and learns the engine's prefill speed from the time.

        A whole (non-streamed) answer is its own end: the control plane learns nothing from
        its arrival that the ``finished`` report sent in the same turn does not tell it (the
        request's charges are dropped, its workers' breakers close), so no event is sent
        for it: one report per non-streamed request instead of two, in both planes."""
        if not self.first_token_at:
            self.first_token_at = _now()
            if not streamed:
                self.last_token = self.first_token_at
                return
            self._event(pb.EVENT_FIRST_TOKEN, ttft_ms=self.ttft_s * 1000, streamed=True)

    def prefill_done(self) -> None:
        if not self.prefill_released:
            self.prefill_released = True
            self._event(pb.EVENT_PREFILL_DONE)
            if self.legs and self.tracing is not None:
                self.tracing.end_leg(self, LEG_PREFILL, "")

    @property
    def ttft_s(self) -> float:
        """From the placement's answer to the first token (what the control plane hears)."""
        return (self.first_token_at - self.started) if self.first_token_at and self.started else 0.0

    def finished(self, completion_tokens: int) -> None:
        """The answer is complete. Its time to first token goes with it only when streamed:
        a whole answer's first byte is its last, and a ttft that close to the latency made
        the control plane learn a time per output token of about zero from every one."""
        if not self.ended:
            self.ended = True
            self.done = _now()
            self.outcome = FINISHED
            self.completion_tokens = completion_tokens
            if self.placed:
                req = self.req
                assert req is not None, "no request attached"   # (_placed_req, inline)
                self.client.finished(req.placement_id, req.prompt_tokens, completion_tokens,
                                     self.ttft_s * 1000 if self.stream else 0.0, (self.done - self.started) * 1000)

    def failed(self, worker_id: str, message: str, upstream_status: int) -> None:
        if not self.ended:
            self.ended = True
            self.done = _now()
            self.outcome = FAILED
            self.error = message[:500]
            self.upstream_status = upstream_status
            self._event(pb.EVENT_FAILED, worker_id=worker_id, message=self.error,
                        upstream_status=upstream_status)

    def leg_failed(self, worker_id: str, message: str, upstream_status: int, retry_after_s: float = 0.0) -> None:
        """One leg failed and is being retried elsewhere: release just that worker."""
        self._event(pb.EVENT_LEG_FAILED, worker_id=worker_id, message=message[:500],
                    upstream_status=upstream_status, retry_after_s=retry_after_s)
        if self.legs and self.tracing is not None:
            kind = LEG_PREFILL if worker_id == self.prefill_worker else (
                LEG_WHOLE if LEG_WHOLE in self.legs else LEG_DECODE)
            self.tracing.end_leg(self, kind, message)

    def continue_as(self, req: ClientRequest, completion_tokens: int) -> None:
        """A recompute: close the old placement's books and follow the new one.

        The time to first token stays the client's: it was measured on the first attempt.
        """
        self._event(pb.EVENT_FINISHED, prompt_tokens=self._placed_req().prompt_tokens,
                    completion_tokens=completion_tokens, message="recomputed")
        self.req = req
        self.prefill_released = False
        self.recomputes += 1

    def cancelled(self) -> None:
        if not self.ended:
            self.ended = True
            self.done = _now()
            self.outcome = CANCELLED
            self._event(pb.EVENT_CANCELLED)
