"""The control plane's KV-cache view: which worker holds how much of a prompt.

Two sources, one answer per worker:
  * exact: workers that publish vLLM KV events feed ``exact`` through a subscriber each;
  * approximate: for workers without events, what was routed where is remembered for
    ``approx_ttl_s`` (the best a router can do when the engine does not say);
  * pending: for workers with events, what was placed there and may not be in their events
    yet, for ``pending_ttl_s`` (kvcache/routed.py says why).
Placement asks :meth:`KVCache.match` once per request and hands the depths to the scorers.

A worker whose events cannot be trusted falls back to approximate tracking until they can:
its subscriber died (the exception is logged), its ``kv_events`` endpoint is malformed, or its
events carry a ``block_size`` other than ``[kv_cache] block_size`` (then no chain the data plane
computes can ever match them, and applying them would only fill the index with unreachable
blocks). Each case is one ERROR line naming the worker and a counter in ``/metrics``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from urllib.parse import urlsplit

from controlplane import validate
from controlplane.kvcache.events import BlockRemoved, BlockStored
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig, RoutedIndex
from controlplane.kvcache.routed import RoutingMemory
from controlplane.kvcache.subscriber import DEFAULT_MAX_REPLAY_GAP, KVEventSource, KVEventSubscriber, LoopBudget
from controlplane.workers import WorkerSpec, WorkerView

log = logging.getLogger(__name__)


@dataclass
class KVCacheConfig:
    """Must match the engines' prefix-cache settings for exact matching."""

    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None        # the engines' PYTHONHASHSEED; None = unset
    lora_key_format: str = "tuple"      # vLLM >= 0.1x: ("lora", name, path); older: "name"
    max_blocks: int = 2_000_000         # bound on indexed blocks (LRU beyond it)
    approx_ttl_s: float = 120.0         # approximate mode: how long a routed prefix counts
    pending_ttl_s: float = 30.0         # evented workers: how long a placed prefix counts before
                                        # its events (its queue + prefill time); 0 = off
    replay_timeout_s: float = 2.0
    max_replay_gap: int = DEFAULT_MAX_REPLAY_GAP   # wider sequence gaps reset the worker instead
    snapshot_interval_s: float = 3.0    # Redis store: index snapshot period (kvcache/persist.py); 0 = off
    routed_stride: int = 16             # routed and pending chains are recorded every this many
                                        # blocks and at their end: depth precision stride - 1 blocks
                                        # (kvcache/routed.py); 1 = every block


def _offset_port(endpoint: str, rank: int) -> str:
    """vLLM publishes DP rank r on the endpoint's port + r."""
    if not rank or not endpoint:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.port is None:
        raise ValueError(f"cannot offset {endpoint!r} for data-parallel rank {rank}")
    return endpoint.replace(f":{parts.port}", f":{parts.port + rank}")


class KVCache:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.exact = PrefixIndex(PrefixIndexConfig(max_blocks=config.max_blocks, keep_parents=False))
        stride = config.routed_stride
        self.routed = RoutingMemory(config.approx_ttl_s, config.max_blocks, stride)
        self.pending = RoutingMemory(config.pending_ttl_s, config.max_blocks, stride) \
            if config.pending_ttl_s > 0 else None
        # Masks of the slots of a routable group, per index generation (see deepest()).
        self._masks: dict[int, list] = {}
        self._tracking = 0          # bumped when a worker's events become (un)trusted
        self._subscribers: dict[str, list[KVEventSubscriber]] = {}
        # worker -> what its subscribers follow (kv_events, kv_replay, dp_size)
        self._following: dict[str, tuple[str, str, int]] = {}
        # One slice of the event loop for every worker's events together (subscriber.py)
        self.budget = LoopBudget()
        # Workers with kv_events whose events are not used (why, for logs and explain): they are
        # tracked approximately instead.
        self.untracked: dict[str, str] = {}
        # worker -> the block_size its events carry, while it differs from config.block_size
        self._wrong_block_size: dict[str, int] = {}
        # per-worker counters kept here rather than in a subscriber (exported with theirs)
        self._counters: dict[str, dict[str, int]] = {}
        # (worker, dp rank) -> topic -> last seq a loaded snapshot had seen (kvcache/persist.py)
        self.resume_seqs: dict[tuple[str, int], dict[bytes, int]] = {}

    @property
    def approx(self) -> RoutedIndex:
        """The approximate index (workers without usable KV events)."""
        return self.routed.index

    # ------------------------------------------------------------------ subscriptions

    async def watch(self, worker: WorkerSpec | WorkerView) -> None:
        """Follow a worker's KV events; no-op for workers without any.

        Idempotent for the same endpoints. A worker that registers again with other ones (an
        engine restarted on another address under the same id, or now without events) is
        followed there instead: the old subscription would wait for events that never come
        while the index kept blocks the restarted engine no longer has.

        Never raises: an endpoint that cannot be used leaves the worker on approximate tracking,
        logged, because this runs in a background task where an exception would go unseen.
        """
        if isinstance(worker, WorkerView):
            worker = worker.spec
        following = (worker.kv_events, worker.kv_replay, worker.dp_size)
        if worker.id in self._subscribers:
            if self._following.get(worker.id) == following:
                return
            log.info("worker %s: KV events now at %r (were at %r)", worker.id, worker.kv_events,
                     self._following.get(worker.id, ("",))[0])
            await self._stop_following(worker.id)
        if not worker.kv_events:
            return
        subs: list[KVEventSubscriber] = []
        try:
            dp_size = validate.int_range(worker.dp_size, "dp_size", 1, 1024)
            validate.kv_endpoint(worker.kv_events, "kv_events", dp_size)
            validate.kv_endpoint(worker.kv_replay, "kv_replay", dp_size)
            for rank in range(dp_size):
                source = KVEventSource(engine_key=worker.id, endpoint=_offset_port(worker.kv_events, rank),
                                       replay_endpoint=_offset_port(worker.kv_replay, rank) or None)
                sub = KVEventSubscriber(source, self._on_events, self._on_reset,
                                        replay_timeout_s=self.config.replay_timeout_s,
                                        max_replay_gap=self.config.max_replay_gap, on_failed=self._on_failed,
                                        budget=self.budget)
                subs.append(sub)
                resume = self.resume_seqs.pop((worker.id, rank), None)
                if resume and source.replay_endpoint:
                    sub.resume_from(resume)   # a loaded snapshot: replay what it missed (persist.py)
                await sub.start()
        except Exception as exc:  # noqa: BLE001 - zmq raises its own types for bad endpoints
            for sub in subs:
                await sub.stop()
            self._count(worker.id, "subscribe_failed")
            self._untrack(worker.id, f"cannot follow KV events at {worker.kv_events!r}: {exc}")
            return
        self._subscribers[worker.id] = subs
        self._following[worker.id] = following
        if self.untracked.pop(worker.id, None) is not None:
            self._tracking += 1
        log.info("worker %s: following KV events at %s (%d rank(s))", worker.id, worker.kv_events, len(subs))

    async def _stop_following(self, worker_id: str) -> None:
        """End a worker's subscriptions and forget what its events said."""
        self._following.pop(worker_id, None)
        for sub in self._subscribers.pop(worker_id, []):
            await sub.stop()
        self.exact.drop_worker(worker_id)

    async def unwatch(self, worker_id: str) -> None:
        await self._stop_following(worker_id)
        self.approx.drop_worker(worker_id)
        if self.pending is not None:
            self.pending.index.drop_worker(worker_id)
        if self.untracked.pop(worker_id, None) is not None:
            self._tracking += 1
        self._wrong_block_size.pop(worker_id, None)
        self._counters.pop(worker_id, None)

    def tracked_exactly(self, worker: WorkerSpec | WorkerView) -> bool:
        """Whether placement may use this worker's event-fed entries."""
        return bool(worker.kv_events) and worker.id not in self.untracked

    def _untrack(self, worker_id: str, why: str) -> None:
        """Stop using a worker's events: its exact entries go, routing-based tracking takes over."""
        if worker_id not in self.untracked:
            log.error("worker %s: %s; its prefix cache is now tracked approximately", worker_id, why)
        self.untracked[worker_id] = why
        self._tracking += 1
        self.exact.drop_worker(worker_id)

    def _on_failed(self, engine: str, exc: BaseException) -> None:
        # the subscriber already logged the exception with its traceback
        self._untrack(engine, f"KV-event subscriber stopped ({type(exc).__name__}: {exc})")

    def _count(self, worker_id: str, kind: str, n: int = 1) -> None:
        c = self._counters.setdefault(worker_id, {})
        c[kind] = c.get(kind, 0) + n

    async def stop(self) -> None:
        for worker_id in list(self._subscribers):
            await self.unwatch(worker_id)

    def _on_events(self, engine: str, dp_rank: int | None, events) -> None:
        expected = self.config.block_size
        for ev in events:
            if type(ev) is BlockStored and ev.block_size != expected:
                self._refuse_block_size(engine, ev.block_size)
                return
            if type(ev) is BlockStored and engine in self._wrong_block_size:
                # the engine came back with the right size (restarted with a fixed config)
                del self._wrong_block_size[engine]
                if self.untracked.pop(engine, None) is not None:
                    self._tracking += 1
                    self.approx.drop_worker(engine)
                    log.warning("worker %s: KV events now carry block_size %d: following them again",
                                engine, expected)
        if engine in self.untracked:
            return  # never populate the index from events we decided not to trust
        self.exact.apply(engine, dp_rank, events)
        pending = self.pending
        if pending is not None and engine in pending.index.worker_ids():
            # What the engine evicted is gone, whatever was placed there before: a pending
            # prefix must not outlive the blocks' own removal (a hole deeper in a pending chain
            # may still be galloped over until it expires: the same estimate as without it).
            gone = [h for ev in events if type(ev) is BlockRemoved for h in ev.block_hashes]
            if gone:
                pending.index.remove((engine, dp_rank or 0), gone)

    def _refuse_block_size(self, engine: str, got: int) -> None:
        self._count(engine, "block_size_mismatch")
        if self._wrong_block_size.get(engine) != got:
            self._wrong_block_size[engine] = got
            self.untracked.pop(engine, None)  # log this reason even if another one came first
            self._untrack(engine, f"KV events carry block_size {got} but [kv_cache] block_size is "
                                  f"{self.config.block_size}: its events are refused until they match")

    def event_seqs(self) -> dict[str, list[Mapping[bytes, int]]]:
        """Per followed worker, per DP rank: topic -> the last event sequence number seen."""
        return {wid: [sub.last_seqs for sub in subs] for wid, subs in self._subscribers.items()}

    def last_event_seq(self, worker_id: str) -> int:
        """The highest event sequence number seen from the worker (any rank); -1 if none."""
        return max((max(sub.last_seqs.values(), default=-1) for sub in self._subscribers.get(worker_id, ())),
                   default=-1)

    def _on_reset(self, engine: str) -> None:
        # A gap we could not replay: what we believed about this engine may be wrong.
        self.exact.reset_worker(engine)

    def counters(self) -> dict[str, dict[str, int]]:
        """Per worker: its subscribers' counters summed over DP ranks, plus this view's own
        (``block_size_mismatch``: refused batches; ``subscribe_failed``: unusable endpoint)."""
        out: dict[str, dict[str, int]] = {}
        for worker_id, subs in self._subscribers.items():
            total: dict[str, int] = {}
            for sub in subs:
                for k, v in vars(sub.counters).items():
                    total[k] = total.get(k, 0) + v
            out[worker_id] = total
        for worker_id, mine in self._counters.items():
            total = out.setdefault(worker_id, {})
            for k, v in mine.items():
                total[k] = total.get(k, 0) + v
        return out

    # ------------------------------------------------------------------ placement

    def match(self, chain: Sequence[int], workers: list[WorkerView] | list[WorkerSpec]) -> dict[str, int]:
        """Per worker id, the number of leading blocks of ``chain`` it holds (0 omitted).

        DP ranks of one worker count as the best rank: the engine routes within itself. A
        worker with events holds what its events say or what was placed there and may not be in
        them yet, whichever is deeper. Costs one chain walk per index in use plus a step per
        candidate: never the fleet.
        """
        if not chain:
            return {}
        self._expire()
        exact_ids: list[str] = []
        approx_ids: list[str] = []
        untracked = self.untracked
        for w in workers:
            spec = w.spec if isinstance(w, WorkerView) else w
            (exact_ids if spec.kv_events and spec.id not in untracked else approx_ids).append(spec.id)
        out = self.exact.depths(chain, self.exact.mask_of(exact_ids)) if exact_ids else {}
        if exact_ids and self.pending is not None:
            pending = self.pending.index
            _deeper(out, pending.depths(chain, pending.mask_of(exact_ids)))
        if approx_ids:
            _deeper(out, self.approx.depths(chain, self.approx.mask_of(approx_ids)))
        return out

    def _group_masks(self, ids: tuple[str, ...]) -> tuple[int, int, int]:
        """(exact, approximate, pending) slot masks of the workers ``ids``: built in O(group) once
        per tuple (the fleet keeps one per routable group until it changes), then kept current by
        adding the slots the indexes created since (first events or placements of a worker),
        so a placement pays O(1) plus O(new slots)."""
        exact, approx = self.exact, self.approx
        pending = self.pending.index if self.pending is not None else None
        p_gen, p_added = (pending.generation, len(pending.added)) if pending is not None else (0, 0)
        got = self._masks.get(id(ids))
        if got is None or got[0] is not ids or got[2] != exact.generation or got[4] != approx.generation \
                or got[6] != self._tracking or got[9] != p_gen:
            members = frozenset(ids)
            held_exactly = exact.worker_ids()
            exact_mask = exact.mask_of(ids)
            approx_mask = approx.mask_of([i for i in ids if i not in held_exactly])
            # Pending placements count for the workers followed by events (not the untracked).
            untracked = self.untracked
            pending_mask = pending.mask_of([i for i in ids if i not in untracked]) if pending is not None else 0
            if len(self._masks) >= 64:
                self._masks.clear()
            self._masks[id(ids)] = [ids, members, exact.generation, len(exact.added), approx.generation,
                                    len(approx.added), self._tracking, exact_mask, approx_mask,
                                    p_gen, p_added, pending_mask]
            return exact_mask, approx_mask, pending_mask
        members, exact_mask, approx_mask, pending_mask = got[1], got[7], got[8], got[11]
        if got[3] != len(exact.added):
            for slot, wid in exact.added[got[3]:]:
                if wid in members:
                    exact_mask |= 1 << slot
                    approx_mask &= ~approx.mask_of((wid,))   # its events now count, not its routing
            got[3], got[7], got[8] = len(exact.added), exact_mask, approx_mask
        if got[5] != len(approx.added):
            held_exactly = exact.worker_ids()
            for slot, wid in approx.added[got[5]:]:
                if wid in members and wid not in held_exactly:
                    approx_mask |= 1 << slot
            got[5], got[8] = len(approx.added), approx_mask
        if pending is not None and got[10] != p_added:
            untracked = self.untracked
            for slot, wid in pending.added[got[10]:]:
                if wid in members and wid not in untracked:
                    pending_mask |= 1 << slot
            got[10], got[11] = p_added, pending_mask
        return exact_mask, approx_mask, pending_mask

    def group_match(self, chain: Sequence[int], ids: tuple[str, ...], k: int, rng: random.Random) -> GroupMatch:
        """Walk ``chain`` once per index over the whole group ``ids`` (its masks are cached per
        tuple): ``.top`` names up to ``k`` workers holding the deepest matches, ``.depths(some)``
        gives any members' depths from the same walk. O(chain + k), whatever the group size."""
        self._expire()
        exact_mask, approx_mask, pending_mask = self._group_masks(ids)
        pending = self.pending.index if self.pending is not None and pending_mask else None
        return GroupMatch(self, self.exact.levels(chain, exact_mask), self.approx.levels(chain, approx_mask),
                          pending.levels(chain, pending_mask) if pending is not None else [], k, rng)

    def deepest(self, chain: Sequence[int], ids: tuple[str, ...], k: int, rng: random.Random) -> dict[str, int]:
        """Up to ``k`` of the workers ``ids`` holding the deepest matches of ``chain``."""
        return self.group_match(chain, ids, k, rng).top if chain and k > 0 else {}

    def rank_depths(self, chain: Sequence[int], worker: WorkerSpec | WorkerView) -> dict[int, int]:
        """Per DP rank of ``worker``, the leading blocks of ``chain`` that rank holds (0 omitted):
        from its events (and its pending placements) when tracked exactly, else from the
        prefixes routed to each rank."""
        if not chain:
            return {}
        keys = [(worker.id, r) for r in range(max(worker.spec.dp_size if isinstance(worker, WorkerView)
                                                  else worker.dp_size, 1))]
        if not self.tracked_exactly(worker):
            return {key[1]: depth for key, depth in self.approx.match_depths(chain, keys).items()}
        out = {key[1]: depth for key, depth in self.exact.match_depths(chain, keys).items()}
        if self.pending is not None:
            _deeper(out, {key[1]: d for key, d in self.pending.index.match_depths(chain, keys).items()})
        return out

    def placed(self, worker: WorkerSpec | WorkerView, chain: Sequence[int], predicted_depth: int,
               dp_rank: int = 0) -> None:
        """Remember the placed prefix: for workers without events until ``approx_ttl_s``, for
        the others as pending until ``pending_ttl_s`` (and keep its matched part recent in the
        event-fed index)."""
        if not chain:
            return
        if not self.tracked_exactly(worker):
            self.routed.route((worker.id, dp_rank), chain, predicted_depth)
            return
        if predicted_depth:
            self.exact.touch(chain[:predicted_depth])
        if self.pending is not None:
            # (the depth found is a hint: route() skips the marks up to it only where they
            # were routed to this worker in this bucket already)
            self.pending.route((worker.id, dp_rank), chain, predicted_depth)

    def _expire(self) -> None:
        self.routed.expire()
        if self.pending is not None:
            self.pending.expire()

    def cached_blocks(self, worker_ids: Sequence[str] | None = None) -> dict[str, int]:
        """Blocks each worker holds, by events or by routing (only ``worker_ids``, if given)."""
        out = self.exact.blocks_by_worker(worker_ids)
        for worker_id, n in self.approx.blocks_by_worker(worker_ids).items():
            out[worker_id] = out.get(worker_id, 0) + n
        return out


def _deeper(out: dict, got: dict) -> None:
    """Merge ``got`` into ``out``, keeping the deeper depth per key."""
    if not out:
        out.update(got)
        return
    for key, depth in got.items():
        if depth > out.get(key, 0):
            out[key] = depth


class GroupMatch:
    """One walk of a prompt's chain over a whole routable group (see ``KVCache.group_match``)."""

    __slots__ = ("top", "_kv", "_exact", "_approx", "_pending")

    def __init__(self, kv: KVCache, exact: list[tuple[int, int]], approx: list[tuple[int, int]],
                 pending: list[tuple[int, int]], k: int, rng: random.Random) -> None:
        self._kv, self._exact, self._approx, self._pending = kv, exact, approx, pending
        top = kv.exact.top(exact, k, rng) if exact else {}
        merged = False
        for levels, index in ((approx, kv.approx), (pending, kv.pending.index if pending and kv.pending else None)):
            if levels:
                assert index is not None   # pending levels come from the pending index
                _deeper(top, index.top(levels, k, rng))
                merged = True
        if merged and len(top) > k:
            top = dict(sorted(top.items(), key=itemgetter(1), reverse=True)[:k])   # (stable: ties keep their order)
        self.top = top

    def depths(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Leading blocks held, per member of the group among ``worker_ids`` (0 omitted). (The
        walks ran over the group's masks, so their levels hold members only.)"""
        kv = self._kv
        out = kv.exact.depths_among(self._exact, worker_ids) if self._exact else {}
        if self._approx:
            _deeper(out, kv.approx.depths_among(self._approx, worker_ids))
        if self._pending:
            assert kv.pending is not None   # pending levels come from the pending index
            _deeper(out, kv.pending.index.depths_among(self._pending, worker_ids))
        return out
