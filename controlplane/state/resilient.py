"""A shared store with a local ledger behind it: placement goes on while Redis is away.

When the shared store (Redis) cannot be reached, a placement must not fail: this replica
still knows the workers (its fleet) and what it placed itself. So a reservation that the
shared store refuses lands in a local ledger instead, and everything about that request
(release, end, settle) stays local until it ends. Loads then come from the local ledger
(what this replica placed during the outage) added to the shared ones when they can be
read. Spec changes are not buffered: an operator's change during an outage is refused
(``StoreUnavailable``) rather than lost.

**An outage is a circuit, not a per-call wait.** A Redis that refuses connections fails
each call at once, but a hung one (stopped, a full network buffer, a stalled host) makes
every call wait for the operation timeout; a data plane's session is served in order, so
that wait stacked up behind every placement and they timed out (503 after 5 s). So the
first failure opens the circuit: every ledger call goes to the local ledger at once, and a
background probe pings the shared store every ``probe_interval_s``; the circuit closes when
it answers.

**No release is lost.** A release, end, settle, orphan or forget that the shared store
could not take (it failed, or the circuit was open) is kept, per request and in order, and
replayed once the store answers again. A request placed locally also gets a shared ``end``
when it ends: its entry leg may have a shared record (placed before the outage), or the
reserve that failed may still land in Redis (a stalled Redis runs the commands it had
already received when it wakes up). The Redis ``end`` of a record it does not hold leaves a
short-lived tombstone that makes such a late reserve charge nothing
(``controlplane/state/redis.py``), so the order in which the two arrive does not matter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from controlplane.state.base import Charge, RequestRecord, StateStore, StoreUnavailable
from controlplane.state.memory import MemoryStore
from controlplane.workers import Load, WorkerSpec

log = logging.getLogger(__name__)

MAX_PENDING = 1_000_000   # kept shared operations; beyond it the oldest are dropped (and counted)
# How long a kept end's tombstone stops a late reserve: the reserve that a stalled Redis
# runs on waking comes within moments of the replayed end; this leaves a wide margin.
TOMBSTONE_S = 300.0


class PingableStore(StateStore, Protocol):
    """The shared store a ResilientStore wraps: it can be pinged (to know it is back) and closed."""

    async def ping(self) -> bool: ...
    async def close(self) -> None: ...


class ResilientStore:
    def __init__(self, shared: PingableStore, local: MemoryStore | None = None, *,
                 probe_interval_s: float = 0.5) -> None:
        self.shared = shared
        self.local = local or MemoryStore()
        self.probe_interval_s = probe_interval_s
        self._local_ids: set[str] = set()
        self.available = True
        self.outages = 0
        self.local_reservations = 0
        self.replayed = 0           # shared operations applied after an outage
        self.dropped = 0            # kept operations dropped over MAX_PENDING (their records age out)
        self._down_since = 0.0
        # request id (or "" for session / worker operations) -> shared calls to make, in order
        self._pending: dict[str, list[tuple[str, tuple, dict]]] = {}
        self._npending = 0
        self._probe: asyncio.Task | None = None
        if hasattr(shared, "lost_ends"):   # a Redis store's write-behind ends: replay what it lost
            shared.lost_ends = self._end_lost

    def __getattr__(self, name: str):
        # heartbeat, maintain, watch_specs, spec_version... belong to the shared store
        return getattr(self.shared, name)

    @property
    def pending(self) -> int:
        """Shared operations waiting for the store (for /metrics and tests)."""
        return self._npending

    def _lost(self, exc: StoreUnavailable) -> None:
        if self.available:
            self.available = False
            self.outages += 1
            self._down_since = time.monotonic()
            log.error("state store unavailable (%s): placing from this replica's memory until it is back", exc)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        """Ping until the store answers, then close the circuit and replay what was kept."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.shared.ping()
            except StoreUnavailable:
                continue
            if not self.available:
                self.available = True
                log.warning("state store is back after %.1fs (%d requests placed locally meanwhile; "
                            "%d operations to replay)", time.monotonic() - self._down_since,
                            self.local_reservations, self._npending)
            if await self._replay():
                return

    async def _replay(self) -> bool:
        """Apply the kept operations in order; False (circuit open again) if the store failed."""
        while self._pending:
            key = next(iter(self._pending))
            ops = self._pending[key]
            while ops:
                method, args, kw = ops[0]
                try:
                    await getattr(self.shared, method)(*args, **kw)
                except StoreUnavailable as exc:
                    self._lost_quietly(exc)
                    return False
                ops.pop(0)
                self._npending -= 1
                self.replayed += 1
            if self._pending.get(key) is ops:
                del self._pending[key]
        return True

    def _lost_quietly(self, exc: StoreUnavailable) -> None:
        """A failure inside the probe task: open the circuit without starting another probe."""
        if self.available:
            self.available = False
            self.outages += 1
            self._down_since = time.monotonic()
            log.error("state store unavailable (%s): placing from this replica's memory until it is back", exc)

    def _end_lost(self, request_id: str, exc: BaseException) -> None:
        """A write-behind end that Redis did not confirm (the shared store answered it from its
        copy before sending it): kept and replayed like an end that failed outright. A broken
        connection or a timeout is an outage; an error reply (a flushed script cache) is not."""
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
            self._lost(StoreUnavailable(f"a write-behind end failed ({type(exc).__name__}: {exc})"))
        self._keep(request_id, "end", request_id, tombstone_s=TOMBSTONE_S)

    def _keep(self, key: str, method: str, *args, **kw) -> None:
        """A shared operation for later: replayed, in order per request, once the store is back."""
        if self._npending >= MAX_PENDING:
            oldest = next(iter(self._pending))
            self._npending -= len(self._pending.pop(oldest))
            self.dropped += 1
        self._pending.setdefault(key, []).append((method, args, kw))
        self._npending += 1
        if self.available and (self._probe is None or self._probe.done()):
            self._probe = asyncio.ensure_future(self._recover())   # the store may be up: replay soon

    def _shared_now(self, key: str) -> bool:
        """Call the shared store now: it is up, and nothing is kept for ``key`` (order)."""
        return self.available and key not in self._pending

    # ------------------------------------------------------------------ specs: shared only

    async def put_spec(self, spec: WorkerSpec) -> None:
        await self.shared.put_spec(spec)

    async def remove_spec(self, worker_id: str) -> WorkerSpec | None:
        return await self.shared.remove_spec(worker_id)

    async def specs(self) -> list[WorkerSpec]:
        return await self.shared.specs()

    # ------------------------------------------------------------------ ledger

    async def reserve(self, record: RequestRecord, charges: tuple[Charge, ...], *, charged: bool = False,
                      **notes) -> RequestRecord | None:
        rid = record.request_id
        if rid not in self._local_ids:
            if self._shared_now(rid):
                try:
                    return await self.shared.reserve(record, charges, charged=charged, **notes)
                except StoreUnavailable as exc:
                    self._lost(exc)
            self._local_ids.add(rid)
            self.local_reservations += 1
        return await self.local.reserve(record, charges, charged=charged, **notes)

    async def _either(self, method: str, request_id: str, **kw):
        if request_id in self._local_ids:
            return await getattr(self.local, method)(request_id, **kw)
        if self._shared_now(request_id):
            try:
                return await getattr(self.shared, method)(request_id, **kw)
            except StoreUnavailable as exc:
                self._lost(exc)
        if method != "get":
            self._keep(request_id, method, request_id, **kw)   # (it may have happened: all are idempotent)
        return None

    async def release(self, request_id: str, *, leg: str = "", worker_id: str = "") -> RequestRecord | None:
        return await self._either("release", request_id, leg=leg, worker_id=worker_id)

    async def end(self, request_id: str) -> RequestRecord | None:
        if request_id in self._local_ids:
            self._local_ids.discard(request_id)
            # Its entry leg may be in the shared ledger, or its failed reserve may still land
            # there: end it there too (a tombstone if nothing is there yet).
            self._keep(request_id, "end", request_id, tombstone_s=TOMBSTONE_S)
            return await self.local.end(request_id)
        if self._shared_now(request_id):
            try:
                return await self.shared.end(request_id)
            except StoreUnavailable as exc:
                self._lost(exc)
        self._keep(request_id, "end", request_id, tombstone_s=TOMBSTONE_S)
        return None

    async def settle_prefill(self, request_id: str) -> RequestRecord | None:
        return await self._either("settle_prefill", request_id)

    async def get(self, request_id: str) -> RequestRecord | None:
        return await self._either("get", request_id)

    async def records(self) -> list[RequestRecord]:
        local = await self.local.records()
        if not self.available:
            return local
        try:
            shared = await self.shared.records()
        except StoreUnavailable as exc:
            self._lost(exc)
            shared = []
        return shared + local

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        ids = list(worker_ids)
        local = await self.local.loads(ids) if self._local_ids else None
        if not self.available:
            return local if local is not None else await self.local.loads(ids)
        try:
            shared = await self.shared.loads(ids)
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
        if self._shared_now(""):
            try:
                return await self.shared.forget_worker(worker_id)
            except StoreUnavailable as exc:
                self._lost(exc)
        self._keep("", "forget_worker", worker_id)
        return Load()

    async def orphan(self, session: str, now: float) -> int:
        n = await self.local.orphan(session, now)
        if self._shared_now(""):
            try:
                return n + await self.shared.orphan(session, now)
            except StoreUnavailable as exc:
                self._lost(exc)
        self._keep("", "orphan", session, now)   # its shared requests are released after the grace
        return n

    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        ids = list(request_ids)
        n = await self.local.claim(session, [i for i in ids if i in self._local_ids])
        if not self.available:
            return n
        try:
            return n + await self.shared.claim(session, [i for i in ids if i not in self._local_ids])
        except StoreUnavailable as exc:
            self._lost(exc)
            return n

    async def orphans(self, cutoff: float) -> list[str]:
        out = await self.local.orphans(cutoff)
        if not self.available:
            return out
        try:
            return out + await self.shared.orphans(cutoff)
        except StoreUnavailable as exc:
            self._lost(exc)
            return out

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        if self.available and self._pending:
            await self._replay()   # a clean stop leaves nothing behind (else: the replica sweep)
        await self.shared.close()
