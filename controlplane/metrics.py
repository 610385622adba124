"""The control plane's /metrics: worker load, health and placement counters, built at scrape time."""

from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from controlplane.kvcache.manager import KVCache
from controlplane.placement import LATENCY_BUCKETS, PlacementStats
from controlplane.prediction import Predictor
from controlplane.queueing import PlacementQueue
from controlplane.workers import Health, WorkerView


class _Snapshot:
    def __init__(self, workers: list[WorkerView], stats: PlacementStats, kv: KVCache | None) -> None:
        self.workers = workers
        self.stats = stats
        self.kv = kv

    def collect(self):
        labels = ["worker", "role", "model", "model_name"]   # model_name: vLLM's label, same value
        reqs = GaugeMetricFamily("omni_worker_inflight_requests", "Requests placed and not finished", labels=labels)
        toks = GaugeMetricFamily("omni_worker_inflight_tokens", "Tokens charged by in-flight requests", labels=labels)
        healthy = GaugeMetricFamily("omni_worker_healthy", "1 if the worker passes health checks", labels=labels)
        ejected = GaugeMetricFamily("omni_worker_ejected", "1 while the request circuit breaker keeps the worker "
                                    "out of rotation", labels=labels)
        now = time.monotonic()
        draining = GaugeMetricFamily("omni_worker_draining", "1 if the worker is draining", labels=labels)
        for w in self.workers:
            lv = [w.id, w.role.value, w.model, w.model]
            reqs.add_metric(lv, w.inflight_requests)
            toks.add_metric(lv, w.inflight_tokens)
            healthy.add_metric(lv, 1 if w.health is Health.HEALTHY else 0)
            ejected.add_metric(lv, 1 if w.state.ejected(now) else 0)
            draining.add_metric(lv, 1 if w.draining else 0)
        placed = CounterMetricFamily("omni_placements", "Placements issued", labels=["worker", "leg"])
        for (worker_id, leg), n in self.stats.placed.items():
            placed.add_metric([worker_id, leg], n)
        errors = CounterMetricFamily("omni_placement_errors", "Placements refused", labels=["code"])
        for code, n in self.stats.errors.items():
            errors.add_metric([code], n)
        sessions = CounterMetricFamily("omni_sessions", "Data-plane sessions opened and closed, and the "
                                       "requests they orphaned, claimed back or let go", labels=["event"])
        for event, n in self.stats.sessions.items():
            sessions.add_metric([event], n)
        yield from (reqs, toks, healthy, ejected, draining, placed, errors, sessions)
        yield from self._cache_metrics()

    def _cache_metrics(self):
        """Predicted prefix hits (router) next to what the engines report, per worker."""
        pred = CounterMetricFamily("omni_kv_predicted_hit_blocks", "Prompt blocks the index said the chosen "
                                   "worker held", labels=["worker"])
        query = CounterMetricFamily("omni_kv_query_blocks", "Prompt blocks placed with a hash chain",
                                    labels=["worker"])
        for worker_id, n in self.stats.predicted_hit_blocks.items():
            pred.add_metric([worker_id], n)
        for worker_id, n in self.stats.query_blocks.items():
            query.add_metric([worker_id], n)
        eng_hits = GaugeMetricFamily("omni_engine_prefix_cache_hits_tokens", "The engine's own "
                                     "vllm:prefix_cache_hits_total, last polled", labels=["worker"])
        eng_queries = GaugeMetricFamily("omni_engine_prefix_cache_queries_tokens", "The engine's own "
                                        "vllm:prefix_cache_queries_total, last polled", labels=["worker"])
        for w in self.workers:
            if w.engine.prefix_hits >= 0:
                eng_hits.add_metric([w.id], w.engine.prefix_hits)
                eng_queries.add_metric([w.id], max(w.engine.prefix_queries, 0))
        yield from (pred, query, eng_hits, eng_queries)
        if self.kv is None:
            return
        blocks = GaugeMetricFamily("omni_kv_index_blocks", "Blocks in the prefix index", labels=["source"])
        refs = GaugeMetricFamily("omni_kv_index_block_refs", "(block, worker) pairs in the prefix index",
                                 labels=["source"])
        for source, index in (("events", self.kv.exact), ("routed", self.kv.approx)):
            st = index.stats()
            blocks.add_metric([source], st.blocks)
            refs.add_metric([source], st.block_refs)
        events = CounterMetricFamily("omni_kv_events", "KV event subscriber counters", labels=["worker", "kind"])
        for worker_id, counters in self.kv.counters().items():
            for kind, n in counters.items():
                events.add_metric([worker_id, kind], n)
        yield from (blocks, refs, events)


class _Scheduling:
    """Latency predictions per worker (and how wrong they were), the queue stage, placement time."""

    def __init__(self, workers: list[WorkerView], stats: PlacementStats, predictor: Predictor | None,
                 queue: PlacementQueue | None) -> None:
        self.workers, self.stats, self.predictor, self.queue = workers, stats, predictor, queue

    def collect(self):
        pending = GaugeMetricFamily("omni_worker_prefill_tokens_pending", "Uncached prompt tokens placed on the "
                                    "worker whose first token has not come yet", labels=["worker"])
        for w in self.workers:
            pending.add_metric([w.id], w.load.prefill_tokens)
        yield pending
        if self.predictor is not None:
            spt = GaugeMetricFamily("omni_worker_prefill_seconds_per_token", "Learned prefill time per uncached "
                                    "prompt token", labels=["worker"])
            ttft = GaugeMetricFamily("omni_worker_predicted_ttft_seconds", "Predicted time to first token of a "
                                     "new 1k-token prompt, with the work already placed there", labels=["worker"])
            tpot = GaugeMetricFamily("omni_worker_predicted_tpot_seconds", "Predicted time per output token "
                                     "with one more request in the batch", labels=["worker"])
            err = GaugeMetricFamily("omni_worker_prediction_error_ratio", "Mean absolute relative error of "
                                    "recent predictions", labels=["worker", "kind"])
            obs = CounterMetricFamily("omni_worker_prediction_observations", "Observations the latency models "
                                      "learned from", labels=["worker", "kind"])
            for w in self.workers:
                m = self.predictor.model(w.id)
                spt.add_metric([w.id], m.ttft.b)
                ttft.add_metric([w.id], m.ttft(w.load.prefill_tokens + 1000))
                tpot.add_metric([w.id], m.tpot(w.load.requests + 1))
                err.add_metric([w.id, "ttft"], m.ttft_error.mean)
                err.add_metric([w.id, "tpot"], m.tpot_error.mean)
                obs.add_metric([w.id, "ttft"], m.ttft.n)
                obs.add_metric([w.id, "tpot"], m.tpot.n)
                if m.pull.n:   # decode engines of the sequential PD flow
                    err.add_metric([w.id, "kv_pull"], m.pull_error.mean)
                    obs.add_metric([w.id, "kv_pull"], m.pull.n)
            yield from (spt, ttft, tpot, err, obs)
        if self.queue is not None:
            yield GaugeMetricFamily("omni_queue_depth", "Requests held in the placement queue",
                                    value=len(self.queue))
            events = CounterMetricFamily("omni_queue_events", "Placement queue events", labels=["event"])
            for event, n in self.queue.counters.items():
                events.add_metric([event], n)
            yield events
            yield CounterMetricFamily("omni_queue_wait_seconds", "Time requests spent held in the queue",
                                      value=self.queue.wait_s_total)
        lat = self.stats.latency
        buckets = [(str(b), n) for b, n in zip(LATENCY_BUCKETS, itertools.accumulate(lat.counts), strict=False)]
        buckets.append(("+Inf", lat.total))
        h = HistogramMetricFamily("omni_placement_seconds", "Time to decide and reserve one placement "
                                  "(queue waits excluded)", buckets=buckets, sum_value=lat.sum_s)
        yield h


class _Counters:
    """A plain ``{label: count}`` dict as one counter family (e.g. the metaserver's calls)."""

    def __init__(self, name: str, doc: str, label: str, counts: dict[str, int]) -> None:
        self.name, self.doc, self.label, self.counts = name, doc, label, counts

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        for key, n in self.counts.items():
            family.add_metric([key], n)
        yield family


def render(workers: list[WorkerView], stats: PlacementStats, kv: KVCache | None = None,
           predictor: Predictor | None = None, queue: PlacementQueue | None = None,
           metaserver_calls: dict[str, int] | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(workers, stats, kv))
    registry.register(_Scheduling(workers, stats, predictor, queue))
    if metaserver_calls is not None:
        registry.register(_Counters("omni_metaserver_calls", "Decode engines' metaserver calls by outcome",
                                    "outcome", metaserver_calls))
    ProcessCollector(registry=registry)
    return generate_latest(registry)
