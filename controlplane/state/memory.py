"""In-process state: the default for a single control-plane replica.

No method awaits anything, so each one is atomic on the event loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from controlplane.state.base import Charge, RequestRecord, with_charges
from controlplane.workers import IDLE, Load, WorkerSpec


class MemoryStore:
    def __init__(self) -> None:
        self._specs: dict[str, WorkerSpec] = {}
        self._records: dict[str, RequestRecord] = {}
        self._load: dict[str, Load] = {}
        self._by_session: dict[str, set[str]] = {}
        # Called with (worker id, new load) on every change: the fleet's least-loaded order
        # (controlplane.fleet.Group) follows the ledger without reading it per placement.
        self.load_listeners: list[Callable[[str, Load], None]] = []

    @property
    def load_map(self) -> Mapping[str, Load]:
        """Every worker's load, read-only and live (no copy: the local ledger reads it per
        placement and per flush)."""
        return self._load

    # ------------------------------------------------------------------ specs

    async def put_spec(self, spec: WorkerSpec) -> None:
        self._specs[spec.id] = spec

    async def remove_spec(self, worker_id: str) -> WorkerSpec | None:
        return self._specs.pop(worker_id, None)

    async def specs(self) -> list[WorkerSpec]:
        return list(self._specs.values())

    # ------------------------------------------------------------------ ledger

    def _add(self, worker_id: str, requests: int, tokens: int, prefill: int = 0) -> None:
        cur = self._load.get(worker_id)
        if cur is None:
            if requests < 0 or prefill < 0:
                return   # the worker was removed while the request ran: nothing to release
            cur = IDLE
        # (conditionals, not max(0, ...): this runs twice per request)
        r = cur.requests + requests
        t = cur.tokens + tokens
        p = cur.prefill_tokens + prefill
        n = cur.prefills + (1 if prefill > 0 else -1 if prefill < 0 else 0)
        new = self._load[worker_id] = Load(r if r > 0 else 0, t if t > 0 else 0, p if p > 0 else 0, n if n > 0 else 0)
        for listener in self.load_listeners:
            listener(worker_id, new)

    def _drop(self, c: Charge) -> None:
        self._add(c.worker_id, -1, -c.tokens, -c.prefill_tokens if c.prefill_tokens else 0)

    async def reserve(self, record: RequestRecord, charges: tuple[Charge, ...], *, charged: bool = False,
                      **notes) -> RequestRecord:
        existing = self._records.get(record.request_id)
        if existing is None:
            # A new request (every placement's entry leg): kept as built when it holds its
            # charges (``charged``), else one constructor call, not dataclasses.replace
            # (which reads the fields' list per call: 6 of the control plane's ~60 us per
            # non-streamed request).
            updated = record if charged else with_charges(record, record.charges + tuple(charges))
        else:
            updated = dataclasses.replace(existing, charges=existing.charges + tuple(charges), **notes)
        self._records[record.request_id] = updated
        if existing is None and updated.session:
            self._by_session.setdefault(updated.session, set()).add(updated.request_id)
        for c in charges:
            self._add(c.worker_id, 1, c.tokens, c.prefill_tokens)
        return updated

    async def release(self, request_id: str, *, leg: str = "", worker_id: str = "") -> RequestRecord | None:
        record = self._records.get(request_id)
        if record is None:
            return None
        keep = []
        for c in record.charges:
            # A worker's release takes its DP-rank charges ("worker#rank") with it.
            if (not leg or c.leg == leg) and (not worker_id or c.worker_id == worker_id
                                              or c.worker_id.startswith(worker_id + "#")):
                self._drop(c)
            else:
                keep.append(c)
        if len(keep) != len(record.charges):
            record = dataclasses.replace(record, charges=tuple(keep))
            self._records[request_id] = record
        return record

    async def end(self, request_id: str) -> RequestRecord | None:
        record = self._records.pop(request_id, None)
        if record is None:
            return None
        for c in record.charges:
            self._drop(c)
        self._unown(record)
        return record

    async def settle_prefill(self, request_id: str) -> RequestRecord | None:
        record = self._records.get(request_id)
        if record is None or not any(c.prefill_tokens for c in record.charges):
            return record
        charges = []
        for c in record.charges:
            if c.prefill_tokens:
                self._add(c.worker_id, 0, 0, -c.prefill_tokens)
                c = dataclasses.replace(c, prefill_tokens=0)
            charges.append(c)
        record = dataclasses.replace(record, charges=tuple(charges))
        self._records[request_id] = record
        return record

    def _unown(self, record: RequestRecord) -> None:
        owned = self._by_session.get(record.session)
        if owned is not None:
            owned.discard(record.request_id)
            if not owned:
                del self._by_session[record.session]

    async def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    async def records(self) -> list[RequestRecord]:
        return list(self._records.values())

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        load = self._load
        return {wid: load.get(wid, IDLE) for wid in worker_ids}

    async def forget_worker(self, worker_id: str) -> Load:
        load = self._load.pop(worker_id, IDLE)
        for listener in self.load_listeners:
            listener(worker_id, IDLE)
        return load

    async def orphan(self, session: str, now: float) -> int:
        ids = self._by_session.pop(session, set())
        for rid in ids:
            record = self._records.get(rid)
            if record is not None:
                self._records[rid] = dataclasses.replace(record, session="", orphaned_at=now)
        return len(ids)

    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        claimed = 0
        for rid in request_ids:
            record = self._records.get(rid)
            if record is None or (record.session and not record.orphaned_at):
                continue   # unknown, or owned by a live session
            self._records[rid] = dataclasses.replace(record, session=session, orphaned_at=0.0)
            self._by_session.setdefault(session, set()).add(rid)
            claimed += 1
        return claimed

    async def orphans(self, cutoff: float) -> list[str]:
        return [r.request_id for r in self._records.values() if r.orphaned_at and r.orphaned_at <= cutoff]
