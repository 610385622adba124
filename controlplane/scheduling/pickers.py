"""Pickers: choose one candidate from the scored list.

``cache_aware`` and ``max_score`` are computed again, for the built-in cache policies, in
``fused.py``: change both (``tests/test_scheduling_fused.py`` compares them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from controlplane.scheduling.base import Candidate, PlacementContext
from controlplane.scheduling.latency import misses_slo
from controlplane.scheduling.scorers import effective_requests


@dataclass
class MaxScorePicker:
    """Highest score wins; ties are broken at random so equal workers share traffic."""

    rng: random.Random = field(default_factory=random.Random)
    name: str = "max_score"

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate:
        best = max([c.score for c in candidates])
        top = [c for c in candidates if c.score >= best - 1e-12]
        return top[0] if len(top) == 1 else self.rng.choice(top)


@dataclass
class NearBestPicker:
    """Among the candidates scored within ``tolerance`` of the best, the least loaded.

    A learned score differs between equal engines by the noise of what each has learned:
    taken at face value, the engine whose fit came out a few percent faster wins every
    close call, takes most of the traffic, and its prefix cache evicts what the others have
    room for (seen with ``predicted_latency`` in bench/slo_replay.py). Differences smaller
    than the model's own error are not preferences; load decides them (requests in flight,
    then uncached prefill tokens placed there), then chance.

    For a decode leg the band is at least the candidates' mean TPOT prediction error (at
    most ``max_tolerance``): a decode engine's step time barely depends on its batch, so
    its fit is mostly noise, and one decode engine whose first samples came out slow was
    never chosen again (all decodes on the other one, in bench/slo_replay.py's PD mode).

    Within the band, the candidate holding most of the prompt beyond the common prefix
    (``ctx.common_blocks``: what tells no one apart, such as the system prompt) goes first:
    a conversation's engine holds its history for certain, while a few percent of predicted
    cost is noise. Decided by load, a follow-up left its engine whenever that engine's
    longer batch (predicted TPOT) brought the two costs within the band: on one shared
    system prompt at 8x, 55-64 % of follow-ups stayed against vllm-router's 79 %, with
    fewer prefix hits (docs/benchmarks/workloads_notes.md). A prompt that matches nothing
    beyond the common prefix (a new conversation) is decided by load as before.

    Before load, when the request names its own SLO (``X-SLO-*`` headers) and the scorer
    predicted the candidates: the ones predicted to meet it (``latency.misses_slo``). Only
    within the band, and after the conversation's engine: a candidate the scorer finds
    clearly costlier (it would recompute a conversation, or its queue is longer) is not taken
    for the one request's targets, as the ``slo`` filter did (docs/benchmarks/workloads_notes.md).
    """

    tolerance: float = 0.05
    max_tolerance: float = 0.5
    rng: random.Random = field(default_factory=random.Random)
    name: str = "near_best"

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate:
        best = max([c.score for c in candidates])
        tolerance = self.tolerance
        if ctx.leg == "decode" and ctx.predictor is not None and len(candidates) > 1:
            errors = [ctx.predictor.model(c.worker.id).tpot_error.mean for c in candidates]
            tolerance = max(tolerance, min(sum(errors) / len(errors), self.max_tolerance))
        floor = best - abs(best) * tolerance - 1e-12
        near = [c for c in candidates if c.score >= floor]
        if len(near) == 1:
            return near[0]
        common, match = ctx.common_blocks, ctx.match_blocks.get
        slo = bool(ctx.ttft_slo_s or ctx.tpot_slo_s) and bool(ctx.predicted)
        keys = [(common - match(c.worker.id, 0) if match(c.worker.id, 0) > common else 0,
                 slo and misses_slo(ctx, c.worker),
                 effective_requests(c.worker, ctx), c.worker.load.prefill_tokens) for c in near]
        least = min(keys)
        top = [c for c, key in zip(near, keys, strict=False) if key == least]
        return top[0] if len(top) == 1 else self.rng.choice(top)


@dataclass
class WeightedRandomPicker:
    rng: random.Random = field(default_factory=random.Random)
    name: str = "random"

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate:
        return self.rng.choices(candidates, weights=[c.worker.weight for c in candidates])[0]


@dataclass
class RoundRobinPicker:
    """Smooth weighted round robin (nginx's): even spread, weights respected, no bursts."""

    name: str = "round_robin"
    _current: dict[str, float] = field(default_factory=dict)

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate:
        total = 0.0
        best: Candidate | None = None
        for c in candidates:
            w = c.worker.weight
            cur = self._current.get(c.worker.id, 0.0) + w
            self._current[c.worker.id] = cur
            total += w
            if best is None or cur > self._current[best.worker.id]:
                best = c
        assert best is not None
        self._current[best.worker.id] -= total
        return best


@dataclass
class PowerOfTwoPicker:
    """Sample two candidates at random and keep the better scored one.

    Cheap, and it avoids the herd effect of always picking the global minimum when
    several routers share one view of load.
    """

    rng: random.Random = field(default_factory=random.Random)
    name: str = "power_of_two"

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(candidates, 2)
        if a.score == b.score:
            return a
        return a if a.score > b.score else b


@dataclass
class CacheAwarePicker:
    """SGLang's cache-aware rule: follow the cache unless the load is out of balance.

    Out of balance means ``max - min > abs_threshold`` and ``max > rel_threshold * min``
    over the candidates' in-flight requests; then the least-loaded worker wins outright,
    because a warm cache on an overloaded worker costs more than it saves.

    The prefix-cache score it reads is the part of a match that tells candidates apart, and 0
    when the deepest match is a small part of the prompt (``PrefixCacheScorer``): a new
    conversation on the system prompt every request starts with follows load, not the engines
    that happened to get the first requests (issue 17: with any match followed, one engine of
    four received none of 978 requests, and the balance override's 32-request gap was never
    reached).

    When no candidate's score exceeds ``cache_threshold`` (0: any part of a match that tells
    candidates apart, once the whole match covers more than the scorer's ``min_match``, 0.3,
    of the prompt: SGLang's and vllm-router's threshold), the request goes
    to the least-loaded worker (requests in flight, then uncached prefill tokens placed
    there), the fewest blocks held breaking ties (SGLang's "smallest tree"). Load comes
    first because it is counted at placement: a prompt still queued or prefilling has
    stored no blocks yet, so by cache size alone the same engine stayed "smallest" for a
    whole burst and every new long prompt piled onto it (docs/benchmarks/slo_replay_notes.md;
    vllm-router's low-match branch also takes the fewest requests in flight).
    """

    abs_threshold: int = 32
    rel_threshold: float = 1.5
    cache_threshold: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    name: str = "cache_aware"
    uses_prefix_cache: bool = True
    uses_tree_sizes: bool = True

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate:
        loads = []
        for c in candidates:      # effective_requests(), with its common case (no engine metrics) inline
            w = c.worker
            loads.append(w.load.requests if w.engine.running < 0 else effective_requests(w, ctx))
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            best = min(loads)
            top = [c for c, load in zip(candidates, loads, strict=False) if load == best]
        elif max([c.scores.get("prefix_cache", 0.0) for c in candidates]) <= self.cache_threshold:
            held = ctx.blocks_held() or {}
            keys = [(load, c.worker.load.prefill_tokens, held.get(c.worker.id, 0))
                    for c, load in zip(candidates, loads, strict=False)]
            least = min(keys)
            top = [c for c, key in zip(candidates, keys, strict=False) if key == least]
        else:
            best_score = max([c.score for c in candidates])
            top = [c for c in candidates if c.score >= best_score - 1e-12]
        return top[0] if len(top) == 1 else self.rng.choice(top)


PICKERS = {
    "cache_aware": CacheAwarePicker,
    "max_score": MaxScorePicker,
    "near_best": NearBestPicker,
    "random": WeightedRandomPicker,
    "round_robin": RoundRobinPicker,
    "power_of_two": PowerOfTwoPicker,
}
