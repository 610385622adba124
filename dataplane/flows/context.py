"""What every flow needs to drive its legs."""

from __future__ import annotations

from dataclasses import dataclass, field

from dataplane.messages import Request, StreamResponse
from dataplane.metrics import DataPlaneMetrics
from dataplane.placement_client import PlacementClient
from dataplane.requests import ClientRequest
from dataplane.retry import RetryPolicy
from dataplane.tracking import RequestTracker
from dataplane.upstream import Upstream


@dataclass
class FlowContext:
    http: Request
    req: ClientRequest
    upstream: Upstream
    placements: PlacementClient
    tracker: RequestTracker
    metrics: DataPlaneMetrics
    prefill_retries: int = 1      # other prefill workers to try when P fails (sequential)
    retry: RetryPolicy = field(default_factory=RetryPolicy)   # aggregated legs and D legs
    # Why the flow closed a leg itself (e.g. parallel P failed): shown to the client.
    abort_reason: str = ""
    # Recompute support (PD flows): watch for D giving the request back; the client's
    # stream, once started, is kept across attempts; what earlier attempts produced.
    watch_recompute: bool = False
    out: StreamResponse | None = None
    prior_text: str = ""
    prior_tokens: int = 0
