"""Scorers: each turns one signal into a preference in [0, 1].

``prefix_cache`` and ``least_load`` are computed again, for the built-in cache policies, in
``fused.py``: change both (``tests/test_scheduling_fused.py`` compares them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from controlplane.scheduling.base import PlacementContext
from controlplane.scheduling.latency import PredictedLatencyScorer
from controlplane.scheduling.shared import MIN_MATCH
from controlplane.workers import WorkerView


def effective_requests(worker: WorkerView, ctx: PlacementContext) -> int:
    """Our own in-flight count, raised by the engine's if the engine sees more.

    Our count is exact for traffic we placed and current to the last placement; the
    engine's count catches traffic we did not place (other routers, direct clients) but
    lags by a polling interval, so it may only raise the figure, never lower it.
    """
    count = worker.inflight_requests
    eng = worker.engine
    if eng.running >= 0 and eng.fresh(ctx.metrics_max_age_s, ctx.now or time.monotonic()):
        count = max(count, eng.running + max(eng.waiting, 0))
    return count


def counts_and_work(ctx: PlacementContext, workers: list[WorkerView],
                    per_request: int) -> tuple[list[int], list[float]]:
    """Each worker's ``effective_requests`` and its ``LeastLoadScorer.load``, both inlined:
    this runs once per candidate per placement (the scorer, and ``fused.decide`` that also
    keeps the counts for its picker)."""
    counts: list[int] = []
    work: list[float] = []
    now = 0.0
    for w in workers:
        load, eng = w.load, w.engine
        count = load.requests
        if eng.running >= 0:
            if not now:
                now = ctx.now or time.monotonic()
            if eng.fresh(ctx.metrics_max_age_s, now):
                count = max(count, eng.running + max(eng.waiting, 0))
        counts.append(count)
        weight = w.spec.weight
        work.append((load.tokens + per_request * count) / (weight if weight > 1e-9 else 1e-9))
    return counts, work


@dataclass
class LeastLoadScorer:
    """Prefers the worker with the least in-flight work per unit of weight.

    Work = in-flight tokens + ``tokens_per_request`` for each in-flight request, so that
    many short requests and one long one both count.
    """

    tokens_per_request: int = 256
    name: str = "least_load"

    def load(self, ctx: PlacementContext, worker: WorkerView) -> float:
        work = worker.inflight_tokens + self.tokens_per_request * effective_requests(worker, ctx)
        return work / max(worker.weight, 1e-9)

    def score(self, ctx: PlacementContext, workers: list[WorkerView]) -> list[float]:
        _, loads = counts_and_work(ctx, workers, self.tokens_per_request)
        top = max(loads, default=0.0)
        if top <= 0:
            return [1.0] * len(workers)
        return [1.0 - load / top for load in loads]


@dataclass
class PrefixCacheScorer:
    """Prefers the worker that already holds more of the prompt's KV blocks that the others lack.

    Score = leading blocks held beyond the common depth / blocks in the prompt, from the
    control plane's prefix index (exact from engine KV events, or remembered routing for
    engines without them). The common depth is the candidates' minimum match, or a shared
    prefix such as the system prompt every request starts with (``common_blocks``, see
    ``controlplane.scheduling.shared``): it prefers no one, and counting it starved the
    engines that missed the first requests. Every score is 0 when the deepest match covers
    no more than ``min_match`` of the prompt (SGLang and vllm-router's cache threshold, 0.3):
    a small match does not decide, load does.
    """

    min_match: float = MIN_MATCH
    name: str = "prefix_cache"
    uses_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"min_match must be 0 to 1, got {self.min_match!r}")

    def score(self, ctx: PlacementContext, workers: list[WorkerView]) -> list[float]:
        n = ctx.chain_blocks
        if not n:
            return [0.0] * len(workers)
        get = ctx.match_blocks.get
        depths = [get(w.spec.id, 0) for w in workers]
        top = max(depths, default=0)
        if top <= self.min_match * n:
            return [0.0] * len(workers)
        common = max(ctx.common_blocks, min(depths))
        return [(d - common) / n if d > common else 0.0 for d in depths]


SCORERS = {"least_load": LeastLoadScorer, "prefix_cache": PrefixCacheScorer,
           "predicted_latency": PredictedLatencyScorer}
