"""Data-plane Prometheus metrics, on a registry owned by the app (no process globals).

Everything here is updated per request, never per streamed chunk.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)


class DataPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("omni_dp_requests", "Requests answered", ["route", "code"], registry=r)
        self.inflight = Gauge("omni_dp_inflight_requests", "Requests in progress", registry=r)
        self.latency = Histogram("omni_dp_request_duration_seconds", "Whole request time",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("omni_dp_time_to_first_token_seconds", "Time to first upstream byte",
                              ["flow"], buckets=_LATENCY_BUCKETS, registry=r)
        self.placement = Histogram("omni_dp_placement_seconds", "Control-plane placement round trip",
                                   buckets=_FAST_BUCKETS, registry=r)
        self.flows = Counter("omni_dp_flows", "Requests by flow", ["flow"], registry=r)
        self.upstream_errors = Counter("omni_dp_upstream_errors", "Failed legs", ["worker", "status"], registry=r)
        self.recomputes = Counter("omni_dp_recomputes", "Requests a decode engine handed back (recomputed)",
                                  registry=r)
        self.cancelled = Counter("omni_dp_client_disconnects", "Requests whose client went away", registry=r)
