"""The built-in cache policies' scoring and picking in one pass over plain lists.

``cache_aware`` and ``apc_first`` score with ``prefix_cache`` and ``least_load`` and pick with
``cache_aware`` or ``max_score``. Run as plugins, a placement builds a ``Candidate`` (and its
scores dict) per candidate, a list per scorer and another per picker step: at 1,000 workers,
with a dozen sampled candidates, a few percent of a placement (bench/placement.py).
:func:`decide` computes the very same scores, in the same float operations and order, and the
same choice, with the same draw from the picker's ``rng`` on ties, over per-candidate lists,
and builds no candidate objects. A profile uses it only when its plugins are exactly these
types and the context does not ask for every candidate's scores (``keep_scores``: placement
clears it unless it explains the decision, which lists them; then the plugins run).
``tests/test_scheduling_fused.py`` checks that it chooses what the plugins choose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from controlplane.scheduling.base import PlacementContext
from controlplane.scheduling.pickers import CacheAwarePicker, MaxScorePicker
from controlplane.scheduling.scorers import LeastLoadScorer, PrefixCacheScorer, counts_and_work, effective_requests
from controlplane.workers import WorkerView


def applies(scorers: Sequence[tuple[Any, float]], picker: Any) -> bool:
    """Whether a profile's scorers and picker are the ones :func:`decide` computes."""
    return len(scorers) == 2 and type(scorers[0][0]) is PrefixCacheScorer \
        and type(scorers[1][0]) is LeastLoadScorer and type(picker) in (CacheAwarePicker, MaxScorePicker)


def decide(ctx: PlacementContext, workers: list[WorkerView], depths: list[int] | None,
           scorers: Sequence[tuple[Any, float]], picker: Any) -> WorkerView:
    """The worker the plugins would choose among ``workers`` (``depths``: each one's match,
    as ``Profile.place`` read them; None when the placement has no chain); ``scorers`` and
    ``picker`` are a profile's for which :func:`applies` holds."""
    (prefix, w_prefix), (least, w_least) = scorers
    n = len(workers)
    # PrefixCacheScorer.score
    pre: list[float] | None = None
    chain_blocks = ctx.chain_blocks
    if chain_blocks and depths is None:     # (matches given without the chain itself: the scorer reads them)
        get = ctx.match_blocks.get
        depths = [get(w.spec.id, 0) for w in workers]
    if chain_blocks and depths:
        if max(depths) > prefix.min_match * chain_blocks:
            common = max(ctx.common_blocks, min(depths))
            pre = [(d - common) / chain_blocks if d > common else 0.0 for d in depths]
    # LeastLoadScorer.score; the requests each worker runs (effective_requests) kept for the picker
    running, work = counts_and_work(ctx, workers, least.tokens_per_request)
    top_work = max(work, default=0.0)
    # Each candidate's combined score, summed as Profile.place sums it: 0.0, += each weighted part.
    scores: list[float] = []
    for i in range(n):
        score = 0.0
        score += w_prefix * (pre[i] if pre is not None else 0.0)
        score += w_least * (1.0 - work[i] / top_work if top_work > 0 else 1.0)
        scores.append(score)
    if type(picker) is CacheAwarePicker:
        top = _cache_aware(ctx, workers, picker, pre, scores, running)
    else:
        best = max(scores)
        top = [i for i in range(n) if scores[i] >= best - 1e-12]
    return workers[top[0]] if len(top) == 1 else picker.rng.choice([workers[i] for i in top])


def _cache_aware(ctx: PlacementContext, workers: list[WorkerView], picker: CacheAwarePicker,
                 pre: list[float] | None, scores: list[float], running: list[int]) -> list[int]:
    """CacheAwarePicker.pick's tied best, as indexes. Its loads are ``effective_requests``,
    which for a worker without engine metrics is its own count: ``running`` computed that
    same figure (with ``ctx.now``), so it is recomputed only where metrics exist."""
    loads = running
    if any(w.engine.running >= 0 for w in workers):
        loads = [w.load.requests if w.engine.running < 0 else effective_requests(w, ctx) for w in workers]
    n = len(workers)
    lo, hi = min(loads), max(loads)
    if hi - lo > picker.abs_threshold and hi > picker.rel_threshold * lo:
        return [i for i in range(n) if loads[i] == lo]
    if (max(pre) if pre else 0.0) <= picker.cache_threshold:
        held = ctx.blocks_held() or {}
        keys = [(loads[i], workers[i].load.prefill_tokens, held.get(workers[i].spec.id, 0)) for i in range(n)]
        least = min(keys)
        return [i for i in range(n) if keys[i] == least]
    best = max(scores)
    return [i for i in range(n) if scores[i] >= best - 1e-12]
