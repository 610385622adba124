"""Global prefix index: which workers hold which vLLM blocks, and how deep a prompt matches on each.

Why this layout: placement asks, per request, "for this prompt's block-hash chain, how many leading
blocks does each worker already have?". The hot path is therefore one dict probe per block:

    holders: hash(64-bit event form) -> bitmask of worker slots

Lookup walks the chain with a running mask of still-matching workers, ANDs each block's holders
into it, records the depth of every worker that drops out, and stops as soon as the mask is empty
(a worker's match stops at its first missing block). A 1,000-block chain over 16 workers costs
about 1,000 dict probes and integer ANDs (see bench/kvindex_lookup.py for numbers). The same walk
over a whole fleet's mask tells which workers hold the *deepest* match without naming the others
(:meth:`PrefixIndex.deepest`), so placement at 1,000 workers can consider the few that matter.

Each worker slot is one (worker_id, dp_rank): DP ranks have separate KV caches and publish
separately. What each slot holds is kept as an append-only ``array('Q')`` of hashes (8 bytes an
entry, compacted when stale entries outnumber live ones) so AllBlocksCleared / drop_worker stay
proportional to that worker's blocks, not to the whole index; whether an entry is live is always
read from ``holders``. This, plain dicts in LRU order instead of an OrderedDict, and parent
links only on request (``keep_parents``; lookup never needs them because the chain hash already
commits to the whole prefix) keep an entry near 100 bytes (bench/placement.py measures it).

Growing without stalls: ``holders`` is not one dict but 2**k shards picked by a hash's low bits
(256 at the default cap of 2,000,000 blocks, about 8,000 blocks a shard at the cap; one below
8,192). CPython rebuilds a dict whole when it grows, and when it has churned (a delete leaves a
slot that only a rebuild reclaims, and an LRU refresh is a delete plus an insert): one dict of
1-2 million blocks held the event loop, and every placement behind it, 30-120 ms of CPU per
rebuild on this project's 2-core machine; a shard's rebuild is 1/256 of that
(bench/kvindex_growth.py, docs/benchmarks/kv_events_load.md). Picking a
shard per block costs about as much as the probe itself, so the walk lets its first probe decide
whether to go on at all, remembers the picks of the 128-block pieces it walked as guesses that
need no check but where a probe misses (a wrong shard can only miss: see _walk), probes in C
(``map(dict.get, picks, chain)``) and counts runs of blocks with equal holders in C
(itertools.groupby) so its Python loop turns once per change of holders, not once per block.

Bounding memory: the engines evict on their own and say so with BlockRemoved, so the cap is a
safety net for lost removals (seq gaps without replay, engines that vanish). Each shard keeps at
most 1/2**k of the cap (so the index at most the cap) and evicts LRU over its own blocks: its
insertion order, refreshed by re-inserting. Hashes spread evenly over the shards, so per shard is
close to LRU over the index, and an eviction step touches one shard, never the whole index.
Within one BlockStored run the deepest block is made the *least* recent and the parent the most
recent, so eviction takes leaves before their ancestors and the index stays prefix-closed as far
as possible (an orphaned child could never be matched anyway). Large caps evict in batches of
1/256 of a shard's cap, so the scan for the oldest entries is paid once per batch. Lookups are
read-only by default so they stay cheap;
pass ``touch=True`` (or call :meth:`touch`) to refresh a matched prefix, since vLLM does not
re-announce blocks it reuses from its prefix cache. A touch sets a referenced bit (a clock, or
second chance), read only when eviction reaches the block: a referenced block is then moved to
the newest end with its bit cleared instead of evicted. Moving every touched block to the newest
end at once (an LRU refresh) cost a shard pick, a delete and an insert per block on every
placement; the bits cost one set update in C, and eviction, which is rare, pays the moves.

Masks at fleet scale: at 1,000 slots a mask is a 1,000-bit integer, and each operation on one
(OR, AND, negation, hashing it to intern it) costs 0.1-0.4 us on this project's machine, as much
as a probe. So placement's steps count them: a mask's slots are taken highest first, each
cleared with one XOR from a per-slot table of bits (not ``m & -m`` and ``m ^ low``), a few
candidates' depths are read from narrow levels slot by slot (:meth:`PrefixIndex.depths_among`),
and a routed slot keeps its interned ``bit | stamp`` for its bucket.

``group_idx`` (hybrid models' KV cache groups) and ``medium`` are not distinguished: a hash held
in any group/medium counts as held.
"""

from __future__ import annotations

import random
import sys
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Iterator, KeysView, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import groupby, islice, repeat
from operator import countOf, itemgetter, or_
from typing import cast

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

WorkerKey = tuple[str, int]   # (worker_id, dp_rank)
_STAMP_BITS = 32            # a routed value's low bits: its stamp, and the ends flag above it
_ENDS = 1 << 31             # routed: a chain through this mark ends within the next stride - 1 blocks
_STAMP = _ENDS - 1          # routed: the bucket of the last routing through this mark
_INTERN_MAX = 1 << 16      # distinct masks remembered for sharing; beyond, the table starts over
_SHARD_BITS_MAX = 8        # at most 256 shards: a shard is picked by a hash's low byte
_SHARD_TARGET = 12         # auto: about 4,096-8,192 blocks a shard at max_blocks
_HEAD = 128                # blocks of a chain whose shards a walk picks before it knows it goes further
_KNOWN_MAX = 1 << 20       # shard picks a walk remembers (8 bytes each, 8 MiB); beyond, it starts over
_REF_MAX = 1 << 17         # referenced bits (touch) kept; beyond, they start over with the touched ends
_LOW = 0 if sys.byteorder == "little" else 7    # where a uint64's low byte sits in its bytes


@dataclass(frozen=True)
class PrefixIndexConfig:
    max_blocks: int = 2_000_000   # distinct block hashes kept; beyond that LRU eviction
    keep_parents: bool = True     # parent links for walking a chain back (about 50 bytes a block)
    shards: int = 0               # dicts the blocks are spread over (a power of two up to 256); 0: by max_blocks
    gallop: bool = True           # walk by galloping over workers without holes (see PrefixIndex._gallop)

    def shard_bits(self) -> int:
        """log2 of the shard count: ``shards`` if set, else enough shards that each holds at most
        about 8,192 blocks at ``max_blocks`` (one below 8,192, at most 256)."""
        if self.shards:
            return self.shards.bit_length() - 1
        return min(_SHARD_BITS_MAX, max(0, (self.max_blocks >> _SHARD_TARGET).bit_length() - 1))


@dataclass(frozen=True)
class PrefixIndexStats:
    blocks: int            # distinct block hashes
    block_refs: int        # (block, worker) pairs
    workers: int           # registered (worker_id, dp_rank) slots
    stored: int            # block announcements applied
    removed: int           # (block, worker) pairs removed by BlockRemoved
    cleared: int           # AllBlocksCleared / reset / drop applied
    evicted: int           # blocks dropped by the max_blocks cap


class SlotBlocks:
    """The blocks one slot holds: hashes appended when the slot gains them, ``live`` counted.

    Entries whose bit was since cleared in ``holders`` are stale and skipped; a block stored
    again after a removal may appear twice. ``in``, ``len`` and iteration answer for live ones.

    Stale entries are dropped once they outnumber live ones (``compact``), a step of
    ``COMPACT_STEP`` entries per call, in place: ``hashes[:_w]`` is what was kept so far,
    ``hashes[_w:_r]`` a gap of entries already looked at (never read), ``hashes[_r:_stop]`` what is
    left to look at and ``hashes[_stop:]`` what was appended meanwhile. Why in steps: a busy
    worker's slot holds tens of thousands of entries (a real engine's cache, hundreds of
    thousands), and compacting it in one go held the event loop, and every placement behind it,
    ~2.3 ms per 16,000 entries on this project's 2-core machine. The hashes kept so far are
    remembered (to drop repeats) in 256 sets by low byte, freed a few sets per later call: one
    set of every live hash was resized whole as it grew and freed whole at the end (1.6 ms for
    64,000 hashes here, 25 ms at a million), the same stall as the index's one dict.
    """

    __slots__ = ("_index", "_r", "_seen", "_stop", "_trash", "_w", "bit", "current", "hashes", "extra", "live")

    COMPACT_STEP = 1024     # entries looked at per compact() call (~0.15 ms here)
    FREE_STEP = 8           # sets of a finished compaction freed per compact() call

    def __init__(self, index: PrefixIndex, bit: int) -> None:
        self._index = index
        self.bit = bit << index._shift
        self.current: tuple[int, int] | None = None   # routed: (stamp, interned bit | stamp) last marked
        self.hashes = array("Q")
        self.extra: set[int] | None = None     # hashes that do not fit 64 unsigned bits
        self.live = 0
        self._seen: list[set[int]] | None = None   # while compacting: the hashes kept so far, by low byte
        self._trash: list[set[int]] = []            # a finished compaction's sets, still to free
        self._w = self._r = self._stop = 0

    def add(self, h: int) -> None:
        try:
            self.hashes.append(h)
        except OverflowError:
            if self.extra is None:
                self.extra = set()
            self.extra.add(h)

    def extend(self, hs: list[int]) -> None:
        try:
            self.hashes.extend(hs)
        except OverflowError:       # array.extend stops at the bad one: redo one by one
            done = set(self.hashes[len(self.hashes) - len(hs):]) if hs else set()
            for h in hs:
                if h not in done:
                    self.add(h)

    def raw(self) -> Iterator[int]:
        if self._seen is None:
            yield from self.hashes
        else:                       # compacting: skip the gap
            yield from self.hashes[:self._w]
            yield from self.hashes[self._r:]
        if self.extra:
            yield from list(self.extra)

    def __contains__(self, h: int) -> bool:
        return bool(self._index._held(h) & self.bit)

    def __len__(self) -> int:
        return self.live

    def __iter__(self) -> Iterator[int]:
        get, bit, seen = self._index._held, self.bit, set()
        for h in self.raw():
            if get(h) & bit and h not in seen:
                seen.add(h)
                yield h

    def due(self) -> bool:
        """Whether ``compact()`` has work: a compaction under way or its sets to free, or stale
        entries outnumber live ones (amortised over the appends)."""
        return self._seen is not None or bool(self._trash) or len(self.hashes) > 2 * self.live + 64

    def compact(self) -> None:
        """One step of dropping stale (and repeated) entries, if due; order is kept."""
        if self._trash:
            del self._trash[-self.FREE_STEP:]
        seen = self._seen
        if seen is None:
            if len(self.hashes) <= 2 * self.live + 64:
                return
            seen = self._seen = [set() for _ in range(256)]
            self._w = self._r = 0
            self._stop = len(self.hashes)
        hashes, w, r = self.hashes, self._w, self._r
        end = min(r + self.COMPACT_STEP, self._stop)
        # Comprehensions, one bulk probe (the array's own bytes pick the shards: no conversion)
        # and dict.fromkeys (first of repeats kept) rather than a loop over self.
        bit, index = self.bit, self._index
        chunk = hashes[r:end]
        todo = chunk.tolist()
        low = chunk.tobytes()[_LOW::8]
        kept = [h for h, v, b in zip(todo, index._values_low(todo, low), low, strict=True)
                if v and v & bit and h not in seen[b]]
        if len(kept) > 1:
            kept = list(dict.fromkeys(kept))
        if kept:
            arr = array("Q", kept)
            if len(kept) > 1:       # each into its set, in C: the sets picked by the low bytes
                deque(map(set.add, itemgetter(*arr.tobytes()[_LOW::8])(seen), kept), maxlen=0)
            else:
                seen[kept[0] & 255].add(kept[0])
            hashes[w:w + len(kept)] = arr
            w += len(kept)
        if end < self._stop:
            self._w, self._r = w, end
            return
        del hashes[w:end]            # the gap; what was appended meanwhile moves down
        self._trash += seen
        self._seen = None
        self._w = self._r = self._stop = 0
        extra = self.extra
        if extra:
            live = [h for h in extra if index._held(h) & bit]
            self.extra = set(live) or None


class PrefixIndex:
    """Not thread-safe: owned by one asyncio loop (the subscriber's handlers and placement)."""

    _shift = 0    # RoutedIndex keeps a routing stamp in the low bits of every value

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        if self.config.max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        bits = self.config.shard_bits()
        if self.config.shards and (self.config.shards != 1 << bits or bits > _SHARD_BITS_MAX):
            raise ValueError("shards must be 0 or a power of two up to 256")
        if self.config.max_blocks < 1 << bits:
            raise ValueError("max_blocks must be at least the number of shards")
        # Block hash -> holders, spread by the hash's low bits over 2**bits dicts, each in
        # insertion order = its LRU, oldest first (see the module docstring: why shards).
        self._mask = (1 << bits) - 1
        self._shards: list[dict[int, int]] = [{} for _ in range(1 << bits)]
        self._cap = self.config.max_blocks >> bits           # blocks a shard keeps before evicting
        self._table = bytes(b & self._mask for b in range(256)) if 0 < bits < _SHARD_BITS_MAX else None
        self._size = 0                                       # blocks over all shards
        # block hash -> the shards of the chain piece a walk picked from it: a guess (see _walk)
        self._known: dict[int, Sequence[dict[int, int]]] = {}
        self._known_picks = 0
        self._parent: list[dict[int, int | None]] | None = \
            [{} for _ in range(1 << bits)] if self.config.keep_parents else None
        self._slot_of: dict[WorkerKey, int] = {}
        self._key_of: list[WorkerKey | None] = []
        self._blocks_of: list[SlotBlocks] = []
        self._by_worker: dict[str, list[int]] = {}           # worker id -> its slots (DP ranks)
        self._bits_of: dict[str, int] = {}                   # worker id -> the mask of its slots
        self._one: list[int] = []                            # slot -> 1 << slot (see depths_among)
        self._free: list[int] = []
        self._all = 0                                        # mask of registered slots
        # Slots that may hold a block without its parent (a hole: see _gallop). A slot starts
        # without; a removal or an eviction of one of its blocks, or a stored run whose parent
        # it does not hold, gives it one until it is cleared.
        self._holey = 0
        self._gallops = self.config.gallop and not self._shift
        self._refs = 0
        self._stored = self._removed = self._cleared = self._evicted = 0
        # LRU clock: blocks stored or touched so far; per deepest block of a touched prefix, the
        # clock at its last touch (see touch()).
        self._clock = 0
        self._touched: dict[int, int] = {}
        # Referenced bits: blocks touched since eviction last reached them (see _evict). One set
        # for every shard: a touch adds a prefix in one C call, with no shard picks.
        self._ref: set[int] = set()
        # Equal holder masks share one int object: less memory per entry, and a chain walk
        # skips the AND for a block whose holders are the very object of the block before.
        self._intern: dict[int, int] = {}
        # Masks cached by callers stay valid while ``generation`` holds (it moves when a slot is
        # freed) if they add the slots created since: ``added[pos:]`` lists them as (slot, worker id).
        self.generation = 0
        self.added: list[tuple[int, str]] = []

    # ---- shards --------------------------------------------------------------------------------

    def _get(self, h: int) -> int | None:
        """The holders of block ``h`` (one probe, for callers that probe a few blocks)."""
        return self._shards[h & self._mask].get(h)

    def _held(self, h: int) -> int:
        """As :meth:`_get`, 0 where ``h`` is not indexed."""
        return self._shards[h & self._mask].get(h, 0)

    def _shards_of(self, hs: Sequence[int]) -> Sequence[dict[int, int]]:
        """The shard of each of ``hs``, picked in C where they fit 64 unsigned bits: their low
        bytes in one pass (array -> bytes, every 8th), mapped to shards by one itemgetter."""
        shards, mask = self._shards, self._mask
        n = len(hs)
        if not mask:
            return [shards[0]] * n
        if n < 32:                  # the bulk pick's fixed cost is more than it saves below
            return [shards[h & mask] for h in hs]
        try:
            low = array("Q", hs).tobytes()[_LOW::8]
        except (OverflowError, TypeError):
            return [shards[h & mask] for h in hs]
        return self._shards_by_low(low)

    def _shards_by_low(self, low: bytes) -> Sequence[dict[int, int]]:
        """The shards of hashes whose low bytes are ``low`` (at least 2 of them)."""
        if self._table is not None:
            low = low.translate(self._table)
        return cast("tuple[dict[int, int], ...]", itemgetter(*low)(self._shards))

    def _values_low(self, hs: list[int], low: bytes) -> Iterator[int | None]:
        """The holders of each of the 64-bit ``hs`` whose low bytes are ``low`` (None: not
        indexed), probed lazily in C."""
        if not self._mask:
            return map(self._shards[0].get, hs)
        if len(hs) < 2:
            return map(self._get, hs)
        return map(dict.get, self._shards_by_low(low), hs)

    def entries(self) -> tuple[list[int], list[int]]:
        """Every block hash and its value, shard by shard, each shard oldest first (a copy)."""
        keys: list[int] = []
        vals: list[int] = []
        for d in self._shards:
            keys += d
            vals += d.values()
        return keys, vals

    # ---- workers -------------------------------------------------------------------------------

    def _taken_keys(self) -> list[WorkerKey]:
        """The slots' keys, read where only taken slots are looked up (an alive or holder bit,
        a worker's own slots): freed ones (None) are never reached there."""
        return cast("list[WorkerKey]", self._key_of)

    def _slot(self, key: WorkerKey) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._key_of[slot] = key
                self._blocks_of[slot] = SlotBlocks(self, 1 << slot)
            else:
                slot = len(self._key_of)
                self._key_of.append(key)
                self._blocks_of.append(SlotBlocks(self, 1 << slot))
                self._one.append(1 << slot)
            self._slot_of[key] = slot
            self._by_worker.setdefault(key[0], []).append(slot)
            self._bits_of[key[0]] = self._bits_of.get(key[0], 0) | 1 << slot
            self._all |= 1 << slot
            self.added.append((slot, key[0]))
        return slot

    def workers(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def may_have_holes(self, key: WorkerKey) -> None:
        """What ``key`` holds was stored without its chains' order (a snapshot's blocks): walk
        it block by block until it is cleared (see _gallop)."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._holey |= 1 << slot

    def worker_ids(self) -> KeysView[str]:
        """The worker ids that hold a slot here (a live view: O(1) ``in``, nothing copied)."""
        return self._by_worker.keys()

    def blocks_by_worker(self, worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Blocks held per worker id, summed over its DP ranks (only ``worker_ids``, if given)."""
        blocks_of, by_worker = self._blocks_of, self._by_worker
        if worker_ids is None:
            return {wid: sum(blocks_of[s].live for s in slots) for wid, slots in by_worker.items()}
        out: dict[str, int] = {}
        for wid in worker_ids:
            slots = by_worker.get(wid)
            if slots:
                out[wid] = blocks_of[slots[0]].live if len(slots) == 1 else sum(blocks_of[s].live for s in slots)
        return out

    def mask_of(self, worker_ids: Iterable[str]) -> int:
        """The slots of these workers (all their DP ranks) as one mask; unknown ids add nothing.
        A few ids (a placement's candidates) OR their workers' masks in C; many (a routable
        group, built once per group) set bits in a bytearray: O(n), not O(n^2/64) big-integer ORs."""
        if isinstance(worker_ids, (list, tuple)) and len(worker_ids) <= 64:
            return reduce(or_, map(self._bits_of.get, worker_ids, repeat(0)), 0)
        by_worker = self._by_worker
        found = [s for wid in worker_ids for s in by_worker.get(wid, ())]
        bits = bytearray((len(self._key_of) + 7) // 8)
        for s in found:
            bits[s >> 3] |= 1 << (s & 7)
        return int.from_bytes(bits, "little")

    def drop_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        """Forget a worker (every DP rank when ``dp_rank`` is None) and free its slot(s)."""
        key_of = self._taken_keys()
        keys = [(worker_id, key_of[s][1]) for s in self._by_worker.get(worker_id, ())
                if dp_rank is None or key_of[s][1] == dp_rank]
        for key in keys:
            slot = self._slot_of.pop(key)
            self._clear_slot(slot)
            self._key_of[slot] = None
            self._all &= ~(1 << slot)
            self._holey &= ~(1 << slot)
            self._free.append(slot)
            slots = self._by_worker[worker_id]
            slots.remove(slot)
            if slots:
                self._bits_of[worker_id] &= ~(1 << slot)
            else:
                del self._by_worker[worker_id]
                del self._bits_of[worker_id]
            self.generation += 1
            self.added = []

    def reset_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        """Drop what a worker holds but keep it registered (seq gap / engine restart)."""
        key_of = self._taken_keys()
        for slot in list(self._by_worker.get(worker_id, ())):
            if dp_rank is None or key_of[slot][1] == dp_rank:
                self._clear_slot(slot)

    # ---- events --------------------------------------------------------------------------------

    def apply(self, worker_id: str, dp_rank: int | None, events: Iterable[KVEvent]) -> None:
        """Apply one decoded batch from ``worker_id`` (dp_rank None is taken as rank 0)."""
        key = (worker_id, dp_rank or 0)
        gone: list[int] = []        # a run of removals is applied in one call (vLLM: one per block)
        for ev in events:
            if type(ev) is BlockRemoved:
                gone += ev.block_hashes
                continue
            if gone:
                self.remove(key, gone)
                gone = []
            if type(ev) is BlockStored:
                self.store(key, ev.block_hashes, ev.parent_block_hash)
            elif type(ev) is AllBlocksCleared:
                self._clear_slot(self._slot(key))
        if gone:
            self.remove(key, gone)

    def store(self, key: WorkerKey, hashes: Sequence[int], parent: int | None) -> None:
        """Blocks ``hashes`` (a chain continuing ``parent``) are now cached on ``key``."""
        if not hashes:
            return
        slot = self._slot(key)
        intern = self._intern.setdefault
        bit = intern(1 << slot, 1 << slot)
        mine, shards, mask, cap = self._blocks_of[slot], self._shards, self._mask, self._cap
        parents = self._parent
        if parents is not None:
            prev = parent
            for h in hashes:
                parents[h & mask][h] = prev
                prev = h
        new: list[int] = []
        full: list[dict[int, int]] = []     # shards grown past their cap
        added = 0
        last: int | None = None             # runs of blocks share one (interned) value: map it once
        last2 = 0
        for h in reversed(hashes):          # deepest first = least recent (see module docstring)
            d = shards[h & mask]
            m = d.pop(h, None)
            if m is None:
                d[h] = bit
                added += 1
                if len(d) > cap:
                    full.append(d)
            elif m & bit:
                d[h] = m
                continue
            else:
                if m is not last:
                    m2 = m | bit
                    last, last2 = m, intern(m2, m2)
                d[h] = last2
            new.append(h)
        if parent is not None:
            d = self._shards[parent & mask]
            m = d.pop(parent, None)
            if m is not None:
                d[parent] = m
            if new and (m is None or not m & bit):
                self._holey |= 1 << slot        # a run continuing a block this slot lacks
        self._size += added
        if new:
            mine.extend(new)
            mine.live += len(new)
            self._refs += len(new)
        self._stored += len(hashes)
        self._clock += len(hashes)
        if mine.due():
            mine.compact()
        if full:
            lost = 0
            for d in full:
                if len(d) > cap:
                    lost |= self._evict(d)
            self._holey |= lost
            self._compact_one(lost & ~(1 << slot))      # ``mine`` had its step above
        if len(self._intern) > _INTERN_MAX:
            self._intern.clear()

    def remove(self, key: WorkerKey, hashes: Iterable[int]) -> None:
        slot = self._slot_of.get(key)
        if slot is None:
            return
        mine = self._blocks_of[slot]
        bit, shards, mask, shift = mine.bit, self._shards, self._mask, self._shift
        intern, parents = self._intern.setdefault, self._parent
        ends = _ENDS if shift else 0
        n = gone = flagged = 0
        for h in hashes:                    # _unhold, inline: a run of removals is one call
            d = shards[h & mask]
            m = d.get(h)
            if m is not None and m & bit:
                n += 1
                m &= ~bit
                if m >> shift:
                    d[h] = intern(m, m)
                else:
                    del d[h]
                    gone += 1
                    flagged |= m & ends
                    if parents is not None:
                        parents[h & mask].pop(h, None)
        if flagged:
            self._ends_lost()
        if n:
            self._holey |= 1 << slot
        mine.live -= n
        self._refs -= n
        self._removed += n
        self._size -= gone
        mine.compact()

    def _unhold(self, h: int, m: int, bit: int) -> None:
        """Clear ``bit`` (already shifted) from block ``h`` whose value is ``m``."""
        m &= ~bit
        self._refs -= 1
        if m >> self._shift:
            self._shards[h & self._mask][h] = self._intern.setdefault(m, m)
        else:
            del self._shards[h & self._mask][h]
            self._size -= 1
            if self._parent is not None:
                self._parent[h & self._mask].pop(h, None)
            if self._shift and m & _ENDS:
                self._ends_lost()

    def _ends_lost(self) -> None:
        """A routed mark flagged for chain ends went before its bucket's expiry (RoutedIndex)."""

    def _clear_slot(self, slot: int) -> None:
        mine = self._blocks_of[slot]
        bit, shards, mask = mine.bit, self._shards, self._mask
        for h in mine.raw():
            m = shards[h & mask].get(h)
            if m is not None and m & bit:
                self._unhold(h, m, bit)
        self._blocks_of[slot] = SlotBlocks(self, 1 << slot)
        self._holey &= ~(1 << slot)
        self._cleared += 1

    def _drop_block(self, h: int) -> int:
        """Forget block ``h`` for every worker holding it; returns the mask of those slots."""
        m = self._shards[h & self._mask].pop(h) >> self._shift
        self._size -= 1
        if self._parent is not None:
            self._parent[h & self._mask].pop(h, None)
        blocks_of = self._blocks_of
        held = m
        if self._gallops:               # (the routed indexes expire this way: they never gallop)
            self._holey |= m
        while m:
            low = m & -m
            blocks_of[low.bit_length() - 1].live -= 1
            self._refs -= 1
            m ^= low
        return held

    def _evict(self, shard: dict[int, int]) -> int:
        """``shard`` is over its cap: drop its oldest blocks, a batch more than needed so the
        scan for the oldest (past the holes earlier batches left at the front of the dict) is
        paid once per batch: 1/16 of a shard's cap (~490 blocks at the default), 1/256 of the cap
        unsharded. One step touches one shard, never the whole index. The blocks are popped
        in C and their holders counted by distinct value (runs of blocks share one). Returns the
        mask of the slots that lost blocks (see _compact_one).

        A referenced block (touched since eviction last reached it) gets a second chance: it
        is moved to the newest end with its bit cleared, and the next oldest is taken instead."""
        cap = self._cap
        n = min(len(shard), len(shard) - cap + (cap >> 4 if self._mask else cap >> 8))
        victims = list(islice(shard, n))
        ref = self._ref
        if ref and not ref.isdisjoint(victims):
            held: Counter[int] = Counter()
            gone: list[int] = []
            while True:         # each pass evicts or spares at least one block: it ends
                spared = ref.intersection(victims)
                if spared:
                    ref.difference_update(spared)
                    for h in victims:
                        if h in spared:
                            shard[h] = shard.pop(h)
                    victims = [h for h in victims if h not in spared]
                held.update(map(shard.pop, victims))
                gone += victims
                if len(gone) >= n or not shard:
                    break
                victims = list(islice(shard, n - len(gone)))
            victims = gone
        else:
            held = Counter(map(shard.pop, victims))
        if self._parent is not None:
            parents = self._parent[victims[0] & self._mask] if victims else {}
            for h in victims:
                parents.pop(h, None)
        shift, blocks_of = self._shift, self._blocks_of
        lost = refs = 0
        for m, count in held.items():
            m >>= shift
            lost |= m
            while m:
                low = m & -m
                blocks_of[low.bit_length() - 1].live -= count
                refs += count
                m ^= low
        self._refs -= refs
        self._size -= len(victims)
        self._evicted += len(victims)
        return lost

    def _compact_one(self, lost: int) -> None:
        """One compaction step for the first slot in ``lost`` with stale entries to drop: the
        others compact on their own stores and removals, or on a later eviction (one step per
        store, however many shards it made evict, keeps a store's cost bounded)."""
        blocks_of = self._blocks_of
        while lost:
            low = lost & -lost
            mine = blocks_of[low.bit_length() - 1]
            if mine.due():
                mine.compact()
                return
            lost ^= low

    # ---- queries -------------------------------------------------------------------------------

    def _walk(self, chain: Sequence[int], alive: int) -> list[tuple[int, int]]:
        """(depth, mask of the slots whose match ends at that depth), shallowest first; depth >= 1."""
        shift = self._shift
        levels: list[tuple[int, int]] = []
        if shift:
            alive <<= shift             # compare in the values' own position: stamps fall out of the AND
        if not chain:
            return levels
        shards, mask = self._shards, self._mask
        h = chain[0]
        v = shards[h & mask].get(h)
        if v is None or not v & alive:  # the first probe decides: a prompt nobody alive holds costs one
            return levels
        if self._gallops:
            alive &= v                  # (those not holding chain[0] match nothing)
            holey = alive & self._holey
            if not holey:
                return self._gallop(chain, alive)
            if holey != alive:          # gallop over those without holes, block by block over the rest
                return _merge_levels(self._gallop(chain, alive ^ holey), self._walk(chain, holey))
        # Each block's shard: picking it costs about as much as the probe, so the walk goes in
        # pieces of _HEAD blocks (at depths 0, _HEAD, 2 _HEAD ...) and remembers each piece's
        # picks under its first hash, reused as a guess by the next walk through it (a shared
        # document or system prompt, a conversation's next turn walk the same pieces again). A
        # wrong guess cannot make a false hit (a hash lives in its own shard only), only a false
        # miss, so where a guessed probe misses, the walk checks that block's shard; past a wrong
        # one it probes that block in its own, picks the rest of the piece and keeps the piece
        # mended. map() probes in C, lazily: the walk still stops at the first block nobody alive
        # holds. Runs of blocks with equal holders (most of a chain: its blocks were stored
        # together, and equal masks are one interned object) are grouped and counted in C too,
        # so the Python loop turns once per change of holders.
        n = len(chain)
        depth = 0
        if not mask:                        # one shard: no picks
            vals = map(shards[0].get, chain)
            hs: Sequence[int] = chain
            sel: Sequence[dict[int, int]] = ()
            guessed = False
            p = start = 0
        else:
            known = self._known
            p = 0                           # the piece: chain[p:p + _HEAD]
            hs = chain if n <= _HEAD else chain[:_HEAD]
            sel, guessed = self._picks(hs)
            vals = map(dict.get, sel, hs)
            start = 0                       # vals probes hs[start - p:] in sel
        while True:
            for v, run in groupby(vals):
                if v is None:
                    if guessed and sel[depth - start] is not shards[chain[depth] & mask]:
                        break               # not a miss: a wrong guess of this block's shard
                    m = 0
                else:
                    m = v & alive
                if m != alive:
                    if depth:
                        levels.append((depth, (alive ^ m) >> shift if shift else alive ^ m))   # (m is in alive)
                    alive = m
                    if not alive:
                        break
                depth += countOf(run, v)
            if not alive or depth >= n:
                break
            if depth < p + len(hs):         # a guess was wrong here or ran out inside the piece
                h = chain[depth]
                if depth < start + len(sel):
                    v = shards[h & mask].get(h)     # this block in its own shard first
                    if v is None or not v & alive:
                        levels.append((depth, alive >> shift))
                        alive = 0
                        break
                part = hs[depth - p:]
                fix = self._shards_of(part)
                mended = [*sel[:depth - start], *fix] if depth > p else fix
                self._known_picks += len(fix)
                known[hs[0]] = mended
                sel, guessed, start = fix, False, depth
                vals = map(dict.get, fix, part)
                continue
            p += _HEAD                      # the next piece
            hs = chain[p:p + _HEAD]
            sel, guessed = self._picks(hs)
            start = p
            vals = map(dict.get, sel, hs)
        alive >>= shift
        if alive:
            levels.append((depth, alive))
        return levels

    def _gallop(self, chain: Sequence[int], alive: int) -> list[tuple[int, int]]:
        """:meth:`_walk` for slots without holes, ``alive`` those holding ``chain[0]``: in
        O(levels x log(chain)) probes instead of one per matched block.

        A block's hash commits to its whole prefix, so the block at depth d of a chain has the
        block at d - 1 as its parent. A slot without holes holds every parent of every block
        it holds (``_holey``: none was removed or evicted, no run was stored after a parent it
        lacked, since it was last cleared). So it holds ``chain[:d + 1]`` whenever it holds
        ``chain[d]``, the alive set can only shrink along the chain, and where it changes is
        found by galloping (depths +1, +2, +4 ...) and bisection, as in the routed walk. The
        levels are the linear walk's (where some alive slots may have holes, those are walked
        block by block and the two walks' levels merged). The index is large and its probes miss the CPU caches
        (about 140 ns each here): a prompt matched 128 blocks deep on a few workers costs some
        15 probes a level instead of 128."""
        shards, mask = self._shards, self._mask
        levels: list[tuple[int, int]] = []
        n = len(chain)
        lo = 0                              # every alive slot holds chain[:lo + 1]
        while True:
            step, hi, vh = 1, n, None       # hi: the first depth not held by every alive slot
            while True:
                j = lo + step
                if j >= n:
                    j = n - 1
                    if j <= lo:
                        break
                    h = chain[j]
                    v = shards[h & mask].get(h)
                    if v is not None and v & alive == alive:
                        lo = j
                    else:
                        hi, vh = j, v
                    break
                h = chain[j]
                v = shards[h & mask].get(h)
                if v is not None and v & alive == alive:
                    lo, step = j, step * 2
                else:
                    hi, vh = j, v
                    break
            while hi - lo > 1 and hi < n:   # bisect (lo, hi]
                mid = (lo + hi) >> 1
                h = chain[mid]
                v = shards[h & mask].get(h)
                if v is not None and v & alive == alive:
                    lo = mid
                else:
                    hi, vh = mid, v
            if hi >= n:
                levels.append((n, alive))
                return levels
            m = vh & alive if vh is not None else 0
            levels.append((hi, alive ^ m))
            if not m:
                return levels
            alive, lo = m, hi

    def _picks(self, hs: Sequence[int]) -> tuple[Sequence[dict[int, int]], bool]:
        """The shards of the chain piece ``hs`` and whether they are a guess: the picks
        remembered from an earlier walk of a piece starting at the same hash, else picked now
        (and remembered)."""
        got = self._known.get(hs[0])
        if got is not None:
            return got, True
        sel = self._shards_of(hs)
        self._remember(hs[0], sel)
        return sel, False

    def _remember(self, h: int, sel: Sequence[dict[int, int]]) -> None:
        """Keep the shards of the chain piece walked from ``h`` (see _walk), at most _KNOWN_MAX
        picks in all."""
        self._known_picks += len(sel)
        if self._known_picks > _KNOWN_MAX:
            self._known.clear()
            self._known_picks = len(sel)
        self._known[h] = sel

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
        key_of = self._taken_keys()
        for depth, m in self._walk(chain, alive):
            while m:
                low = m & -m
                out[key_of[low.bit_length() - 1]] = depth
                m ^= low
        if touch and out:
            self.touch(chain[:max(out.values())])
        return out

    def depths(self, chain: Sequence[int], alive: int) -> dict[str, int]:
        """Per worker id (best DP rank), the leading blocks of ``chain`` held, for the slots in
        ``alive`` (see :meth:`mask_of`); workers at 0 are omitted. Costs the chain walk plus one
        step per slot in ``alive`` that matches at all."""
        out: dict[str, int] = {}
        if not alive or not chain:
            return out
        key_of = self._taken_keys()
        for depth, m in self._walk(chain, alive):
            while m:
                low = m & -m
                out[key_of[low.bit_length() - 1][0]] = depth   # deeper levels come later: best rank wins
                m ^= low
        return out

    def levels(self, chain: Sequence[int], alive: int) -> list[tuple[int, int]]:
        """The walk of ``chain`` over the slots in ``alive``, kept for :meth:`top` and
        :meth:`depths_in`: one walk answers both which slots match deepest and any subset's depths."""
        return self._walk(chain, alive) if alive and chain else []

    def depths_in(self, levels: list[tuple[int, int]], alive: int) -> dict[str, int]:
        """Per worker id (best DP rank), the depth of each slot in ``alive`` by ``levels``; one
        big-integer AND per level plus one step per matching slot."""
        out: dict[str, int] = {}
        key_of = self._taken_keys()
        for depth, m in levels:                 # shallowest first: a deeper rank overwrites
            m &= alive
            while m:
                low = m & -m
                out[key_of[low.bit_length() - 1][0]] = depth
                m ^= low
        return out

    def depths_among(self, levels: list[tuple[int, int]], worker_ids: Sequence[str]) -> dict[str, int]:
        """``depths_in(levels, mask_of(worker_ids))`` for a few ids (a placement's candidates):
        a level of a few slots is read slot by slot, not ANDed with the ids' mask, which is
        built only for a level of many (at 1,000 slots a big-integer OR or AND costs about
        as much as reading a slot, and the ids' mask takes one OR per id)."""
        out: dict[str, int] = {}
        key_of, one = self._taken_keys(), self._one
        few = len(worker_ids)
        ids: set[str] | None = None
        mask = -1
        # Slots are taken highest first, each cleared by one XOR with its bit from a table
        # (m & -m, then m ^ low, cost three big-integer operations a slot).
        for depth, m in levels:                 # shallowest first: a deeper rank overwrites
            if m.bit_count() <= few:
                if ids is None:
                    ids = set(worker_ids)
                while m:
                    slot = m.bit_length() - 1
                    wid = key_of[slot][0]
                    if wid in ids:
                        out[wid] = depth
                    m ^= one[slot]
                continue
            if mask < 0:
                mask = self.mask_of(worker_ids)
            m &= mask
            while m:
                slot = m.bit_length() - 1
                out[key_of[slot][0]] = depth
                m ^= one[slot]
        return out

    def top(self, levels: list[tuple[int, int]], k: int, rng: random.Random) -> dict[str, int]:
        """Up to ``k`` worker ids holding the deepest matches by ``levels``, with their depths, in
        O(k) big-integer steps whatever the number of slots; where a level holds more than the
        budget left, a random subset of it is taken (rotating the mask, so low slot numbers are
        not favoured)."""
        out: dict[str, int] = {}
        if k <= 0:
            return out
        key_of, one = self._taken_keys(), self._one
        width = len(key_of)
        for depth, m in reversed(levels):
            if m.bit_count() <= k - len(out):
                # all of them, lowest slot first; taken highest first (see depths_among)
                slots = []
                while m:
                    slot = m.bit_length() - 1
                    slots.append(slot)
                    m ^= one[slot]
                for slot in reversed(slots):
                    wid = key_of[slot][0]
                    if wid not in out:
                        out[wid] = depth
                if len(out) >= k:
                    break
                continue
            r = rng.randrange(width)
            m = ((m >> r) | (m << (width - r))) & ((1 << width) - 1)    # rotate right by r
            while m and len(out) < k:
                low = m & -m
                slot = low.bit_length() - 1 + r
                wid = key_of[slot - width if slot >= width else slot][0]
                if wid not in out:
                    out[wid] = depth
                m ^= low
            if len(out) >= k:
                break
        return out

    def deepest(self, chain: Sequence[int], alive: int, k: int, rng: random.Random) -> dict[str, int]:
        """Up to ``k`` worker ids among the slots in ``alive`` holding the deepest matches of
        ``chain``, with their depths: the chain walk plus O(k), whatever the number of slots."""
        return self.top(self.levels(chain, alive), k, rng)

    def touch(self, chain: Sequence[int]) -> None:
        """Mark a matched prefix recently used: its blocks' referenced bits are set, so eviction
        reaching one moves it to the newest end instead (a second chance, see :meth:`_evict`).

        A prefix touched since fewer than max_blocks / 4 blocks were stored or touched is still
        far from eviction, so touching it again is skipped; prefixes are remembered at their
        end, at their last multiple of 16 blocks and at every 64th block on the way, so a hot
        prefix costs one probe, one sharing its first multiple of 16 blocks at most 16 block
        touches, and a new prompt sharing part of a touched one at most 64 more plus a probe
        per 64 blocks of the small table of remembered prefixes, not O(depth). Past
        ``_REF_MAX`` bits (stale ones included: a removed block's bit stays until then) the
        bits start over, and so does the table of touched prefixes, so the next touches set
        them again.
        """
        n = len(chain)
        if not n:
            return
        if len(self._ref) > _REF_MAX:
            self._ref.clear()
            self._touched.clear()
        touched, horizon = self._touched, self._clock - (self.config.max_blocks >> 2)
        seen = touched.get(chain[n - 1])
        if seen is not None and seen > horizon:
            return                    # this very prefix was touched recently enough (its end is remembered)
        cut = n & ~15                 # the prefix up to a multiple of 16 blocks is remembered
        fresh = 0                     # chain[:fresh] was touched recently enough
        if cut:
            seen = touched.get(chain[cut - 1])
            if seen is not None and seen > horizon:
                fresh = cut
            else:
                for p in range(((cut - 1) >> 6) << 6, 0, -64):
                    seen = touched.get(chain[p - 1])
                    if seen is not None and seen > horizon:
                        fresh = p
                        break
        self._ref.update(chain[fresh:] if fresh else chain)
        self._clock += n - fresh
        if len(touched) >= 16384:
            touched.clear()
        clock = self._clock
        touched[chain[n - 1]] = clock
        if cut > fresh:
            touched[chain[cut - 1]] = clock
            for p in range(((fresh >> 6) + 1) << 6, cut, 64):
                touched[chain[p - 1]] = clock

    def parent_of(self, h: int) -> int | None:
        return self._parent[h & self._mask].get(h) if self._parent is not None else None

    def holders_of(self, h: int) -> list[WorkerKey]:
        m = self._held(h) >> self._shift
        key_of = self._taken_keys()
        out = []
        while m:
            low = m & -m
            out.append(key_of[low.bit_length() - 1])
            m ^= low
        return out

    def size(self) -> int:
        return self._size

    def version(self) -> tuple[int, ...]:
        """Changes whenever the index may have: stores, removals, clears, evictions, touches
        (what a snapshot compares to tell whether there is anything new to write)."""
        return (self._stored, self._removed, self._cleared, self._evicted, self._clock, self.generation)

    def stats(self) -> PrefixIndexStats:
        return PrefixIndexStats(blocks=self._size, block_refs=self._refs, workers=len(self._slot_of),
                                stored=self._stored, removed=self._removed, cleared=self._cleared,
                                evicted=self._evicted)


class RoutedIndex(PrefixIndex):
    """The approximate index: prefixes remembered because they were *routed*, not announced.

    Each value is the holders' mask shifted left by 32 bits with a routing stamp in the low 31
    bits (and the ends flag, below, in bit 31): the time bucket of the last routing that included
    the block. A routing's expiry (queued by
    the caller with its stamp) forgets the blocks whose stamp is still its own; a block routed
    again since (the next turn of a conversation, a shared system prompt) outlives it and counts,
    for every worker it was routed to, until ``approx_ttl_s`` after its last routing. This keeps
    the expiry bookkeeping at 8 bytes per routed block instead of one timestamp per
    (worker, block), at the price of that coarser expiry for blocks routed to several workers.

    Sparse marks (``stride`` K > 1): a routed chain of n blocks is recorded only at depths K, 2K,
    ... and at its end n (``marks``), so routing costs n / K + 1 probes and writes instead of n,
    and so does the memory. A chain's block hash commits to its whole prefix, so a mark at depth d
    on worker w says "chain[:d] was routed to w", and the depth of a mark is the same in every
    chain that holds it. A walk probes the depths K, 2K, ... (galloping, as below) and, where a
    worker's run of them stops, the at most K - 1 depths between its last and the next for the
    end of a chain routed there. So the depth found for a worker is the deepest routed chain's
    end it shares with the prompt where the prompt *is* that chain or extends it (the next turn
    of a conversation: exact), and otherwise the deepest multiple of K of the shared part: at
    most K - 1 blocks short of the shared depth, never deeper than what was routed. With
    K = 1 every block is a mark and the walk is the exact one over routed blocks. Stats and
    ``size()`` count marks; :meth:`blocks_by_worker` estimates blocks as marks x K.

    Ends flags: looking for chain ends between two marks costs K - 1 probes each time the
    alive set changes (about half of a walk's cost, and most of them miss: chains end there
    rarely). So a routing whose chain ends between depths d and d + K (d a multiple of K,
    d > 0) flags the mark at d (``_ENDS``, a bit of the value's low word; flags survive
    restamping and partial removal), and the walk searches only after flagged marks. A
    stale flag (its chain expired) costs a search, never a wrong depth. What could hide an
    end is covered by stamps, since buckets expire oldest first: chains shorter than K
    (ends before the first mark) are searched for while the newest bucket that routed one
    lives (``_short``), and every end while marks whose flags may be missing live
    (``_blind``: marks loaded from a snapshot, which holds no flags, or a flagged mark that
    left before its bucket's expiry).

    Unlike the exact index it is not bounded by LRU eviction: its owner (``KVCache``) keeps it
    under ``max_blocks`` (marks) by expiring the oldest buckets early, which, like expiry itself,
    keeps every routed prefix prefix-closed; that is what lets :meth:`_walk` gallop.
    """

    _shift = _STAMP_BITS

    def __init__(self, config: PrefixIndexConfig | None = None, stride: int = 1) -> None:
        super().__init__(config)
        if stride < 1:
            raise ValueError("stride must be at least 1")
        self.stride = stride
        # Routing stamps (as given, oldest expired first) bounding what ends flags cannot tell
        # (see the class docstring); -1: nothing to cover.
        self._last = -1         # the newest stamp routed or marked
        self._short = -1        # the newest stamp of a routed chain shorter than the stride
        self._blind = -1        # marks without reliable ends flags live until this stamp expires

    def marks(self, chain: Sequence[int], after: int = 0) -> list[int]:
        """The blocks of ``chain`` that routing it records: depths K, 2K, ... and its last block,
        those deeper than ``after`` only; deepest last."""
        k, n = self.stride, len(chain)
        if k == 1:
            return list(chain[after:])
        out = list(chain[(after // k + 1) * k - 1::k])
        if n % k and n > after:
            out.append(chain[n - 1])
        return out

    def _walk(self, chain: Sequence[int], alive: int) -> list[tuple[int, int]]:
        """As :meth:`PrefixIndex._walk` over the marks, in O(levels x (log(chain / K) + K)) probes.

        Routed prefixes are closed under prefixes: a routing marks a whole chain, deepest
        least recent, and expiry and eviction take deeper marks no later than shallower ones
        (a mark's stamp is never older than a deeper mark's of the same chain). So along a
        chain the holders of the depths K, 2K, ... only ever shrink, and the depth at which the
        alive set changes can be found by galloping and bisection; the slots that drop there
        are then given the deepest chain end routed to them in the K - 1 depths before (probed
        in one C pass, deepest first). The index is large and its probes miss the CPU caches:
        fewer probes is what makes the walk cheap.
        """
        shards, mask, shift, k = self._shards, self._mask, self._shift, self.stride
        levels: list[tuple[int, int]] = []
        n = len(chain)
        sparse = chain if k == 1 else chain[k - 1::k]     # sparse[j] lies at depth (j + 1) * k
        s = len(sparse)
        alive <<= shift
        blind = self._blind >= 0             # search after every mark (see the class docstring)
        short = blind or self._short >= 0    # search before the first mark
        vlo = 0                              # the value of sparse[i - 1] (every alive slot holds it)
        i = 0                                # every alive slot holds sparse[:i]
        while True:
            # hi: the first index >= i not held by every alive slot (s: none), vh: its value
            if i < s:
                h = sparse[i]
                v = shards[h & mask].get(h)      # probes inline: a method call each cost as much again
                if v is not None and v & alive == alive:
                    lo, step, vlo = i, 1, v  # gallop forward
                    while True:
                        j = lo + step
                        if j >= s:
                            hi = s
                            break
                        h = sparse[j]
                        vh = shards[h & mask].get(h)
                        if vh is not None and vh & alive == alive:
                            lo, step, vlo = j, step * 2, vh
                        else:
                            hi = j
                            break
                    while hi - lo > 1:       # bisect (lo, hi]
                        mid = (lo + hi) >> 1
                        h = sparse[mid]
                        v = shards[h & mask].get(h)
                        if v is not None and v & alive == alive:
                            lo, vlo = mid, v
                        else:
                            hi, vh = mid, v
                else:
                    hi, vh = i, v
            else:
                hi = s
            m = vh & alive if hi < s and vh is not None else 0
            drop = alive ^ m                 # (m is in alive) these stop between depth hi * k and the next mark
            base = hi * k
            if k > 1:
                top = min(base + k - 1, n)
                ends: list[tuple[int, int]] = []
                # chain ends between base and the next mark: only after a flagged mark
                if top > base and (vlo & _ENDS or blind if base else short):
                    vals = [shards[h & mask].get(h) for h in chain[base:top]]   # < K: no bulk pick
                    if vals.count(None) != len(vals):
                        for off in range(len(vals) - 1, -1, -1):
                            v = vals[off]
                            if v is not None and v & drop:
                                ends.append((base + off + 1, (v & drop) >> shift))
                                drop &= ~v
                                if not drop:
                                    break
                if drop and base:
                    levels.append((base, drop >> shift))
                if ends:
                    levels.extend(reversed(ends))
            elif drop and base:
                levels.append((base, drop >> shift))
            alive = m
            if not alive:
                break
            i, vlo = hi + 1, vh or 0       # (held by every alive slot: not None)
        return levels

    def route(self, key: WorkerKey, chain: Sequence[int], stamp: int, held: int = 0) -> list[int]:
        """``chain`` was routed to ``key`` now; ``stamp`` (its low 31 bits kept) names the time bucket. Returns
        the marks whose stamp changed (the caller queues them for that bucket's expiry); marks
        this worker already holds with this stamp are left as they are, so a hot prefix routed
        again within its bucket costs one probe a mark. ``held``: the leading blocks the walk
        found this worker holding (by any index); if the deepest mark within them (the chain's
        end, or the last multiple of the stride) is this worker's and already carries this
        stamp, so do all marks before it (see :meth:`_walk`) and they are not probed at all."""
        if not chain:
            return []
        after = 0
        n = len(chain)
        if 0 < held <= n:
            deepest = held if held == n else held - held % self.stride
            if deepest:
                m = self._get(chain[deepest - 1])
                slot = self._slot_of.get(key)
                if m is not None and slot is not None and m & self._blocks_of[slot].bit \
                        and m & _STAMP == stamp & _STAMP:
                    after = deepest         # (marks(chain, after) are marks(chain, held): none lies between)
        changed = self._mark(key, self.marks(chain, after), stamp)
        self._stored += n
        k = self.stride
        if stamp > self._last:
            self._last = stamp
        if n % k:                           # it ends between two marks: flag the one before
            if n < k:
                if stamp > self._short:
                    self._short = stamp
            else:
                h = chain[n - n % k - 1]
                d = self._shards[h & self._mask]
                v = d.get(h)
                if v is not None and not v & _ENDS:
                    v |= _ENDS
                    d[h] = self._intern.setdefault(v, v)
        return changed

    def mark(self, key: WorkerKey, hashes: Sequence[int], stamp: int) -> list[int]:
        """Record ``hashes`` as marks of ``key`` with ``stamp`` as they are (a snapshot's marks,
        kvcache/persist.py); returns those whose stamp changed, as :meth:`route`."""
        changed = self._mark(key, hashes, stamp)
        self._stored += len(hashes)
        if self.stride > 1 and hashes:
            # Which marks end chains, and where, is not known here: search after every mark
            # while these live.
            self._last = max(self._last, stamp)
            self._blind = max(self._blind, stamp)
        return changed

    def _ends_lost(self) -> None:
        """A flagged mark left before its bucket's expiry: the chains that ended after it may
        be routed again without flagging it again (their end marks were stamped no later
        than the newest routing), so search after every mark until that bucket expires."""
        if self.stride > 1:
            self._blind = max(self._blind, self._last)

    def _mark(self, key: WorkerKey, chain: Sequence[int], stamp: int) -> list[int]:
        slot = self._slot(key)
        if not chain:
            return []
        mine = self._blocks_of[slot]
        sbit = mine.bit
        stamp &= _STAMP
        intern = self._intern.setdefault
        got = mine.current                  # a worker is routed many times a bucket: its value once
        if got is not None and got[0] == stamp:
            current = got[1]
        else:
            current = intern(sbit | stamp, sbit | stamp)    # (hashing a 1,000-slot mask costs as much as an OR)
            mine.current = (stamp, current)
        fresh = current                     # one int object shared by the marks new to the index
        changed: list[int] = []
        new: list[int] = []
        created: list[int] = []
        where = self._shards_of(chain)
        values = list(map(dict.get, where, chain))   # every probe first, in C (the index is large: misses)
        # Runs of marks share one (interned) value: decide once per run what becomes of it.
        last: int | None = None
        last2 = 0
        act = 0                             # 0: leave it; else 1 | 2 (new to this worker) | 4 (restamped)
        for d, h, m in zip(reversed(where), reversed(chain), reversed(values), strict=True):
            if m is None:
                d[h] = fresh
                new.append(h)
                created.append(h)
                changed.append(h)
                continue
            if m is not last:
                last = m
                held_here, same = m & sbit, m & _STAMP == stamp
                if held_here and same:
                    act = 0                 # held here, routed in this bucket already
                else:
                    m2 = (m ^ (m & _STAMP)) | current      # (the stamp cleared: the ends flag stays)
                    last2 = intern(m2, m2)
                    act = 1 | (0 if held_here else 2) | (0 if same else 4)
            if act:
                d[h] = last2
                if act & 2:
                    new.append(h)
                if act & 4:
                    changed.append(h)
        if created:                         # a hash twice in one chain was new twice: count it once
            self._size += len(set(created)) if len(created) > 1 else 1
        if new:
            if len(new) > 1 and len(set(new)) != len(new):
                new = list(dict.fromkeys(new))    # a hash twice in one chain: probed before either insert
            mine.extend(new)
            mine.live += len(new)
            self._refs += len(new)
        if mine.due():
            mine.compact()
        # No LRU eviction here: the owner caps the size by expiring the oldest buckets early,
        # which keeps routed prefixes prefix-closed (see _walk).
        if len(self._intern) > _INTERN_MAX:
            self._intern.clear()
        return changed

    def blocks_by_worker(self, worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Blocks routed per worker id, estimated as its marks x ``stride`` (exact at stride 1)."""
        got = super().blocks_by_worker(worker_ids)
        k = self.stride
        return {wid: n * k for wid, n in got.items()} if k > 1 else got

    def evict(self, chain: Iterable[int], stamp: int) -> int:
        """``expire``, counted as evictions (the routed index over its size cap)."""
        gone = self.expire(chain, stamp)
        self._evicted += gone
        return gone

    def expire(self, chain: Iterable[int], stamp: int) -> int:
        """Forget the marks of the routing ``stamp`` that no later routing refreshed (buckets
        expire oldest first: see the ends flags in the class docstring)."""
        if stamp >= self._short:
            self._short = -1
        if stamp >= self._blind:
            self._blind = -1
        get, stamp = self._get, stamp & _STAMP
        gone = 0
        for h in chain:
            m = get(h)
            if m is not None and m & _STAMP == stamp:
                self._drop_block(h)
                self._removed += 1
                gone += 1
        return gone


def _merge_levels(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The levels of two walks of one chain over disjoint slot sets, as one walk over both
    would give them (a slot's depth does not depend on the others walked with it)."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][0]:
            out.append(a[i])
            i += 1
        elif a[i][0] > b[j][0]:
            out.append(b[j])
            j += 1
        else:
            out.append((a[i][0], a[i][1] | b[j][1]))
            i += 1
            j += 1
    return out + a[i:] + b[j:]


def best_per_worker(depths: dict[WorkerKey, int]) -> dict[str, int]:
    """Collapse DP ranks: a worker's depth is its best rank's (when the engine routes by prefix)."""
    out: dict[str, int] = {}
    for (wid, _), d in depths.items():
        if d > out.get(wid, 0):
            out[wid] = d
    return out
