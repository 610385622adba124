"""The records a Redis replica reserved with write-behind, kept for their ends, indexed by session.

``RedisStore`` answers the end of a request it reserved from its own copy of the record
(write-behind ends, state/redis.py) and must drop the copies of a data-plane session's
requests when that session is orphaned (their records change owner, their ends are then
awaited). A scan of every copy per closed session was up to ``MINE_MAX`` (131,072) records of
work on the event loop for each session that closed, most of them another session's; the
index by session makes the orphan's work proportional to that session's own requests.

Bounded: past ``max_records``, the oldest copy is dropped (its end is then awaited, as for a
request this replica never reserved).
"""

from __future__ import annotations

from controlplane.state.base import RequestRecord


class OwnedRecords:
    """Request id -> record, oldest first, with the ids of each session's records."""

    __slots__ = ("max_records", "_records", "_by_session")

    def __init__(self, max_records: int) -> None:
        self.max_records = max_records
        self._records: dict[str, RequestRecord] = {}
        self._by_session: dict[str, dict[str, None]] = {}   # session -> its request ids (a set, ordered)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def put(self, record: RequestRecord) -> None:
        """Keep (or update) ``record``; drops the oldest past ``max_records``."""
        rid, records = record.request_id, self._records
        old = records.get(rid)
        if old is not None and old.session != record.session:
            self._unlink(rid, old.session)
        records[rid] = record
        if old is None or old.session != record.session:
            if record.session:
                ids = self._by_session.get(record.session)
                if ids is None:
                    ids = self._by_session[record.session] = {}
                ids[rid] = None
        if len(records) > self.max_records:
            self.pop(next(iter(records)))

    def pop(self, request_id: str) -> RequestRecord | None:
        record = self._records.pop(request_id, None)
        if record is not None:
            self._unlink(request_id, record.session)
        return record

    def pop_session(self, session: str) -> list[str]:
        """Drop the records of ``session``; returns their request ids. O(its records)."""
        ids = self._by_session.pop(session, None)
        if not ids:
            return []
        records = self._records
        for rid in ids:
            del records[rid]
        return list(ids)

    def _unlink(self, request_id: str, session: str) -> None:
        if not session:
            return
        ids = self._by_session.get(session)
        if ids is not None:
            ids.pop(request_id, None)
            if not ids:
                del self._by_session[session]
