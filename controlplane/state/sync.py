"""Keep one replica's :class:`~controlplane.fleet.Fleet` in step with the specs in a shared store.

Every replica places from its own ``Fleet`` (specs plus its own health view). When specs
live in Redis, another replica's change (``omni-ctl add``/``drain``/``weight``, an engine
registering there, a removal) must reach this replica's fleet too. :class:`SpecSync` does
it: a full read at start, then one read per change announced on the store's pub/sub
channel, and a version poll every ``poll_interval_s`` in case a message was lost. When
Redis goes away it keeps the fleet as it is (placement goes on from memory), and re-reads
everything once Redis answers again. A Redis that comes back *without its data* (no
persistence, a new pod, a flush) is told apart by the store's epoch
(``RedisStore.spec_epoch``): the specs were lost, not removed, so this replica writes its
last view back (``_restore``) rather than empty its fleet.

Wiring (one per replica, built by ``controlplane/compose.py`` with the registry's hooks)::

    sync = SpecSync(store, fleet, events=registry.events)
    await sync.refresh()                  # optional: be in step before serving
    task = asyncio.create_task(sync.run())
    ...
    task.cancel()

``events.added`` is emitted with each spec that is new to this replica (health-check it,
watch its KV events); ``events.removed`` with each id another replica removed (forget its
predictor model, stop its KV subscription), as for the registry's own changes. Changes to
known specs (drain, weight) only replace the spec. A store that cannot announce changes
(not :class:`~controlplane.state.base.WatchableSpecs`) is simply polled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from controlplane.fleet import Fleet
from controlplane.hooks import WorkerEvents
from controlplane.state.base import StateStore, StoreUnavailable, VersionedSpecs, WatchableSpecs
from controlplane.workers import WorkerSpec

log = logging.getLogger(__name__)


def _reraise_cancel() -> None:
    """redis-py can swallow a cancel that lands mid-call (or turn it into a connection
    error): a cancelled loop must still stop."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():
        raise asyncio.CancelledError


class SpecSync:
    def __init__(self, store: StateStore, fleet: Fleet, *, events: WorkerEvents | None = None,
                 poll_interval_s: float = 5.0, retry_s: float = 1.0) -> None:
        self.store = store
        self.fleet = fleet
        self.events = events if events is not None else WorkerEvents()
        self.poll_interval_s = poll_interval_s
        self.retry_s = retry_s
        self.version = -1           # the store's spec version this fleet reflects; -1: never read
        self.refreshes = 0
        self.epoch = ""             # the store's epoch when last read ("" never): see refresh()
        self.restores = 0           # times the store came back empty and the fleet was written back
        self.connected = False      # for /health and /metrics: False while the store is away

    async def refresh(self) -> tuple[list[str], list[str]]:
        """Read every spec and make the fleet match; returns (added or changed ids, removed ids)."""
        store = self.store
        if isinstance(store, VersionedSpecs):
            epoch = await store.spec_epoch()
            if self.epoch and epoch != self.epoch:
                await self._restore()
            self.epoch = epoch   # (only once restored: a restore cut short is tried again)
            version, specs = await store.specs_versioned()
        else:
            version, specs = 0, await self.store.specs()
        changed, removed = [], []
        wanted = {s.id: s for s in specs}
        now = time.monotonic()
        for spec in specs:
            old = self.fleet.get(spec.id)
            if old != spec:
                self.fleet.put(spec)
                changed.append(spec.id)
                if old is None:
                    # Its heartbeats (if it sends any) go to the replica it registered with:
                    # start its clock here so this replica does not expire it at once.
                    self.fleet.beat(spec.id, now, local=False)
                if old is None or _reached_elsewhere(old, spec):
                    # new, or registered again at another address (an engine restarted under
                    # the same id): check it and follow its KV events there
                    await self.events.added.emit(spec)   # (a failing subscriber is logged there)
        for spec in self.fleet.specs():
            if spec.id not in wanted:
                self.fleet.remove(spec.id)
                removed.append(spec.id)
                await self.events.removed.emit(spec.id)
        self.version = version
        self.refreshes += 1
        if changed or removed:
            log.info("specs from the store (version %d): %d added or changed, %d removed",
                     version, len(changed), len(removed))
        return changed, removed

    async def _restore(self) -> None:
        """The store lost its data (a Redis without persistence restarted, or was flushed):
        every worker vanished from it at once, which no operator did. Write back this
        replica's last view (its config's workers, and the added and registered ones it
        knew, with their weights and drain flags) instead of emptying the fleet. Every
        replica does so, so the store gets the union of their views; a registered engine
        that was gone meanwhile expires as usual, and one that registered only on a replica
        that died re-registers when its heartbeat is answered "unknown"."""
        specs = self.fleet.specs()
        for spec in specs:
            await self.store.put_spec(spec)
        self.restores += 1
        log.warning("spec sync: the store came back without its data (restarted empty?): "
                    "wrote back the %d workers this replica knew", len(specs))

    async def run(self) -> None:
        """Follow the store until cancelled."""
        down = False
        while True:
            _reraise_cancel()
            try:
                await self.refresh()
                self.connected = True
                if down:
                    log.warning("spec sync: store is back; fleet re-read")
                down = False
                await self._follow()
            except StoreUnavailable as exc:
                _reraise_cancel()
                self.connected = False
                if not down:
                    log.error("spec sync: %s; placing with the specs already known", exc)
                down = True
                await asyncio.sleep(self.retry_s)

    async def _follow(self) -> None:
        store = self.store
        if not isinstance(store, WatchableSpecs):
            while True:
                _reraise_cancel()
                await asyncio.sleep(self.poll_interval_s)
                await self.refresh()
        changes = store.watch_specs()
        # A change made between refresh() and the subscription is caught by the version poll.
        pending = asyncio.ensure_future(changes.__anext__())
        try:
            while True:
                _reraise_cancel()
                done, _ = await asyncio.wait({pending}, timeout=self.poll_interval_s)
                if done:
                    change = pending.result()   # raises StoreUnavailable when the channel is lost
                    pending = asyncio.ensure_future(changes.__anext__())
                    if change.version > self.version:
                        await self.refresh()
                elif await store.spec_version() != self.version:
                    await self.refresh()        # a message was lost
        finally:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            await changes.aclose()


def _reached_elsewhere(old: WorkerSpec, new: WorkerSpec) -> bool:
    """Whether a worker's spec moved it (URL or KV-event endpoints), not just re-weighed it."""
    return (old.url, old.kv_events, old.kv_replay, old.dp_size) != (new.url, new.kv_events, new.kv_replay,
                                                                     new.dp_size)
