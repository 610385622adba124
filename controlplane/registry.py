"""Adding, changing and removing workers, whoever asks: config, engine plugins, operators.

The one place where worker specs change: each change builds a new immutable spec, writes
it to the store (shared, durable) and to this replica's fleet view.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from controlplane.admin_state import AdminState
from controlplane.fleet import Fleet
from controlplane.hooks import WorkerEvents
from controlplane.state import StateStore
from controlplane.workers import Role, WorkerSpec, normalize_url

log = logging.getLogger(__name__)


def worker_id_for(url: str, role: Role) -> str:
    """The id a worker gets when none is given: its role and address."""
    host = re.sub(r"^https?://", "", url)
    return f"{role.value}-{re.sub(r'[^A-Za-z0-9.-]+', '-', host)}"


class WorkerRegistry:
    def __init__(self, store: StateStore, fleet: Fleet, *, heartbeat_interval_s: float = 2.0,
                 heartbeat_ttl_s: float = 10.0, admin: AdminState | None = None,
                 events: WorkerEvents | None = None) -> None:
        self.store = store
        self.fleet = fleet
        # Operators' weights, drains, additions and removals (the fence): see admin_state.py.
        self.admin = admin if admin is not None else AdminState()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        # Emitted for each worker added (so it is health-checked at once, not next round) or
        # removed; the spec sync emits on the same hooks for other replicas' changes.
        self.events = events if events is not None else WorkerEvents()
        self._tasks: set[asyncio.Future] = set()

    async def add(self, *, url: str, role: Role, model: str = "", weight: float | None = None,
                  worker_id: str = "", labels: dict[str, str] | None = None, bootstrap_port: int = 0,
                  source: str = "config", heartbeat_ttl_s: float = 0.0, kv_events: str = "",
                  kv_replay: str = "", dp_size: int = 1, owner: str | None = None,
                  owner_key: str | None = None, default_weight: float = 1.0,
                  draining: bool | None = None) -> WorkerSpec:
        """Add a worker or overwrite the one with its id. Callers check who may do that first
        (AdminService.AddWorker: ``replace``; RegistryService: controlplane/ownership.py).
        ``owner`` / ``owner_key`` None: the existing worker's are kept. ``weight`` None: the
        operator's weight is kept (the worker's current one, else the one an operator set before,
        e.g. before a restart or while the engine was away), else ``default_weight`` (the
        config's or the registration's). The drain flag is kept the same way."""
        url = normalize_url(url)
        worker_id = worker_id or worker_id_for(url, role)
        existing = self.fleet.get(worker_id)
        kept = self.admin.override(worker_id)
        if weight is None:
            weight = existing.weight if existing is not None else float(kept.get("weight", default_weight))
        if draining is None:
            draining = existing.draining if existing is not None else bool(kept.get("draining", False))
        spec = WorkerSpec(id=worker_id, url=url, role=role, model=model or (existing.model if existing else ""),
                          weight=weight, draining=draining,
                          source=existing.source if existing else source, bootstrap_port=bootstrap_port,
                          labels=dict(labels or {}), kv_events=kv_events, kv_replay=kv_replay, dp_size=dp_size,
                          heartbeat_ttl_s=heartbeat_ttl_s,
                          owner=owner if owner is not None else (existing.owner if existing else ""),
                          owner_key=owner_key if owner_key is not None else (existing.owner_key if existing else ""))
        await self._put(spec)
        self.fleet.beat(worker_id, time.monotonic())
        if existing is None:
            log.info("worker %s added (%s, %s, source=%s)", worker_id, url, role.value, source)
        if self.events.added:
            # Re-registration (engine restart, plugin reconnect) keeps the load: it is
            # in the ledger, keyed by id.
            task = asyncio.ensure_future(self.events.added.emit(spec))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return spec

    async def update(self, worker_id: str, **changes) -> WorkerSpec | None:
        """Replace fields of a worker's spec (drain, weight, a discovered model)."""
        spec = self.fleet.get(worker_id)
        if spec is None:
            return None
        new = dataclasses.replace(spec, **changes)
        if new != spec:
            await self._put(new)
        return new

    async def _put(self, spec: WorkerSpec) -> None:
        await self.store.put_spec(spec)
        self.fleet.put(spec)

    async def remove(self, worker_id: str) -> bool:
        removed = self.fleet.remove(worker_id)
        await self.store.remove_spec(worker_id)
        if removed is None:
            return False
        load = await self.store.forget_worker(worker_id)
        await self.events.removed.emit(worker_id)
        log.info("worker %s removed (%d requests were in flight)", worker_id, load.requests)
        return True

    def heartbeat(self, worker_id: str, running: int = -1, waiting: int = -1) -> bool:
        if worker_id not in self.fleet:
            return False
        now = time.monotonic()
        self.fleet.beat(worker_id, now)
        if running >= 0:
            old = self.fleet.engine(worker_id)
            self.fleet.set_engine(worker_id, dataclasses.replace(old, running=running, waiting=max(waiting, 0),
                                                                 updated_at=now))
        return True

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

