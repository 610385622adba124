"""One request's lifecycle as the control plane must hear it: exactly one ending.

The ledger on the control plane frees a worker's load only when it hears how a request
ended, so every path out of a handler (success, failure, client gone) goes through here.
"""

from __future__ import annotations

import time

from dataplane.placement_client import PlacementClient
from dataplane.requests import ClientRequest
from protos import omni_proxy_pb2 as pb


class RequestTracker:
    __slots__ = ("client", "req", "started", "first_token_at", "ended", "prefill_released")

    def __init__(self, client: PlacementClient, req: ClientRequest) -> None:
        self.client = client
        self.req = req
        self.started = time.perf_counter()
        self.first_token_at = 0.0
        self.ended = False
        self.prefill_released = False

    def _event(self, kind: int, **kw) -> None:
        self.client.report(pb.LifecycleEvent(request_id=self.req.placement_id, kind=kind, **kw))

    def first_token(self, streamed: bool = True) -> None:
        """The prompt is computed: the control plane stops counting it as prefill work
        ahead of later requests, and learns the engine's prefill speed from the time."""
        if not self.first_token_at:
            self.first_token_at = time.perf_counter()
            self._event(pb.EVENT_FIRST_TOKEN, ttft_ms=self.ttft_s * 1000, streamed=streamed)

    def prefill_done(self) -> None:
        if not self.prefill_released:
            self.prefill_released = True
            self._event(pb.EVENT_PREFILL_DONE)

    @property
    def ttft_s(self) -> float:
        return (self.first_token_at - self.started) if self.first_token_at else 0.0

    def finished(self, completion_tokens: int) -> None:
        if not self.ended:
            self.ended = True
            self._event(pb.EVENT_FINISHED, prompt_tokens=self.req.prompt_tokens,
                        completion_tokens=completion_tokens, ttft_ms=self.ttft_s * 1000,
                        latency_ms=(time.perf_counter() - self.started) * 1000)

    def failed(self, worker_id: str, message: str, upstream_status: int) -> None:
        if not self.ended:
            self.ended = True
            self._event(pb.EVENT_FAILED, worker_id=worker_id, message=message[:500],
                        upstream_status=upstream_status)

    def leg_failed(self, worker_id: str, message: str, upstream_status: int) -> None:
        """One leg failed and is being retried elsewhere: release just that worker."""
        self._event(pb.EVENT_LEG_FAILED, worker_id=worker_id, message=message[:500],
                    upstream_status=upstream_status)

    def continue_as(self, req: ClientRequest, completion_tokens: int) -> None:
        """A recompute: close the old placement's books and follow the new one.

        The time to first token stays the client's: it was measured on the first attempt.
        """
        self._event(pb.EVENT_FINISHED, prompt_tokens=self.req.prompt_tokens,
                    completion_tokens=completion_tokens, message="recomputed")
        self.req = req
        self.prefill_released = False

    def cancelled(self) -> None:
        if not self.ended:
            self.ended = True
            self._event(pb.EVENT_CANCELLED)
