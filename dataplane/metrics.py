"""Data-plane Prometheus metrics, on a registry owned by the app (no process globals).

Everything here is updated once per request, never per streamed chunk. Request metrics are
labelled by model and flow only (never by request); a request that was never placed has
no model label of its own (its model may be anything a client typed), and is counted
only in ``omni_dp_requests_total`` by status class.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)

_CODE_CLASSES = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}

# More distinct (model, flow) pairs than this and the cache of resolved series stops
# growing (the label lookups still work, just slower): models come from the control
# plane's placements, so this is a guard, not a limit anyone should meet.
_MAX_SERIES = 1024


class Series:
    """The labelled children of one (model, flow): resolved once, reused per request."""

    __slots__ = ("ttft", "tpot", "e2e", "placement", "queue", "prefill", "decode",
                 "prompt_tokens", "cached_tokens", "generated_tokens", "flows")

    def __init__(self, m: "DataPlaneMetrics", model: str, flow: str) -> None:
        self.ttft = m.ttft.labels(model, flow)
        self.tpot = m.tpot.labels(model, flow)
        self.e2e = m.e2e.labels(model, flow)
        self.placement = m.placement.labels(model, flow)
        self.queue = m.queue.labels(model, flow)
        self.prefill = m.prefill.labels(model, flow)
        self.decode = m.decode.labels(model, flow)
        self.prompt_tokens = m.prompt_tokens.labels(model, flow)
        self.cached_tokens = m.cached_tokens.labels(model, flow)
        self.generated_tokens = m.generated_tokens.labels(model, flow)
        self.flows = m.flows.labels(flow)


class DataPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)      # process_cpu_seconds_total, process_resident_memory_bytes, ...
        mf = ["model", "flow"]
        self.requests = Counter("omni_dp_requests", "Requests answered, by route and status class",
                                ["route", "code_class"], registry=r)
        self.inflight = Gauge("omni_dp_inflight_requests", "Requests in progress", registry=r)
        self.ttft = Histogram("omni_dp_time_to_first_token_seconds",
                              "Streamed requests: from receipt to the first streamed chunk",
                              mf, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("omni_dp_time_per_output_token_seconds",
                              "Streamed requests: mean inter-token latency, (last - first token) / (tokens - 1)",
                              mf, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("omni_dp_e2e_request_latency_seconds",
                             "Placed requests: from receipt to the end (finished, failed or cancelled)",
                             mf, buckets=_LATENCY_BUCKETS, registry=r)
        self.placement = Histogram("omni_dp_placement_seconds",
                                   "Placement wait: the control plane's answer, queueing included",
                                   mf, buckets=_FAST_BUCKETS, registry=r)
        self.queue = Histogram("omni_dp_queue_seconds",
                               "Time the request waited in the control plane's queue (Placement.queued_ms)",
                               mf, buckets=_FAST_BUCKETS, registry=r)
        self.prefill = Histogram("omni_dp_prefill_seconds",
                                 "Prefill leg: first leg sent to P's answer (sequential) or to the first "
                                 "streamed token (other flows)", mf, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("omni_dp_decode_seconds",
                                "Decode leg: D sent (sequential) or first token (other flows) to the last token",
                                mf, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("omni_dp_prompt_tokens", "Prompt tokens of placed requests", mf, registry=r)
        self.cached_tokens = Counter("omni_dp_cached_tokens",
                                     "Prompt tokens the engines found cached (usage.prompt_tokens_details)",
                                     mf, registry=r)
        self.generated_tokens = Counter("omni_dp_generation_tokens", "Tokens generated", mf, registry=r)
        self.flows = Counter("omni_dp_flows", "Requests by flow", ["flow"], registry=r)
        self.upstream_errors = Counter("omni_dp_upstream_errors", "Failed legs", ["worker", "status"], registry=r)
        self.recomputes = Counter("omni_dp_recomputes", "Requests a decode engine handed back (recomputed)",
                                  registry=r)
        self.cancelled = Counter("omni_dp_client_disconnects", "Requests whose client went away", registry=r)
        self._series: dict[tuple[str, str], Series] = {}
        self._classes = {route: {c: self.requests.labels(route, name) for c, name in _CODE_CLASSES.items()}
                         for route in ("/v1/completions", "/v1/chat/completions")}

    def series(self, model: str, flow: str) -> Series:
        key = (model, flow)
        s = self._series.get(key)
        if s is None:
            s = Series(self, model, flow)
            if len(self._series) < _MAX_SERIES:
                self._series[key] = s
        return s

    def count_request(self, route: str, code: int) -> None:
        by_class = self._classes.get(route)
        child = by_class.get(code // 100) if by_class is not None else None
        if child is None:
            child = self.requests.labels(route, _CODE_CLASSES.get(code // 100, "other"))
        child.inc()
