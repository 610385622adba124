"""Adding, refreshing and removing workers, whoever asks: config, engine plugins, operators."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

from controlplane.state import StateStore
from controlplane.workers import Role, Worker, normalize_url

log = logging.getLogger(__name__)


def _id_from_url(url: str, role: Role) -> str:
    host = re.sub(r"^https?://", "", url)
    return f"{role.value}-{re.sub(r'[^A-Za-z0-9.-]+', '-', host)}"


class WorkerRegistry:
    def __init__(self, store: StateStore, *, heartbeat_interval_s: float = 2.0,
                 heartbeat_ttl_s: float = 10.0) -> None:
        self.store = store
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        # Called for each new worker so it can be health-checked at once, not next round.
        self.on_added: Callable[[Worker], Awaitable[None]] | None = None
        self.on_removed: Callable[[str], Awaitable[None]] | None = None

    async def add(self, *, url: str, role: Role, model: str = "", weight: float = 1.0,
                  worker_id: str = "", labels: dict[str, str] | None = None, bootstrap_port: int = 0,
                  source: str = "config", heartbeat_ttl_s: float = 0.0, kv_events: str = "",
                  kv_replay: str = "", dp_size: int = 1) -> Worker:
        url = normalize_url(url)
        worker_id = worker_id or _id_from_url(url, role)
        existing = await self.store.get_worker(worker_id)
        if existing is not None:
            # Re-registration (engine restart, plugin reconnect): refresh, keep the load.
            existing.url, existing.role, existing.weight = url, role, weight
            existing.model = model or existing.model
            existing.labels = dict(labels or {})
            existing.bootstrap_port = bootstrap_port
            existing.heartbeat_ttl_s = heartbeat_ttl_s
            existing.kv_events, existing.kv_replay, existing.dp_size = kv_events, kv_replay, dp_size
            existing.last_heartbeat = time.monotonic()
            worker = existing
        else:
            worker = Worker(id=worker_id, url=url, role=role, model=model, weight=weight, source=source,
                            labels=dict(labels or {}), bootstrap_port=bootstrap_port,
                            heartbeat_ttl_s=heartbeat_ttl_s, kv_events=kv_events, kv_replay=kv_replay,
                            dp_size=dp_size)
            await self.store.upsert_worker(worker)
            log.info("worker %s added (%s, %s, source=%s)", worker.id, url, role.value, source)
        if self.on_added is not None:
            asyncio.ensure_future(self.on_added(worker))
        return worker

    async def remove(self, worker_id: str) -> bool:
        removed = await self.store.remove_worker(worker_id)
        if removed is not None and self.on_removed is not None:
            await self.on_removed(worker_id)
        if removed is not None:
            log.info("worker %s removed (%d requests were in flight)", worker_id, removed.inflight_requests)
        return removed is not None

    async def heartbeat(self, worker_id: str, running: int = -1, waiting: int = -1) -> bool:
        worker = await self.store.get_worker(worker_id)
        if worker is None:
            return False
        worker.last_heartbeat = time.monotonic()
        if running >= 0:
            worker.engine.running = running
            worker.engine.waiting = max(waiting, 0)
            worker.engine.updated_at = worker.last_heartbeat
        return True
