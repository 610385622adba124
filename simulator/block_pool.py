"""The KV block pool with vLLM v1's automatic prefix caching (``vllm/v1/core/block_pool.py``).

Same mechanics as the real pool, minus the GPU:

* every block is in exactly one of two states: referenced by requests (``ref_cnt > 0``), or
  free. Free blocks sit in one LRU queue, *including* full blocks that still hold a cached
  prefix: those stay findable by hash until the pool hands them out again, which evicts them
  (one ``BlockRemoved`` per evicted hash);
* a block becomes cached (``BlockStored``) when the scheduler allocates the step that fills
  it, keyed by the request's chained block hash; two requests computing the same block at once
  both get cached under that hash, as in vLLM (it does not de-duplicate);
* freeing a request's blocks (tail first) puts uncached blocks at the front of the queue
  (reused first) and cached ones at the back, in that order, so the tail of a finished
  prompt is evicted before its head;
* a new request reuses the longest run of cached full blocks from the start of its hash
  chain (``touch``: shared blocks gain a reference and leave the free queue).

Not modelled: vLLM's reserved null block (block 0), hybrid/sliding-window groups, partial-block
hashes (``hash_block_size < block_size``) and KV offloading tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class KVBlock:
    """One KV block; ``block_hash`` is the full digest while the block is cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


# Events as the pool produces them (full digests); kv_events turns them into vLLM's wire form.
@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[tuple[Any, ...] | None, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    block_hash: bytes


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


PoolEvent = Stored | Removed | Cleared


@dataclass
class PoolCounters:
    stored_blocks: int = 0    # blocks that became cached
    evicted_blocks: int = 0   # cached blocks handed out again (their hash dropped)
    resets: int = 0           # successful reset_prefix_cache calls


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # LRU of free blocks: the front is handed out (and evicted) first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # hash -> block, or {block_id: block} when several blocks hold the same content.
        self._cached: dict[bytes, KVBlock | dict[int, KVBlock]] = {}
        self._num_cached = 0
        self.events: list[PoolEvent] = []
        self.counters = PoolCounters()

    # ---- state -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix, referenced or not."""
        return self._num_cached

    def take_events(self) -> list[PoolEvent]:
        events, self.events = self.events, []
        return events

    # ---- lookup ----------------------------------------------------------------------

    def get_cached(self, block_hash: bytes) -> KVBlock | None:
        entry = self._cached.get(block_hash)
        if entry is None or isinstance(entry, KVBlock):
            return entry
        return next(iter(entry.values()))

    def longest_hit(self, block_hashes: Sequence[bytes], max_blocks: int) -> list[KVBlock]:
        """Cached blocks for the longest prefix of ``block_hashes`` (at most ``max_blocks``)."""
        hit: list[KVBlock] = []
        if not self.enable_caching:
            return hit
        for h in block_hashes[:max_blocks]:
            block = self.get_cached(h)
            if block is None:
                break
            hit.append(block)
        return hit

    # ---- allocation ------------------------------------------------------------------

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks from the front of the free queue, evicting their cached hashes."""
        if count > len(self._free):
            raise ValueError(f"cannot get {count} free blocks from the pool ({len(self._free)} free)")
        out = []
        popitem = self._free.popitem
        for _ in range(count):
            _, block = popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Prefix-cache hits: a free (evictable) block leaves the queue; all gain a reference."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, ``ordered`` by eviction priority (first = first out)."""
        first: list[KVBlock] = []
        last: list[KVBlock] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        free = self._free
        for block in reversed(first):  # uncached: reused first (LIFO, like vLLM's prepend_n)
            free[block.block_id] = block
            free.move_to_end(block.block_id, last=False)
        for block in last:             # cached: evicted last, in LRU order
            free[block.block_id] = block

    # ---- caching ---------------------------------------------------------------------

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[bytes], start: int, end: int,
                          token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> None:
        """Register ``blocks[start:end]`` (now full) under ``block_hashes[start:end]``; one
        BlockStored for the run. ``token_ids`` are exactly those blocks' tokens; a cache_salt
        is block 0's extra key (published untagged, as vLLM's ``to_event_extra_keys`` does)."""
        if not self.enable_caching or end <= start:
            return
        cached = self._cached
        for i in range(start, end):
            block, h = blocks[i], block_hashes[i]
            if block.block_hash is not None:  # already cached (cannot happen for full blocks)
                continue
            block.block_hash = h
            entry = cached.get(h)
            if entry is None:
                cached[h] = block
            elif isinstance(entry, KVBlock):
                cached[h] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
            self._num_cached += 1
        self.counters.stored_blocks += end - start
        if self.record_events:
            extra: list[tuple[Any, ...] | None] = [None] * (end - start)
            if cache_salt and start == 0:
                extra[0] = (cache_salt,)
            self.events.append(Stored(
                block_hashes=tuple(block_hashes[start:end]),
                parent_block_hash=block_hashes[start - 1] if start else None,
                token_ids=tuple(token_ids),
                block_size=block_size,
                extra_keys=tuple(extra),
            ))

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        assert h is not None
        entry = self._cached.get(h)
        if isinstance(entry, KVBlock):
            if entry is block:
                del self._cached[h]
        elif entry is not None:
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                self._cached[h] = next(iter(entry.values()))
            elif not entry:
                del self._cached[h]
        block.block_hash = None
        self._num_cached -= 1
        self.counters.evicted_blocks += 1
        if self.record_events:
            self.events.append(Removed(h))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced, as in vLLM."""
        if self.num_used:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        self._num_cached = 0
        self.counters.resets += 1
        if self.record_events:
            self.events.append(Cleared())
        return True
