"""The last requests a sim received, so tests can check what a proxy actually sent."""

from __future__ import annotations

import time
from collections import deque
from typing import Any


class RequestLog:
    def __init__(self, maxlen: int = 200) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def record(self, path: str, request_id: str, body: Any, headers: Any = None, dp_rank: int = 0) -> None:
        """``headers``: the request's headers, kept with lower-case names (last value wins);
        ``dp_rank``: the data-parallel rank that served it (0 without data parallelism)."""
        entry = {"path": path, "request_id": request_id, "body": body, "received_at": time.time(),
                 "dp_rank": dp_rank}
        if headers is not None:
            entry["headers"] = {k.lower(): v for k, v in headers.items()}
        self._entries.append(entry)

    def snapshot(self) -> list[dict[str, Any]]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
