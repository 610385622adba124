"""Data-plane Prometheus metrics, on a registry owned by the app (no process globals).

Everything here is updated once per request, never per streamed chunk. Request metrics are
labelled by model (twice: ``model`` and vLLM's ``model_name``) and flow only (never by
request); a request that was never placed has no model label of its own (its model may be anything a client
typed), and is counted
only in ``omni_dp_requests_total`` by status class.

The per-request series are plain Python numbers (``Hist``, ``Count``), read by a collector
when /metrics is scraped: prometheus_client's own Histogram takes a lock and builds
per-bucket objects on every observation, about 0.6 us each, and a request makes a dozen.
They are updated and scraped on the event loop's thread only, so they need no lock.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30)
# Placement waits: fine between 0.5 and 5 ms, where a p99 target of a couple of ms sits.
_PLACEMENT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075,
                      0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)

_CODE_CLASSES = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}

# More distinct (model, flow) pairs than this and new pairs share one overflow series:
# models come from the control plane's placements, so this is a guard, not a limit anyone
# should meet.
_MAX_SERIES = 1024


class Hist:
    """One histogram series: bucket counts (the last one is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1     # le is inclusive
        self.sum += value


class Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Family:
    """A labelled family of ``Hist`` or ``Count`` series, rendered at scrape time."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None) -> None:
        self.name, self.doc, self.label_names, self.buckets = name, doc, labels, buckets
        self.series: dict[tuple[str, ...], Hist | Count] = {}

    def labels(self, *values: str):
        child = self.series.get(values)
        if child is None:
            child = self.series[values] = Hist(self.buckets) if self.buckets is not None else Count()
        return child

    def metric(self) -> Metric:
        if self.buckets is None:
            fam = CounterMetricFamily(self.name, self.doc, labels=self.label_names)
            for values, c in self.series.items():
                assert isinstance(c, Count)   # no buckets: every child is a Count
                fam.add_metric(list(values), c.value)
            return fam
        hist = HistogramMetricFamily(self.name, self.doc, labels=self.label_names)
        edges = [floatToGoString(b) for b in self.buckets] + ["+Inf"]
        for values, h in self.series.items():
            assert isinstance(h, Hist)
            total, cumulative = 0, []
            for edge, n in zip(edges, h.counts, strict=False):
                total += n
                cumulative.append((edge, total))
            hist.add_metric(list(values), cumulative, h.sum)
        return hist


class _Families(Collector):
    def __init__(self, families: list[_Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for fam in self.families:
            yield fam.metric()


class Series:
    """The series of one (model, flow): resolved once, reused per request."""

    __slots__ = ("ttft", "tpot", "e2e", "placement", "queue", "prefill", "decode",
                 "prompt_tokens", "cached_tokens", "generated_tokens", "flows")

    def __init__(self, m: DataPlaneMetrics, model: str, flow: str) -> None:
        lv = (model, model, flow)      # model_name: vLLM's label, the same value
        self.ttft = m.ttft.labels(*lv)
        self.tpot = m.tpot.labels(*lv)
        self.e2e = m.e2e.labels(*lv)
        self.placement = m.placement.labels(*lv)
        self.queue = m.queue.labels(*lv)
        self.prefill = m.prefill.labels(*lv)
        self.decode = m.decode.labels(*lv)
        self.prompt_tokens = m.prompt_tokens.labels(*lv)
        self.cached_tokens = m.cached_tokens.labels(*lv)
        self.generated_tokens = m.generated_tokens.labels(*lv)
        self.flows = m.flows.labels(flow)


class DataPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)      # process_cpu_seconds_total, process_resident_memory_bytes, ...
        # ``model_name`` carries the same value as ``model``: vLLM's per-model label, so one
        # dashboard query (``by (model_name)``) joins the proxy's series to the engines'.
        mf = ("model", "model_name", "flow")
        self.requests = _Family("omni_dp_requests", "Requests answered, by route and status class",
                                ("route", "code_class"))
        self.ttft = _Family("omni_dp_time_to_first_token_seconds",
                            "Streamed requests: from receipt to the first streamed chunk", mf, _LATENCY_BUCKETS)
        self.tpot = _Family("omni_dp_time_per_output_token_seconds",
                            "Streamed requests: mean inter-token latency, (last - first token) / (tokens - 1)",
                            mf, _TPOT_BUCKETS)
        self.e2e = _Family("omni_dp_e2e_request_latency_seconds",
                           "Placed requests: from receipt to the end (finished, failed or cancelled)",
                           mf, _LATENCY_BUCKETS)
        self.placement = _Family("omni_dp_placement_seconds",
                                 "Placement wait: block hashes computed to the control plane's answer, "
                                 "queueing included", mf, _PLACEMENT_BUCKETS)
        self.queue = _Family("omni_dp_queue_seconds",
                             "Time the request waited in the control plane's queue (Placement.queued_ms)",
                             mf, _FAST_BUCKETS)
        self.prefill = _Family("omni_dp_prefill_seconds",
                               "Prefill leg: first leg sent to P's answer (sequential) or to the first "
                               "streamed token (other flows)", mf, _LATENCY_BUCKETS)
        self.decode = _Family("omni_dp_decode_seconds",
                              "Decode leg: D sent (sequential) or first token (other flows) to the last token",
                              mf, _LATENCY_BUCKETS)
        self.prompt_tokens = _Family("omni_dp_prompt_tokens", "Prompt tokens of placed requests", mf)
        self.cached_tokens = _Family("omni_dp_cached_tokens",
                                     "Prompt tokens the engines found cached (usage.prompt_tokens_details)", mf)
        self.generated_tokens = _Family("omni_dp_generation_tokens", "Tokens generated", mf)
        self.flows = _Family("omni_dp_flows", "Placed requests by flow", ("flow",))
        r.register(_Families([self.requests, self.ttft, self.tpot, self.e2e, self.placement, self.queue,
                              self.prefill, self.decode, self.prompt_tokens, self.cached_tokens,
                              self.generated_tokens, self.flows]))
        self.inflight_requests = 0        # read at scrape time by the gauge below
        self.inflight = Gauge("omni_dp_inflight_requests", "Requests in progress", registry=r)
        self.inflight.set_function(lambda: self.inflight_requests)
        self.upstream_errors = Counter("omni_dp_upstream_errors", "Failed legs", ["worker", "status"], registry=r)
        self.recomputes = Counter("omni_dp_recomputes", "Requests a decode engine handed back (recomputed)",
                                  registry=r)
        self.cancelled = Counter("omni_dp_client_disconnects", "Requests whose client went away", registry=r)
        self.auth_failures = Counter("omni_dp_auth_failures", "Requests refused for their API key (401): "
                                     "reason missing or invalid", ["reason"], registry=r)
        for reason in ("missing", "invalid"):
            self.auth_failures.labels(reason)      # at 0 from the start, so a rate() sees the first one
        self._series: dict[tuple[str, str], Series] = {}
        self._classes = {route: {c: self.requests.labels(route, name) for c, name in _CODE_CLASSES.items()}
                         for route in ("/v1/completions", "/v1/chat/completions")}

    def series(self, model: str, flow: str) -> Series:
        key = (model, flow)
        s = self._series.get(key)
        if s is None:
            if len(self._series) >= _MAX_SERIES:
                key = ("_other", flow)
                s = self._series.get(key)
                if s is not None:
                    return s
            s = self._series[key] = Series(self, *key)
        return s

    def count_request(self, route: str, code: int) -> None:
        by_class = self._classes.get(route)
        child = by_class.get(code // 100) if by_class is not None else None
        if child is None:
            child = self.requests.labels(route, _CODE_CLASSES.get(code // 100, "other"))
        child.inc()
