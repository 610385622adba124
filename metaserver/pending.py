"""Layerwise requests waiting for their decode engine(s) to call the metaserver.

They live in the control plane, not in a data-plane process, so any data-plane replica
can place a request and any metaserver call finds it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PendingPrefill:
    placement_id: str               # the control plane's ledger key
    engine_request_id: str          # X-Request-Id the engines see
    path: str
    body: bytes                     # handed over by the data plane (Metaserver.handle_body); b"" until then
    model: str
    prompt_tokens: int
    max_tokens: int
    expected: list[str]             # engine ids that must report before P is sent
    block_hashes: list[int] = field(default_factory=list)
    # Who may answer for this request: the token in the metaserver URL given to the
    # placed decode engine, and that engine's address when it is an IP literal.
    token: str = ""
    decode_host: str = ""
    trace: dict[str, str] = field(default_factory=dict)   # W3C trace context for the prefill leg
    created: float = field(default_factory=time.monotonic)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    result: asyncio.Future | None = None    # set once: None = ok, str = error message
    task: asyncio.Task | None = None

    @property
    def complete(self) -> bool:
        return all(i in self.params for i in self.expected)


class PendingTable:
    def __init__(self) -> None:
        self._by_placement: dict[str, PendingPrefill] = {}
        self._by_child: dict[str, PendingPrefill] = {}

    def __len__(self) -> int:
        return len(self._by_placement)

    def add(self, entry: PendingPrefill) -> bool:
        """Register ``entry``; False (and nothing changed) if its placement id or any of
        its engine ids is already pending. Overwriting would hand one request's decode
        call, and so its KV destination, to another request's prefill."""
        if entry.placement_id in self._by_placement or any(c in self._by_child for c in entry.expected) \
                or len(set(entry.expected)) != len(entry.expected):
            return False
        self._by_placement[entry.placement_id] = entry
        for child in entry.expected:
            self._by_child[child] = entry
        return True

    def entries(self) -> list[PendingPrefill]:
        return list(self._by_placement.values())

    def get(self, placement_id: str) -> PendingPrefill | None:
        return self._by_placement.get(placement_id)

    def find(self, child_id: str) -> PendingPrefill | None:
        return self._by_child.get(child_id)

    def pop(self, placement_id: str) -> PendingPrefill | None:
        entry = self._by_placement.pop(placement_id, None)
        if entry is not None:
            for child in entry.expected:
                self._by_child.pop(child, None)
        return entry

    def older_than(self, age_s: float) -> list[PendingPrefill]:
        cutoff = time.monotonic() - age_s
        return [e for e in self._by_placement.values() if e.created < cutoff]
