"""Prometheus /metrics with vLLM's metric names and labels.

Routers scrape real engines for these exact series, so the sim must expose the same
names. Counters and gauges are read from the engine at scrape time (no per-token
Prometheus calls on the hot path); latency histograms are observed once per request.
Each app gets its own registry so several sims can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from simulator.config import SimConfig
from simulator.engine import FINISH_REASONS, Engine, SimRequest

# Bucket edges copied from vllm/v1/metrics/loggers.py so dashboards line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

LABELS = ("model_name", "engine")


class SimMetrics:
    """Engine observer plus the registry /metrics renders."""

    def __init__(self, cfg: SimConfig) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)     # process_* of the simulator's own process
        self._labels = {"model_name": cfg.model, "engine": "0"}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(**self._labels)

        self._ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          TTFT_BUCKETS)
        self._e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                         E2E_BUCKETS)
        self._tpot = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          ITL_BUCKETS)
        self._prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self._gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                         TOKEN_BUCKETS)

    def watch(self, engine: Engine) -> None:
        self.registry.register(_EngineCollector(engine, self._labels))

    # EngineObserver
    def on_first_token(self, req: SimRequest, now: float) -> None:
        self._ttft.observe(now - req.arrival)

    def on_finished(self, req: SimRequest, now: float) -> None:
        if req.finish_reason == "abort":
            return
        self._e2e.observe(now - req.arrival)
        self._prompt.observe(req.prompt_tokens)
        self._gen.observe(len(req.output))
        if req.first_token_at is not None and len(req.output) > 1:
            # Mean inter-token latency of this request, observed once (vLLM observes per token).
            self._tpot.observe((now - req.first_token_at) / (len(req.output) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads gauges and counters straight from the engine when scraped."""

    def __init__(self, engine: Engine, labels: dict[str, str]) -> None:
        self._engine = engine
        self._names = list(labels)
        self._values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        e, t = self._engine, self._engine.totals

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=self._names)
            g.add_metric(self._values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=self._names)
            c.add_metric(self._values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    e.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_cache_usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", t.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", t.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      t.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      t.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", t.preemptions)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                                        labels=[*self._names, "source"])
        by_source.add_metric([*self._values, "local_compute"], t.prompt_tokens_local)
        by_source.add_metric([*self._values, "local_cache_hit"], t.prompt_tokens_cached)
        by_source.add_metric([*self._values, "external_kv_transfer"], t.prompt_tokens_external)
        yield by_source
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*self._names, "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([*self._values, reason], t.finished.get(reason, 0))
        yield success
