"""Global prefix index: which workers hold which vLLM blocks, and how deep a prompt matches on each.

Why this layout: placement asks, per request, "for this prompt's block-hash chain, how many leading
blocks does each worker already have?". The hot path is therefore one dict probe per block:

    holders: hash(64-bit event form) -> bitmask of worker slots

Lookup walks the chain with a running mask of still-matching workers, ANDs each block's holders
into it, records the depth of every worker that drops out, and stops as soon as the mask is empty
(a worker's match stops at its first missing block). A 1,000-block chain over 16 workers costs
about 1,000 dict probes and integer ANDs (see bench/kvindex_lookup.py for numbers).

Each worker slot is one (worker_id, dp_rank): DP ranks have separate KV caches and publish
separately. Per-slot hash sets make AllBlocksCleared / drop_worker proportional to that worker's
blocks, not to the whole index. Parent links (from BlockStored) are kept so a block's chain can be
walked back (debugging, future tree-aware scoring); lookup itself does not need them because the
chain hash already commits to the whole prefix.

Bounding memory: the engines evict on their own and say so with BlockRemoved, so the cap is a
safety net for lost removals (seq gaps without replay, engines that vanish). Eviction is LRU over
blocks. Within one BlockStored run the deepest block is made the *least* recent and the parent the
most recent, so eviction takes leaves before their ancestors and the index stays prefix-closed as
far as possible (an orphaned child could never be matched anyway). Lookups are read-only by
default so they stay cheap; pass ``touch=True`` (or call :meth:`touch`) to refresh a matched
prefix, since vLLM does not re-announce blocks it reuses from its prefix cache.

``group_idx`` (hybrid models' KV cache groups) and ``medium`` are not distinguished: a hash held
in any group/medium counts as held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

WorkerKey = tuple[str, int]   # (worker_id, dp_rank)


@dataclass(frozen=True)
class PrefixIndexConfig:
    max_blocks: int = 2_000_000   # distinct block hashes kept; beyond that LRU eviction


@dataclass(frozen=True)
class PrefixIndexStats:
    blocks: int            # distinct block hashes
    block_refs: int        # (block, worker) pairs
    workers: int           # registered (worker_id, dp_rank) slots
    stored: int            # block announcements applied
    removed: int           # (block, worker) pairs removed by BlockRemoved
    cleared: int           # AllBlocksCleared / reset / drop applied
    evicted: int           # blocks dropped by the max_blocks cap


class PrefixIndex:
    """Not thread-safe: owned by one asyncio loop (the subscriber's handlers and placement)."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        if self.config.max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self._holders: OrderedDict[int, int] = OrderedDict()   # LRU order: oldest first
        self._parent: dict[int, int | None] = {}
        self._slot_of: dict[WorkerKey, int] = {}
        self._key_of: list[WorkerKey | None] = []
        self._blocks_of: list[set[int]] = []
        self._free: list[int] = []
        self._all = 0                                        # mask of registered slots
        self._refs = 0
        self._stored = self._removed = self._cleared = self._evicted = 0

    # ---- workers -------------------------------------------------------------------------------

    def _slot(self, key: WorkerKey) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._key_of[slot] = key
            else:
                slot = len(self._key_of)
                self._key_of.append(key)
                self._blocks_of.append(set())
            self._slot_of[key] = slot
            self._all |= 1 << slot
        return slot

    def workers(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def blocks_by_worker(self) -> dict[str, int]:
        """Blocks held per worker id, summed over its DP ranks, in one pass over the slots."""
        out: dict[str, int] = {}
        for (worker_id, _rank), slot in self._slot_of.items():
            out[worker_id] = out.get(worker_id, 0) + len(self._blocks_of[slot])
        return out

    def drop_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        """Forget a worker (every DP rank when ``dp_rank`` is None) and free its slot(s)."""
        keys = [k for k in self._slot_of if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)]
        for key in keys:
            slot = self._slot_of.pop(key)
            self._clear_slot(slot)
            self._key_of[slot] = None
            self._all &= ~(1 << slot)
            self._free.append(slot)

    def reset_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        """Drop what a worker holds but keep it registered (seq gap / engine restart)."""
        for key, slot in self._slot_of.items():
            if key[0] == worker_id and (dp_rank is None or key[1] == dp_rank):
                self._clear_slot(slot)

    # ---- events --------------------------------------------------------------------------------

    def apply(self, worker_id: str, dp_rank: int | None, events: Iterable[KVEvent]) -> None:
        """Apply one decoded batch from ``worker_id`` (dp_rank None is taken as rank 0)."""
        key = (worker_id, dp_rank or 0)
        for ev in events:
            if type(ev) is BlockStored:
                self.store(key, ev.block_hashes, ev.parent_block_hash)
            elif type(ev) is BlockRemoved:
                self.remove(key, ev.block_hashes)
            elif type(ev) is AllBlocksCleared:
                self._clear_slot(self._slot(key))

    def store(self, key: WorkerKey, hashes: Sequence[int], parent: int | None) -> None:
        """Blocks ``hashes`` (a chain continuing ``parent``) are now cached on ``key``."""
        if not hashes:
            return
        slot = self._slot(key)
        bit = 1 << slot
        holders, parents, mine = self._holders, self._parent, self._blocks_of[slot]
        prev = parent
        for h in hashes:
            parents[h] = prev
            prev = h
        for h in reversed(hashes):          # deepest first = least recent (see module docstring)
            m = holders.get(h)
            if m is None:
                holders[h] = bit
                self._refs += 1
            else:
                if not m & bit:
                    holders[h] = m | bit
                    self._refs += 1
                holders.move_to_end(h)
            mine.add(h)
        if parent is not None and parent in holders:
            holders.move_to_end(parent)
        self._stored += len(hashes)
        if len(holders) > self.config.max_blocks:
            self._evict(len(holders) - self.config.max_blocks)

    def remove(self, key: WorkerKey, hashes: Iterable[int]) -> None:
        slot = self._slot_of.get(key)
        if slot is None:
            return
        mine = self._blocks_of[slot]
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._unhold(h, 1 << slot)
                self._removed += 1

    def _unhold(self, h: int, bit: int) -> None:
        m = self._holders[h] & ~bit
        self._refs -= 1
        if m:
            self._holders[h] = m
        else:
            del self._holders[h]
            self._parent.pop(h, None)

    def _clear_slot(self, slot: int) -> None:
        bit = 1 << slot
        for h in self._blocks_of[slot]:
            self._unhold(h, bit)
        self._blocks_of[slot] = set()
        self._cleared += 1

    def _evict(self, n: int) -> None:
        holders, blocks_of = self._holders, self._blocks_of
        for _ in range(n):
            h, m = holders.popitem(last=False)
            self._parent.pop(h, None)
            while m:
                low = m & -m
                blocks_of[low.bit_length() - 1].discard(h)
                self._refs -= 1
                m ^= low
            self._evicted += 1

    # ---- queries -------------------------------------------------------------------------------

    def match_depths(self, chain: Sequence[int], workers: Iterable[WorkerKey] | None = None, *,
                     touch: bool = False) -> dict[WorkerKey, int]:
        """Per worker, the number of leading blocks of ``chain`` it holds; workers at 0 are omitted.

        ``chain`` is the prompt's event-form hash chain (BlockHasher.event_hashes). ``workers``
        restricts the answer to those candidates (unknown ones are ignored).
        """
        if workers is None:
            alive = self._all
        else:
            alive = 0
            for k in workers:
                s = self._slot_of.get(k)
                if s is not None:
                    alive |= 1 << s
        out: dict[WorkerKey, int] = {}
        if not alive or not chain:
            return out
        get = self._holders.get
        key_of = self._key_of
        depth = 0
        for h in chain:
            m = get(h, 0) & alive
            if m != alive:
                if depth:
                    lost = alive & ~m
                    while lost:
                        low = lost & -lost
                        out[key_of[low.bit_length() - 1]] = depth
                        lost ^= low
                alive = m
                if not alive:
                    break
            depth += 1
        while alive:
            low = alive & -alive
            out[key_of[low.bit_length() - 1]] = depth
            alive ^= low
        if touch and out:
            self.touch(chain[:max(out.values())])
        return out

    def touch(self, chain: Sequence[int]) -> None:
        """Mark a matched prefix recently used (deepest least recent, root most recent)."""
        holders = self._holders
        for h in reversed(chain):
            if h in holders:
                holders.move_to_end(h)

    def parent_of(self, h: int) -> int | None:
        return self._parent.get(h)

    def holders_of(self, h: int) -> list[WorkerKey]:
        m = self._holders.get(h, 0)
        out = []
        while m:
            low = m & -m
            out.append(self._key_of[low.bit_length() - 1])
            m ^= low
        return out

    def size(self) -> int:
        return len(self._holders)

    def stats(self) -> PrefixIndexStats:
        return PrefixIndexStats(blocks=len(self._holders), block_refs=self._refs, workers=len(self._slot_of),
                                stored=self._stored, removed=self._removed, cleared=self._cleared,
                                evicted=self._evicted)


def best_per_worker(depths: dict[WorkerKey, int]) -> dict[str, int]:
    """Collapse DP ranks: a worker's depth is its best rank's (when the engine routes by prefix)."""
    out: dict[str, int] = {}
    for (wid, _), d in depths.items():
        if d > out.get(wid, 0):
            out[wid] = d
    return out
