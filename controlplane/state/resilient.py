"""A shared store with a local ledger behind it: placement goes on while Redis is away.

When the shared store (Redis) cannot be reached, a placement must not fail: this replica
still knows the workers (its fleet) and what it placed itself. So a reservation that the
shared store refuses lands in a local ledger instead, and everything about that request
(release, end, settle) stays local until it ends. Loads then come from the local ledger
(what this replica placed during the outage) added to the shared ones when they can be
read. Once the shared store answers again the replica is back on it at once; requests
placed during the outage finish on the local ledger. Spec changes are not buffered: an
operator's change during an outage is refused (``StoreUnavailable``) rather than lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from controlplane.state.base import Charge, RequestRecord, StateStore, StoreUnavailable
from controlplane.state.memory import MemoryStore
from controlplane.workers import Load, WorkerSpec

log = logging.getLogger(__name__)


class ResilientStore:
    def __init__(self, shared: StateStore, local: MemoryStore | None = None) -> None:
        self.shared = shared
        self.local = local or MemoryStore()
        self._local_ids: set[str] = set()
        self.available = True
        self.outages = 0
        self.local_reservations = 0
        self._down_since = 0.0

    def __getattr__(self, name: str):
        # heartbeat, maintain, close, watch_specs, spec_version... belong to the shared store
        return getattr(self.shared, name)

    def _lost(self, exc: StoreUnavailable) -> None:
        if self.available:
            self.available = False
            self.outages += 1
            self._down_since = time.monotonic()
            log.error("state store unavailable (%s): placing from this replica's memory until it is back", exc)

    def _ok(self) -> None:
        if not self.available:
            self.available = True
            log.warning("state store is back after %.1fs (%d requests placed locally meanwhile)",
                        time.monotonic() - self._down_since, self.local_reservations)

    # ------------------------------------------------------------------ specs: shared only

    async def put_spec(self, spec: WorkerSpec) -> None:
        await self.shared.put_spec(spec)

    async def remove_spec(self, worker_id: str) -> WorkerSpec | None:
        return await self.shared.remove_spec(worker_id)

    async def specs(self) -> list[WorkerSpec]:
        return await self.shared.specs()

    # ------------------------------------------------------------------ ledger

    async def reserve(self, record: RequestRecord, charges: tuple[Charge, ...], **notes) -> RequestRecord:
        rid = record.request_id
        if rid not in self._local_ids:
            try:
                got = await self.shared.reserve(record, charges, **notes)
                self._ok()
                return got
            except StoreUnavailable as exc:
                self._lost(exc)
                self._local_ids.add(rid)
                self.local_reservations += 1
        return await self.local.reserve(record, charges, **notes)

    async def _either(self, method: str, request_id: str, **kw):
        if request_id in self._local_ids:
            return await getattr(self.local, method)(request_id, **kw)
        try:
            got = await getattr(self.shared, method)(request_id, **kw)
            self._ok()
            return got
        except StoreUnavailable as exc:
            self._lost(exc)
            return None   # the shared record stays; the replica sweep or the age limit frees it

    async def release(self, request_id: str, *, leg: str = "", worker_id: str = "") -> RequestRecord | None:
        return await self._either("release", request_id, leg=leg, worker_id=worker_id)

    async def end(self, request_id: str) -> RequestRecord | None:
        got = await self._either("end", request_id)
        self._local_ids.discard(request_id)
        return got

    async def settle_prefill(self, request_id: str) -> RequestRecord | None:
        return await self._either("settle_prefill", request_id)

    async def get(self, request_id: str) -> RequestRecord | None:
        return await self._either("get", request_id)

    async def records(self) -> list[RequestRecord]:
        local = await self.local.records()
        try:
            shared = await self.shared.records()
            self._ok()
        except StoreUnavailable as exc:
            self._lost(exc)
            shared = []
        return shared + local

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        ids = list(worker_ids)
        local = await self.local.loads(ids) if self._local_ids else None
        try:
            shared = await self.shared.loads(ids)
            self._ok()
        except StoreUnavailable as exc:
            self._lost(exc)
            return local if local is not None else await self.local.loads(ids)
        if local is None:
            return shared
        return {i: Load(shared[i].requests + local[i].requests, shared[i].tokens + local[i].tokens,
                        shared[i].prefill_tokens + local[i].prefill_tokens, shared[i].prefills + local[i].prefills)
                for i in ids}

    async def forget_worker(self, worker_id: str) -> Load:
        await self.local.forget_worker(worker_id)
        try:
            return await self.shared.forget_worker(worker_id)
        except StoreUnavailable as exc:
            self._lost(exc)
            return Load()

    async def orphan(self, session: str, now: float) -> int:
        n = await self.local.orphan(session, now)
        try:
            return n + await self.shared.orphan(session, now)
        except StoreUnavailable as exc:
            self._lost(exc)
            return n

    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        ids = list(request_ids)
        n = await self.local.claim(session, [i for i in ids if i in self._local_ids])
        try:
            return n + await self.shared.claim(session, [i for i in ids if i not in self._local_ids])
        except StoreUnavailable as exc:
            self._lost(exc)
            return n

    async def orphans(self, cutoff: float) -> list[str]:
        out = await self.local.orphans(cutoff)
        try:
            return out + await self.shared.orphans(cutoff)
        except StoreUnavailable as exc:
            self._lost(exc)
            return out
