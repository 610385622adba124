"""The types every scheduling plugin shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Protocol

from controlplane.workers import Role, WorkerView


# A profile's ``dp_rank``: how a data-parallel worker's rank is chosen (controlplane.dp_rank).
DP_RANK_RULES = ("balance", "phase_aligned")


@dataclass(slots=True)
class PlacementContext:
    """What a placement knows about the request it is placing."""

    request_id: str
    model: str
    leg: str                       # "entry", "prefill" or "decode"
    prompt_tokens: int = 0
    max_tokens: int = 0
    exclude: frozenset[str] = frozenset()
    now: float = 0.0
    # Engine metrics older than this are ignored when judging load.
    metrics_max_age_s: float = 5.0
    # Workers that run a leg of this kind (entry: aggregated or prefill).
    roles: frozenset[Role] = frozenset()
    # Prefix cache: blocks in the prompt's hash chain, and per worker how many leading
    # blocks it holds (looked up once per placement, before the plugins run).
    chain_blocks: int = 0
    match_blocks: dict[str, int] = field(default_factory=dict)
    cached_blocks: dict[str, int] = field(default_factory=dict)   # per worker: blocks it holds
    chain: Sequence[int] = ()      # the prompt's block hashes (empty when the policy ignores caches)
    # The match depth that tells no candidate apart (controlplane.scheduling.shared): set by
    # the profile before its scorers run, when it follows the prefix cache.
    common_blocks: int = 0
    # The candidates' minimum match (<= common_blocks), and the candidates below half their
    # recent fair share (RecentShares): for them alone, predicted_latency counts a shared
    # prefix deeper than floor_blocks as held.
    floor_blocks: int = 0
    starved: frozenset[str] = frozenset()
    tree_sizes: Any = None         # or a function returning them, called only if a plugin needs them
    block_size: int = 16
    # Latency prediction (controlplane.prediction): the per-engine models, the request's
    # own targets (0: none given), and per worker what was predicted, for explain.
    predictor: Any = None
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Entry leg of a PD fleet: the decode engine a prefill worker would be paired with, and
    # its predicted (KV pull + first step, TPOT) in seconds (``latency.pair_decode``).
    pair: tuple[float, float] | None = None
    pair_decode: str = ""
    # (candidates considered, routable workers) when the candidate stage sampled; (0, 0) if not.
    sampled: tuple[int, int] = (0, 0)
    matched: bool = False          # match_blocks already filled for the candidates (by the candidate stage)
    # The decision keeps every candidate with its scores (for an explanation: omni-ctl explain,
    # X-Explain); placement clears it when it will not explain, so the built-in cache policies
    # may decide in one pass (scheduling/fused.py).
    keep_scores: bool = True

    def blocks_held(self) -> dict[str, int]:
        """``cached_blocks``, computed on first use when placement left a function for it."""
        if not self.cached_blocks and self.tree_sizes is not None:
            self.cached_blocks = self.tree_sizes()
            self.tree_sizes = None
        return self.cached_blocks

    def uncached_tokens(self, worker_id: str) -> int:
        """Prompt tokens this worker would have to compute (its cached prefix is free)."""
        return max(self.prompt_tokens - self.match_blocks.get(worker_id, 0) * self.block_size, 0)


class Candidate:
    """One worker under consideration, with its combined score and, per scorer, its part
    (for explain). A plain slotted class: one is built per candidate per placement."""

    __slots__ = ("worker", "score", "scores")

    def __init__(self, worker: WorkerView, score: float = 0.0, scores: dict[str, float] | None = None) -> None:
        self.worker = worker
        self.score = score
        self.scores = {} if scores is None else scores

    def __repr__(self) -> str:
        return f"Candidate({self.worker.id!r}, score={self.score:.3f}, scores={self.scores!r})"


@dataclass
class Decision:
    worker: WorkerView | None
    candidates: list[Candidate]
    dropped: dict[str, str]        # worker id -> the filter that removed it
    policy: str
    chain_blocks: int = 0
    match_blocks: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)
    sampled: tuple[int, int] = (0, 0)
    common_blocks: int = 0         # the match depth that told no candidate apart (scheduling.shared)

    def explain(self) -> str:
        parts = [f"policy={self.policy}"]
        if self.common_blocks:
            parts.append(f"common prefix {self.common_blocks}blk (prefers no one)")
        if self.sampled[1]:
            parts.append(f"candidates={self.sampled[0]} sampled of {self.sampled[1]} routable")
        for c in sorted(self.candidates, key=lambda c: -c.score):
            detail = ",".join(f"{k}={v:.3f}" for k, v in c.scores.items())
            mark = "*" if self.worker is not None and c.worker.id == self.worker.id else " "
            cache = (f" match={self.match_blocks.get(c.worker.id, 0)}/{self.chain_blocks}blk"
                     if self.chain_blocks else "")
            pred = self.predicted.get(c.worker.id)
            latency = (f" ttft={pred[0] * 1000:.0f}ms tpot={pred[1] * 1000:.1f}ms" if pred else "")
            parts.append(f"{mark}{c.worker.id} score={c.score:.3f} [{detail}]{cache}{latency} "
                         f"load={c.worker.inflight_requests}req/{c.worker.inflight_tokens}tok"
                         f"/{c.worker.load.prefill_tokens}prefill")
        for wid, why in sorted(self.dropped.items()):
            parts.append(f"-{wid} dropped by {why}")
        return "; ".join(parts)


class Filter(Protocol):
    """Removes workers that must not get this request."""

    name: str

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool: ...


class Scorer(Protocol):
    """Rates every remaining worker in [0, 1]; higher is better."""

    name: str

    def score(self, ctx: PlacementContext, workers: list[WorkerView]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one candidate from the scored list."""

    name: str

    def pick(self, ctx: PlacementContext, candidates: list[Candidate]) -> Candidate: ...
