"""The control plane's /metrics: worker load, health and placement counters, built at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controlplane.placement import PlacementStats
from controlplane.workers import Health, Worker


class _Snapshot:
    def __init__(self, workers: list[Worker], stats: PlacementStats) -> None:
        self.workers = workers
        self.stats = stats

    def collect(self):
        labels = ["worker", "role", "model"]
        reqs = GaugeMetricFamily("omni_worker_inflight_requests", "Requests placed and not finished", labels=labels)
        toks = GaugeMetricFamily("omni_worker_inflight_tokens", "Tokens charged by in-flight requests", labels=labels)
        healthy = GaugeMetricFamily("omni_worker_healthy", "1 if the worker passes health checks", labels=labels)
        draining = GaugeMetricFamily("omni_worker_draining", "1 if the worker is draining", labels=labels)
        for w in self.workers:
            lv = [w.id, w.role.value, w.model]
            reqs.add_metric(lv, w.inflight_requests)
            toks.add_metric(lv, w.inflight_tokens)
            healthy.add_metric(lv, 1 if w.health is Health.HEALTHY else 0)
            draining.add_metric(lv, 1 if w.draining else 0)
        placed = CounterMetricFamily("omni_placements", "Placements issued", labels=["worker", "leg"])
        for (worker_id, leg), n in self.stats.placed.items():
            placed.add_metric([worker_id, leg], n)
        errors = CounterMetricFamily("omni_placement_errors", "Placements refused", labels=["code"])
        for code, n in self.stats.errors.items():
            errors.add_metric([code], n)
        yield from (reqs, toks, healthy, draining, placed, errors)


def render(workers: list[Worker], stats: PlacementStats) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(workers, stats))
    return generate_latest(registry)
