"""Events several components of the control plane care about, as multi-subscriber hooks.

A worker that joins must be health-checked and have its KV events followed; a request that
ends must leave the ledger and the metaserver's pending table. The component that sees the
event should not know who cares: it owns a hook and emits; the composition root
(``controlplane/compose.py``) subscribes the others. A single-slot callback let the last
component to assign it silently replace the one before; a hook calls every subscriber, in
the order they subscribed, and one that raises is logged without stopping the others (the
event has happened whatever a subscriber makes of it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, ParamSpec

from controlplane.workers import WorkerSpec

log = logging.getLogger(__name__)

P = ParamSpec("P")


class _Subscribers(Generic[P]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._subscribers: list = []

    def __bool__(self) -> bool:
        """Whether anyone listens (an emitter on a hot path may skip building its arguments)."""
        return bool(self._subscribers)

    def __len__(self) -> int:
        return len(self._subscribers)

    def unsubscribe(self, fn: Callable) -> None:
        self._subscribers.remove(fn)


class Hook(_Subscribers[P]):
    """Synchronous subscribers, called in turn by :meth:`emit`."""

    def subscribe(self, fn: Callable[P, object]) -> Callable[P, object]:
        self._subscribers.append(fn)
        return fn

    def emit(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for fn in tuple(self._subscribers):    # (a subscriber may unsubscribe itself)
            try:
                fn(*args, **kwargs)
            except Exception:
                log.exception("a subscriber of %r failed", self.name)


class AsyncHook(_Subscribers[P]):
    """Coroutine subscribers, awaited one after the other by :meth:`emit` (in order: a
    worker's health check runs before its KV subscription, as before)."""

    def subscribe(self, fn: Callable[P, Awaitable[object]]) -> Callable[P, Awaitable[object]]:
        self._subscribers.append(fn)
        return fn

    async def emit(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for fn in tuple(self._subscribers):
            try:
                await fn(*args, **kwargs)
            except Exception:
                log.exception("a subscriber of %r failed", self.name)


@dataclass(frozen=True)
class WorkerEvents:
    """A worker joined or left this replica's fleet, whoever changed it: the registry (config,
    engine plugins, operators, discovery) or the spec sync (another replica, through Redis)."""

    added: AsyncHook[[WorkerSpec]] = field(default_factory=lambda: AsyncHook("worker added"))
    removed: AsyncHook[[str]] = field(default_factory=lambda: AsyncHook("worker removed"))
