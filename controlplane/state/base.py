"""The interfaces every state backend implements: worker specs, and one atomic ledger.

Both are async so a networked backend (Redis, for several control-plane replicas) fits
the same shape. Every value that crosses them is immutable. The ledger's operations are
each atomic on their own: a placement reads a snapshot of loads, decides, and then
reserves all its charges in one call, so a backend that suspends between those steps can
make a decision slightly stale but can never lose or double a charge.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from controlplane.workers import Load, WorkerSpec


class StoreUnavailable(Exception):
    """A networked backend cannot be reached; the operation may not have happened.

    Raised by every method of a shared store (Redis) while it is away. The caller keeps
    serving from what it holds in memory and retries later; the backend reconnects by
    itself. MemoryStore never raises it.
    """


@dataclass(frozen=True, slots=True)
class Charge:
    """Load that one request holds on one worker until it is released."""

    worker_id: str
    leg: str            # "prefill", "decode" or "aggregated"
    tokens: int
    prefill_tokens: int = 0   # uncached prompt tokens this worker computes; settled at the first token


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A placed request that has not finished yet."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    session: str = ""          # the data-plane session that owns it; "" while orphaned
    flow: int = 0
    charges: tuple[Charge, ...] = ()
    created_at: float = 0.0
    orphaned_at: float = 0.0   # its session ended; released unless a session claims it in time
    # What placement predicted, kept to learn from the outcome (controlplane.prediction).
    placed_at: float = 0.0
    predicted_ttft_s: float = 0.0
    work_ahead_tokens: int = 0  # prefill tokens ahead of and including this one on its prefill worker
    decode_batch: int = 0       # requests on its decode worker, itself included, at placement
    # Sequential PD: when D was placed (P had answered) and the prompt tokens D lacked then,
    # which it pulls from P: what D's first token teaches its KV-pull line.
    decode_placed_at: float = 0.0
    pull_tokens: int = 0


def with_charges(r: RequestRecord, charges: tuple[Charge, ...]) -> RequestRecord:
    """``r`` holding ``charges``: ``dataclasses.replace(r, charges=charges)`` as one positional
    constructor call, a third of its cost (it runs for every placed request). Every field is
    passed on (tests/test_ledger_records.py checks it against ``dataclasses.fields``)."""
    return RequestRecord(r.request_id, r.model, r.prompt_tokens, r.max_tokens, r.session, r.flow, charges,
                         r.created_at, r.orphaned_at, r.placed_at, r.predicted_ttft_s, r.work_ahead_tokens,
                         r.decode_batch, r.decode_placed_at, r.pull_tokens)


class SpecStore(Protocol):
    """Durable worker specs (config, registrations, operators' changes)."""

    async def put_spec(self, spec: WorkerSpec) -> None: ...
    async def remove_spec(self, worker_id: str) -> WorkerSpec | None: ...
    async def specs(self) -> list[WorkerSpec]: ...


class Ledger(Protocol):
    """Load per worker, as the sum of the charges of the requests that hold it."""

    async def reserve(self, record: RequestRecord, charges: tuple[Charge, ...], *, charged: bool = False,
                      **notes) -> RequestRecord | None:
        """Add ``charges`` to the request (creating its record from ``record`` if new);
        ``notes`` replace fields of an existing record (what a later leg's placement predicted).
        A new record's own charges are kept but not added to any load, unless ``charged``:
        ``record`` was built holding ``charges`` (their tuple) and is kept as it is, so a new
        request's record is built once, by the caller (the commit step, for every placement).
        The record; None when the request had already ended (a late reserve the Redis store
        drops, see its ``end(tombstone_s=)``). A store that answers before its backend has
        applied the call (the Redis store's ``write_behind``, its default) answers ``record``
        with ``charges`` added and ``notes`` applied: the stored record when the caller
        passes the request's current one for a later leg, as the commit step does."""
        ...

    async def release(self, request_id: str, *, leg: str = "", worker_id: str = "") -> RequestRecord | None:
        """Release the request's charges that match ``leg`` / ``worker_id``; keep the record."""
        ...

    async def end(self, request_id: str) -> RequestRecord | None:
        """Release everything the request holds and forget it; None if it was unknown."""
        ...

    async def settle_prefill(self, request_id: str) -> RequestRecord | None:
        """The prompt is computed: its prefill tokens no longer count as work ahead."""
        ...

    async def get(self, request_id: str) -> RequestRecord | None: ...
    async def records(self) -> list[RequestRecord]: ...
    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]: ...
    async def forget_worker(self, worker_id: str) -> Load: ...

    async def orphan(self, session: str, now: float) -> int:
        """The session ended: its requests lose their owner (see ``Lifecycle``)."""
        ...

    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        """A session names requests it serves: owned by it from now on."""
        ...

    async def orphans(self, cutoff: float) -> list[str]:
        """Ids of requests orphaned at or before ``cutoff``."""
        ...


class StateStore(SpecStore, Ledger, Protocol):
    """A backend: specs and ledger together (one connection, one failure domain)."""


# ---------------------------------------------------------------------------- optional capabilities
# What only some backends offer, declared here so a caller asks ``isinstance(store, SharedStore)``
# instead of probing for a method by name. The wrappers (ResilientStore, LocalLedgerStore)
# pass these calls on to the RedisStore they hold, so they have them too.


@runtime_checkable
class SharedStore(Protocol):
    """A store other control-plane replicas share (Redis): this replica must heartbeat in it
    before touching the ledger, sweep what dead replicas left (``maintain``), and keep the
    operators' removal fences there."""

    async def heartbeat(self) -> None: ...
    async def maintain(self, interval_s: float | None = None, *, orphan: bool = True) -> None: ...
    async def put_fence(self, worker_id: str, record: dict) -> None: ...
    async def drop_fence(self, worker_id: str) -> None: ...
    async def fences(self) -> dict[str, dict]: ...


@runtime_checkable
class VersionedSpecs(Protocol):
    """Specs read with the version they were at, and the store's epoch (a store that came
    back empty has a new one: see ``state/sync.py``)."""

    async def specs_versioned(self) -> tuple[int, list[WorkerSpec]]: ...
    async def spec_epoch(self) -> str: ...
    async def spec_version(self) -> int: ...


@runtime_checkable
class WatchableSpecs(Protocol):
    """Announces each spec change (a pub/sub channel), so a replica need not poll."""

    def watch_specs(self) -> AsyncGenerator[Any, None]: ...
    async def spec_version(self) -> int: ...


@runtime_checkable
class NotifiesLoads(Protocol):
    """Calls each listener with (worker id, new total load) on every change of the ledger:
    the fleet's least-loaded order follows it without a read per placement."""

    load_listeners: list[Callable[[str, Load], None]]


@runtime_checkable
class ReportsAvailability(Protocol):
    """Says whether its backend answers now (False while Redis is away: /health "degraded")."""

    available: bool


@runtime_checkable
class ClosableStore(Protocol):
    """Holds connections or tasks to close at shutdown."""

    async def close(self) -> None: ...
