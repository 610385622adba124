"""The one interface every state backend implements.

It is async so a networked backend (Redis, for several control-plane replicas) fits the
same shape. The in-memory backend never suspends inside these calls, which makes a whole
placement (read loads, pick, charge) atomic on the event loop without locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from controlplane.workers import Worker


@dataclass
class Charge:
    """Load that one request holds on one worker until it is released."""

    worker_id: str
    leg: str            # "prefill", "decode" or "aggregated"
    tokens: int


@dataclass
class RequestRecord:
    """A placed request that has not finished yet."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    session: str = ""   # the data-plane session that placed it; its end releases the record
    flow: str = ""
    charges: list[Charge] = field(default_factory=list)
    created_at: float = 0.0
    orphaned_at: float = 0.0   # its session ended; released unless a session claims it in time


class StateStore(Protocol):
    async def upsert_worker(self, worker: Worker) -> None: ...
    async def get_worker(self, worker_id: str) -> Worker | None: ...
    async def remove_worker(self, worker_id: str) -> Worker | None: ...
    async def list_workers(self) -> list[Worker]: ...

    async def add_load(self, worker_id: str, requests: int, tokens: int) -> None: ...

    async def put_request(self, record: RequestRecord) -> None: ...
    async def get_request(self, request_id: str) -> RequestRecord | None: ...
    async def pop_request(self, request_id: str) -> RequestRecord | None: ...
    async def list_requests(self) -> list[RequestRecord]: ...
