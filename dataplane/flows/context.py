"""What every flow needs to drive its legs."""

from __future__ import annotations

from dataclasses import dataclass

from dataplane.messages import Request, StreamResponse
from dataplane.metrics import DataPlaneMetrics
from dataplane.placement_client import PlacementClient
from dataplane.requests import ClientRequest
from dataplane.tracking import RequestTracker
from dataplane.upstream import Upstream
from omni_runtime.retry import Retry


@dataclass(slots=True)   # (made per request: slots build and read faster)
class FlowContext:
    http: Request
    req: ClientRequest
    upstream: Upstream
    placements: PlacementClient
    tracker: RequestTracker
    metrics: DataPlaneMetrics
    retry: Retry            # aggregated legs and D legs (dataplane.retry.leg_retry)
    prefill_retry: Retry    # P legs (sequential; dataplane.retry.prefill_retry)
    # Why the flow closed a leg itself (e.g. parallel P failed): shown to the client.
    abort_reason: str = ""
    # Recompute support (PD flows): watch for D giving the request back; the client's
    # stream, once started, is kept across attempts; what earlier attempts produced.
    watch_recompute: bool = False
    out: StreamResponse | None = None
    prior_text: str = ""
    prior_tokens: int = 0
