"""The counters placement keeps for /metrics and ``omni-ctl stats``.

Its own module so that the placer, its commit step (``controlplane.commit``), the lifecycle
and the metrics renderer can all share them without importing each other.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)


@dataclass
class LatencyHistogram:
    counts: list[int]
    sum_s: float = 0.0
    total: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds) if seconds <= LATENCY_BUCKETS[-1]
                    else len(LATENCY_BUCKETS)] += 1
        self.sum_s += seconds
        self.total += 1


@dataclass
class PlacementStats:
    """Counters the control plane exports on /metrics."""

    placed: Counter
    errors: Counter
    predicted_hit_blocks: Counter   # per worker: blocks the index said it held at placement
    query_blocks: Counter           # per worker: blocks of the prompts placed on it
    sessions: Counter               # data-plane sessions: opened, closed; requests claimed, released
    latency: LatencyHistogram       # per placement decision (queue waits excluded)

    @classmethod
    def new(cls) -> PlacementStats:
        return cls(placed=Counter(), errors=Counter(), predicted_hit_blocks=Counter(), query_blocks=Counter(),
                   sessions=Counter(), latency=LatencyHistogram([0] * (len(LATENCY_BUCKETS) + 1)))
