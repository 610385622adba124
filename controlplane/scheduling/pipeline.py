"""A placement profile: base filters, then configured filters, scorers and a picker.

Policies are named profiles. Operators choose one by name, or define their own in the
config file from the plugin names in FILTERS, SCORERS and PICKERS.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.scheduling import fused
from controlplane.scheduling.base import DP_RANK_RULES, Candidate, Decision, Filter, PlacementContext, Picker, Scorer
from controlplane.scheduling.candidates import CANDIDATE_STAGES, SampleStage
from controlplane.scheduling.filters import BASE_FILTERS, FILTERS, ExcludeFilter
from controlplane.scheduling.pickers import PICKERS
from controlplane.scheduling.queue import QUEUES, HoldQueue
from controlplane.scheduling.scorers import SCORERS
from controlplane.scheduling.shared import RecentShares, SharedPrefixes
from controlplane.workers import WorkerView

EXCLUDE = ExcludeFilter()


@dataclass
class Profile:
    name: str
    picker: Picker
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    filters: list[Filter] = field(default_factory=list)
    queue: HoldQueue | None = None      # the queue stage (late binding); None: place at once
    # The candidate stage: bounds the candidates when many workers are routable; None: all of them.
    candidates: SampleStage | None = None
    # The prefixes different prompts continued differently (learned from the placements):
    # with the candidates' common match, what does not tell them apart (see shared.py).
    shared: SharedPrefixes = field(default_factory=SharedPrefixes)
    # Who received the recent placements: the candidates starved of them (see RecentShares).
    shares: RecentShares = field(default_factory=RecentShares)
    # How a data-parallel worker's rank is chosen (controlplane.dp_rank): "balance", or
    # "phase_aligned" for engines whose ranks step together (DP attention before MoE layers).
    dp_rank: str = "balance"

    def __post_init__(self) -> None:
        if self.candidates is not None:
            self.candidates.bind(self)

    @property
    def uses_prefix_cache(self) -> bool:
        """Only then does a placement look the prompt up in the prefix index."""
        return any(getattr(s, "uses_prefix_cache", False) for s, _ in self.scorers) or \
            getattr(self.picker, "uses_prefix_cache", False)

    @property
    def uses_predictions(self) -> bool:
        """Only then are the per-engine latency models consulted."""
        return any(getattr(p, "uses_predictions", False) for p in (*self.filters, *(s for s, _ in self.scorers))) \
            or self.queue is not None

    @property
    def uses_tree_sizes(self) -> bool:
        """Only then does a placement ask the prefix index how much each worker holds."""
        return getattr(self.picker, "uses_tree_sizes", False)

    def place(self, ctx: PlacementContext, workers: list[WorkerView]) -> Decision:
        """Choose among ``workers``: the candidates the routable index gave for this leg.

        The correctness filters that the index already applied (model, role, health,
        drain, weight) are not run again here; ``dropped_from`` explains them on demand.
        """
        dropped: dict[str, str] = {}
        remaining = self._apply(EXCLUDE, ctx, workers, dropped) if ctx.exclude else workers
        for flt in self.filters:
            active = getattr(flt, "active", None)
            if active is not None and not active(ctx):
                continue                  # it would keep everyone (e.g. no SLO on this request)
            kept = [w for w in remaining if flt.keep(ctx, w)]
            if not kept and getattr(flt, "soft", False):
                continue  # a soft filter never empties the list on its own
            if len(kept) != len(remaining):
                kept_ids = {w.id for w in kept}
                for w in remaining:
                    if w.id not in kept_ids:
                        dropped[w.id] = flt.name
            remaining = kept
        if not remaining:
            return Decision(worker=None, candidates=[], dropped=dropped, policy=self.name,
                            chain_blocks=ctx.chain_blocks, match_blocks=ctx.match_blocks, sampled=ctx.sampled)
        decode = ctx.leg == "decode"
        depths: list[int] | None = None
        if ctx.chain and ctx.chain_blocks:
            get = ctx.match_blocks.get
            depths = [get(w.spec.id, 0) for w in remaining]
            ctx.common_blocks = self.shared.common_depth(ctx.chain, depths)
            ctx.floor_blocks = min(depths)
            # (only the latency models read who is starved: cache_aware and apc_first skip it)
            if ctx.common_blocks > ctx.floor_blocks and self.uses_predictions:
                ctx.starved = self.shares.starved(decode, [w.spec.id for w in remaining],
                                                  [w.spec.weight for w in remaining],
                                                  [w.load.prefill_tokens for w in remaining])
        if not ctx.keep_scores and fused.applies(self.scorers, self.picker):
            # The built-in cache policies' plugins, computed over plain lists (scheduling/fused.py)
            worker = fused.decide(ctx, remaining, depths, self.scorers, self.picker)
            self.shares.record(decode, worker.spec.id, len(remaining))
            return Decision(worker=worker, candidates=[], dropped=dropped, policy=self.name,
                            chain_blocks=ctx.chain_blocks, match_blocks=ctx.match_blocks, predicted=ctx.predicted,
                            sampled=ctx.sampled, common_blocks=ctx.common_blocks)
        candidates = [Candidate(w) for w in remaining]
        for scorer, weight in self.scorers:
            name = scorer.name
            for cand, value in zip(candidates, scorer.score(ctx, remaining), strict=False):
                cand.scores[name] = value
                cand.score += weight * value
        chosen = self.picker.pick(ctx, candidates)
        self.shares.record(decode, chosen.worker.spec.id, len(remaining))
        return Decision(worker=chosen.worker, candidates=candidates, dropped=dropped, policy=self.name,
                        chain_blocks=ctx.chain_blocks, match_blocks=ctx.match_blocks, predicted=ctx.predicted,
                        sampled=ctx.sampled, common_blocks=ctx.common_blocks)

    @staticmethod
    def dropped_from(ctx: PlacementContext, workers: list[WorkerView], dropped: dict[str, str]) -> dict[str, str]:
        """Why each of ``workers`` was not a candidate (explain and refusals: O(fleet))."""
        for w in workers:
            if w.id in dropped:
                continue
            for flt in BASE_FILTERS:
                if not flt.keep(ctx, w):
                    dropped[w.id] = flt.name
                    break
        return dropped

    @staticmethod
    def _apply(flt: Filter, ctx: PlacementContext, workers: list[WorkerView],
               dropped: dict[str, str]) -> list[WorkerView]:
        kept = []
        for w in workers:
            if flt.keep(ctx, w):
                kept.append(w)
            elif w.id not in dropped:
                dropped[w.id] = flt.name
        return kept


# Built-in policies, as plugin specs (the same form a config file uses).
POLICIES: dict[str, dict[str, Any]] = {
    "round_robin": {"picker": "round_robin"},
    "random": {"picker": "random"},
    "power_of_two": {"scorers": [{"name": "least_load"}], "picker": "power_of_two"},
    "least_load": {"scorers": [{"name": "least_load"}], "picker": "max_score"},
    # SGLang-style: most cached prefix, unless loads are too far apart (then least load).
    "cache_aware": {"scorers": [{"name": "prefix_cache", "weight": 1.0}, {"name": "least_load", "weight": 1e-3}],
                    "picker": "cache_aware"},
    # Omni's APC-first: deepest match among workers within their token/sequence budgets,
    # ties to the lower load.
    "apc_first": {"filters": [{"name": "overload"}],
                  "scorers": [{"name": "prefix_cache", "weight": 1.0}, {"name": "least_load", "weight": 1e-6}],
                  "picker": "max_score"},
    # Omni scheduling: predicted TTFT (queue + uncached prefill, learned per engine) and
    # TPOT, against the request's SLO headers if it names them (the scorer's targets, and the
    # picker's preference among near-equal engines: no ``slo`` filter, see SLOFilter); with
    # late binding in the control plane's queue (Omni's request holding, HoldQueue), gated on
    # the request's own budget: held only while its best engine has more than a quarter of the
    # request's TTFT target of work ahead (``hold_frac``), bound at once below; and bound at
    # once too when its chosen engine is predicted to give its first token within half its
    # target (``bind_on_target``). Below overload, binding at once is what wins; holding at
    # 0.15 s alone lost 4-5 points with 2 prefill + 2 decode engines at 3x. On the workload
    # suite's nine cases at their rates it is 4-16 points ahead at overload on most shapes
    # (docs/benchmarks/pd_queue.md, seventh session), level within noise elsewhere. Without
    # ``bind_on_target`` it held chats beside batch summaries that would have made their TTFT
    # (mixed at 4x: 64.1 % against 86.5 % with it, 6 pairs; docs/benchmarks/workloads_notes.md).
    # Held requests that can no longer meet their TTFT target go after every other
    # (``late_last``): past the prefill engines' capacity in PD, 4-6 points on top of
    # ``bind_on_target`` (docs/benchmarks/workloads_notes.md, "PD at the 80 % rate").
    "predicted_latency": {"scorers": [{"name": "predicted_latency"}], "picker": "near_best",
                          "queue": {"name": "omni", "hold_frac": 0.25, "bind_on_target": 0.5, "late_last": True}},
    # The same, every request bound to an engine on arrival (the default before the queue stage).
    "predicted_latency_unqueued": {"scorers": [{"name": "predicted_latency"}], "picker": "near_best"},
    # The name the queued policy had while it was opt-in (old configs keep working): the default.
    "predicted_latency_queued": {"scorers": [{"name": "predicted_latency"}], "picker": "near_best",
                                 "queue": {"name": "omni", "hold_frac": 0.25, "bind_on_target": 0.5,
                                           "late_last": True}},
}


def _make(registry: Mapping[str, type], spec: str | dict[str, Any], kind: str):
    if isinstance(spec, str):
        spec = {"name": spec}
    spec = dict(spec)
    name = spec.pop("name", None)
    spec.pop("weight", None)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    try:
        return registry[name](**spec)
    except TypeError as exc:
        raise ValueError(f"bad options for {kind} {name!r}: {exc}") from None


def build_profile(name: str, custom: dict[str, dict[str, Any]] | None = None) -> Profile:
    """Build the policy ``name`` from the built-ins or the config's custom profiles."""
    spec = (custom or {}).get(name) or POLICIES.get(name)
    if spec is None:
        known = sorted({*POLICIES, *(custom or {})})
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(known)}")
    scorers = []
    for s in spec.get("scorers", []):
        weight = float(s.get("weight", 1.0)) if isinstance(s, dict) else 1.0
        scorers.append((_make(SCORERS, s, "scorer"), weight))
    queue = spec.get("queue")
    shared = spec.get("shared") or {}
    if not isinstance(shared, dict):
        raise ValueError(f"shared must be a table of SharedPrefixes options, got {shared!r}")
    try:
        prefixes = SharedPrefixes(**shared)
    except TypeError as exc:
        raise ValueError(f"bad options for shared: {exc}") from None
    dp_rank = spec.get("dp_rank", "balance")
    if dp_rank not in DP_RANK_RULES:
        raise ValueError(f"dp_rank must be one of {', '.join(DP_RANK_RULES)}, got {dp_rank!r}")
    # Bounded candidates unless the profile says "all" (see controlplane.scheduling.candidates).
    stage = spec.get("candidates", "sample")
    return Profile(
        name=name,
        picker=_make(PICKERS, spec.get("picker", "max_score"), "picker"),
        scorers=scorers,
        filters=[_make(FILTERS, f, "filter") for f in spec.get("filters", [])],
        queue=_make(QUEUES, queue, "queue") if queue else None,
        candidates=None if stage in ("all", None, "") else _make(CANDIDATE_STAGES, stage, "candidate stage"),
        shared=prefixes,
        dp_rank=dp_rank,
    )
