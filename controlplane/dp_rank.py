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

Its own class (not a method of the placer) so the decision can be read, and tested, alone:
``choose_rank`` is the pure decision; ``RankChooser`` reads the loads and keeps the turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

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


class RankChooser:
    """Chooses ranks for one placer; remembers per worker whose turn a full tie is."""

    def __init__(self, store: LoadReader, shared: SharedPrefixes) -> None:
        self._store = store
        self._shared = shared
        self._turn: dict[str, int] = {}   # per DP worker: the rank that wins the next full tie

    async def choose(self, worker: WorkerView, chain: Sequence[int], kv: RankDepths | None,
                     *, advance: bool = True) -> RankChoice:
        """The rank of ``worker`` for a prompt with block hashes ``chain`` (empty: the policy
        ignores caches). ``advance=False`` (an explanation's dry run) leaves the turn as is."""
        spec = worker.spec
        size = spec.dp_size
        depths = kv.rank_depths(chain, worker) if chain and kv is not None else {}
        keys = [rank_key(spec.id, r) for r in range(size)]
        by_key = await self._store.loads(keys)
        loads = [by_key[k] for k in keys]
        apart = telling_apart(self._shared, chain, [depths.get(r, 0) for r in range(size)]) \
            if depths else [0] * size
        best = choose_rank(apart, loads, self._turn.get(spec.id, 0))
        if advance:
            if len(self._turn) >= MAX_TURNS:
                self._turn.clear()
            self._turn[spec.id] = (best + 1) % size
        load = loads[best]
        return RankChoice(best, f"prefix {depths.get(best, 0)} blocks, {load.requests} requests, {load.tokens} tokens")
