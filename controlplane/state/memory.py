"""In-process state: the default for a single control-plane replica."""

from __future__ import annotations

from controlplane.state.base import RequestRecord
from controlplane.workers import Worker


class MemoryStore:
    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._requests: dict[str, RequestRecord] = {}

    async def upsert_worker(self, worker: Worker) -> None:
        self._workers[worker.id] = worker

    async def get_worker(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    async def remove_worker(self, worker_id: str) -> Worker | None:
        return self._workers.pop(worker_id, None)

    async def list_workers(self) -> list[Worker]:
        return list(self._workers.values())

    async def add_load(self, worker_id: str, requests: int, tokens: int) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:  # removed while the request was in flight: nothing to release
            return
        worker.inflight_requests = max(0, worker.inflight_requests + requests)
        worker.inflight_tokens = max(0, worker.inflight_tokens + tokens)

    async def put_request(self, record: RequestRecord) -> None:
        self._requests[record.request_id] = record

    async def get_request(self, request_id: str) -> RequestRecord | None:
        return self._requests.get(request_id)

    async def pop_request(self, request_id: str) -> RequestRecord | None:
        return self._requests.pop(request_id, None)

    async def list_requests(self) -> list[RequestRecord]:
        return list(self._requests.values())
