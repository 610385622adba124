"""The DP-rank chooser: which rank of a data-parallel worker runs a placed request.

A worker started with ``dp_size > 1`` is one endpoint in front of several engine ranks,
each with its own KV cache and batch. The data plane names the rank to the engine, so the
control plane chooses it right after choosing the worker, and charges the rank's own load
(``rank_key``) beside the worker's total so the next choice sees it.

The order of preference, and why:

* the deepest prefix match among the ranks: a rank that holds the prompt computes less.
  As for workers, only the part of a match that tells the ranks apart counts
  (``scheduling.shared.telling_apart``): with a system prompt on every prompt, every new
  conversation went to the rank that held it;
* then the least load in the ledger (requests, then tokens);
* then in turn: a rotating start per worker, so that new prefixes on an idle worker spread
  over its ranks instead of piling on rank 0.

That is the ``balance`` rule. ``phase_aligned`` (a profile's ``dp_rank``, opt-in; seed 003's
PD-hybrid) is for engines whose ranks step together (DP attention before MoE layers: every
step lasts as long as the slowest rank's, ``simulator.dp_barrier``): while any rank prefills,
every rank's decodes wait. So a prompt to compute goes first to the rank where its prefill
ends the group's prefill phase soonest: the phase lasts as long as the largest rank's prefill
work (``Load.prefill_tokens``, charged per rank and settled at the first token), and a prompt
that fits beside the prefill already under way costs the others nothing, while one queued
behind another on the same rank, or started on an idle group, holds every decode again. The
balance rule's order breaks the ties. A decode leg computes nothing: it is balanced.

Its own class (not a method of the placer) so the decision can be read, and tested, alone:
``choose_rank`` is the pure decision; ``RankChooser`` reads the loads and keeps the turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from controlplane.scheduling.base import DP_RANK_RULES
from controlplane.scheduling.shared import SharedPrefixes, telling_apart
from controlplane.workers import Load, WorkerView

MAX_TURNS = 65536   # workers whose turn is remembered; beyond, all turns restart at rank 0


def rank_key(worker_id: str, dp_rank: int) -> str:
    """The ledger key of one DP rank's load (charged beside the worker's own total)."""
    return f"{worker_id}#{dp_rank}"


class RankDepths(Protocol):
    """What the chooser needs of the prefix index (``kvcache.manager.KVCache``)."""

    def rank_depths(self, chain: Sequence[int], worker: WorkerView) -> dict[int, int]: ...


class LoadReader(Protocol):
    """What the chooser needs of the ledger (``state.StateStore``)."""

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]: ...


class RankChoice(NamedTuple):
    rank: int
    why: str        # a short reason, for explanations (omni-ctl explain)


def choose_rank(apart: Sequence[int], loads: Sequence[Load], start: int) -> int:
    """The pure decision: the rank with the deepest differentiating match (``apart``), then
    the fewest requests, then the fewest tokens, then the first at or after ``start``."""
    size = len(loads)
    return min(range(size), key=lambda r: (-apart[r], loads[r].requests, loads[r].tokens, (r - start) % size))


def choose_rank_aligned(new_tokens: Sequence[int], apart: Sequence[int], loads: Sequence[Load], start: int) -> int:
    """``phase_aligned``'s pure decision: the rank where a prompt that still has
    ``new_tokens[r]`` tokens to compute there ends the group's prefill phase soonest (the
    largest rank's prefill work once it is added), then as ``choose_rank``."""
    size = len(loads)
    phase = max(load.prefill_tokens for load in loads)
    return min(range(size), key=lambda r: (max(phase, loads[r].prefill_tokens + new_tokens[r]), -apart[r],
                                           loads[r].requests, loads[r].tokens, (r - start) % size))


class RankChooser:
    """Chooses ranks for one placer; remembers per worker whose turn a full tie is."""

    def __init__(self, store: LoadReader, shared: SharedPrefixes, rule: str = "balance",
                 block_size: int = 16) -> None:
        if rule not in DP_RANK_RULES:
            raise ValueError(f"dp_rank must be one of {', '.join(DP_RANK_RULES)}, got {rule!r}")
        self._store = store
        self._shared = shared
        self.rule = rule
        self._block_size = block_size
        self._turn: dict[str, int] = {}   # per DP worker: the rank that wins the next full tie

    async def choose(self, worker: WorkerView, chain: Sequence[int], kv: RankDepths | None,
                     *, advance: bool = True, prefill_tokens: int = 0) -> RankChoice:
        """The rank of ``worker`` for a prompt with block hashes ``chain`` (empty: the policy
        ignores caches), of which the worker computes ``prefill_tokens`` (0: a decode leg).
        ``advance=False`` (an explanation's dry run) leaves the turn as is."""
        spec = worker.spec
        size = spec.dp_size
        depths = kv.rank_depths(chain, worker) if chain and kv is not None else {}
        keys = [rank_key(spec.id, r) for r in range(size)]
        by_key = await self._store.loads(keys)
        loads = [by_key[k] for k in keys]
        apart = telling_apart(self._shared, chain, [depths.get(r, 0) for r in range(size)]) \
            if depths else [0] * size
        start = self._turn.get(spec.id, 0)
        if self.rule == "phase_aligned" and prefill_tokens > 0:
            bs = self._block_size
            new = [max(1, prefill_tokens - depths.get(r, 0) * bs) for r in range(size)]
            best = choose_rank_aligned(new, apart, loads, start)
        else:
            best = choose_rank(apart, loads, start)
        if advance:
            if len(self._turn) >= MAX_TURNS:
                self._turn.clear()
            self._turn[spec.id] = (best + 1) % size
        load = loads[best]
        why = f"prefix {depths.get(best, 0)} blocks, {load.requests} requests, {load.tokens} tokens"
        if self.rule == "phase_aligned":
            why += f", {load.prefill_tokens} prefill tokens"
        return RankChoice(best, why)
