"""Prefixes remembered because they were routed somewhere, each for a while after its routing.

Two uses in :class:`~controlplane.kvcache.manager.KVCache`:

* the approximate view of workers without KV events (``approx_ttl_s``, minutes): what was
  routed there is the best a router can know;
* pending prefixes of workers with events (``pending_ttl_s``, seconds): a prompt placed on an
  engine is in no event until the engine has computed it, which takes its queue time plus its
  prefill. A follow-up turn placed meanwhile would see no match and go elsewhere, recomputing
  the whole conversation (vllm-router's tree records the routed prompt at once and never has
  this gap). Remembering the placement until its events have surely arrived closes it.

Expiry works in buckets of at most ``ttl_s / 16`` (and 1/16 of ``max_blocks``, at most
``STEP_MARKS``): per bucket, the blocks whose routing stamp moved to it. :class:`RoutedIndex`
stamps each block with the bucket of its last routing, so a block routed again (the next turn
of a conversation, a shared system prompt) outlives its earlier bucket; a block routed many
times within one bucket costs one entry. Blocks count for ``ttl_s`` after their last routing, less at most a bucket.

Sparse marks (``stride``, ``[kv_cache] routed_stride``, 16 by default): a routed chain is recorded
at every 16th block and at its last block only (:class:`RoutedIndex` says how the walk reads them), so
remembering a 1,300-block prompt costs some 82 dict probes and writes, not 1,300,
and memory, expiry and the cap all count marks. The price, bounded: a prompt that shares part of a
routed chain without extending or ending where it ends is matched at the last multiple of 16
blocks of the shared part (at most 15 blocks, 240 tokens at 16-token blocks, short; a shared part
under 16 blocks counts 0); a prompt that extends a routed chain (the next turn) or repeats it
matches it exactly. Pending prefixes lose the same depth at most; a BlockRemoved event takes a
pending mark out only when the removed block is one (an engine frees a request's blocks last
first, so the chain's end mark is among the first to go).

**Bounded steps.** Expiry and the cap run on the placement path (``KVCache.match`` expires,
``route`` shrinks), and a bucket is expired whole (which keeps routed prefixes prefix-closed).
At the default cap of 2M marks a bucket of 1/16 of it was 125,000 marks, 0.1-0.4 s of the
event loop in one step. So a bucket holds at most ``STEP_MARKS`` marks (plus the last
routing's), and one call goes through at most ``STEP_MARKS`` of the queued marks: due buckets
left over are expired by the next calls (every placement makes one), a few milliseconds later.
Only the hard cap (``max_blocks``) is kept at once whatever it costs; the margin below it
(1/256 of the cap) is made in steps.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Sequence

from controlplane.kvcache.index import PrefixIndexConfig, RoutedIndex, WorkerKey

# Queued marks one call to expire() or shrink() goes through at most (a bucket holds at most
# this many plus its last routing's): an expired mark costs ~1 us on the project's 2-core
# machine when it is quiet and up to ~3 us under load, so 2-6 ms of the loop at most. (More
# buckets at a full cap: 1,000 at 2M marks, and a snapshot's runs are per slot and bucket.)
STEP_MARKS = 2048


class RoutingMemory:
    """A :class:`RoutedIndex` with its expiry: routings count for ``ttl_s``, the whole under
    ``max_blocks`` marks (the oldest buckets go first when it is over); ``stride``: see the
    module docstring."""

    def __init__(self, ttl_s: float, max_blocks: int, stride: int = 1, step: int = STEP_MARKS) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks        # marks (blocks at stride 1)
        self.step = step                    # queued marks a call goes through at most (see above)
        self.bucket_max = min(max(1024, max_blocks >> 4), step)
        # Parent links are not kept: lookup does not need them and they cost ~50 bytes a block.
        self.index = RoutedIndex(PrefixIndexConfig(max_blocks=max_blocks, keep_parents=False), stride)
        self.expiry: deque[tuple[int, float, array | list]] = deque()   # (number, start, blocks)
        self.last_bucket = 0

    def bucket(self, now: float) -> int:
        """The current bucket's number, opening a new one when the current is ttl_s / 16 old or
        holds ``bucket_max`` marks (so the cap can always drop a bounded oldest part, in a
        bounded step)."""
        q = self.expiry
        if q:
            number, start, blocks = q[-1]
            if now < start + max(self.ttl_s / 16, 1e-3) and len(blocks) < self.bucket_max:
                return number
            number += 1
        else:
            number = self.last_bucket + 1
        self.last_bucket = number
        q.append((number, now, array("Q")))
        return number

    def route(self, key: WorkerKey, chain: Sequence[int], held: int = 0, now: float | None = None) -> None:
        """``chain`` was routed to ``key`` (worker id, DP rank); ``held``: the leading blocks
        already found there (see :meth:`RoutedIndex.route`)."""
        if not chain:
            return
        self.bucket(time.monotonic() if now is None else now)
        changed = self.index.route(key, chain, self.last_bucket, held)
        if changed:
            q = self.expiry
            number, start, blocks = q[-1]
            try:
                blocks.extend(changed)
            except OverflowError:      # a hash outside 64 unsigned bits: keep this bucket a list
                q[-1] = (number, start, list(blocks) + [h for h in changed if h not in set(blocks)])
        if self.index.size() > self.max_blocks:
            self.shrink()

    def shrink(self) -> None:
        """Over ``max_blocks``: expire the oldest buckets early, back under the cap at once,
        then down to 255/256 of it within ``step`` queued marks a call (expiring whole buckets
        keeps routed prefixes prefix-closed, which the walk relies on)."""
        q, index, cap = self.expiry, self.index, self.max_blocks
        target = cap - (cap >> 8)
        done = 0
        while q and index.size() > target:
            n = len(q[0][2])
            if done and done + n > self.step and index.size() <= cap:
                return                      # the rest of the margin: the next routings' calls
            number, _, blocks = q.popleft()
            index.evict(blocks, number)
            done += n

    def expire(self, now: float | None = None) -> None:
        """Forget the routings older than ``ttl_s``: at least the oldest due bucket, and more
        while the call has gone through at most ``step`` queued marks (the rest: next calls)."""
        q = self.expiry
        if not q:
            return
        cutoff = (time.monotonic() if now is None else now) - self.ttl_s
        done = 0
        while q and q[0][1] <= cutoff:
            n = len(q[0][2])
            if done and done + n > self.step:
                return
            number, _, blocks = q.popleft()
            self.index.expire(blocks, number)
            done += n
