"""Run a coroutine at once, and give it a task only if it has to wait.

Why: a control-plane session handles its data plane's messages in arrival order, so that a
placement answered at once sees the load charged by the one before. With the memory store a
message never waits, and handling it inline costs nothing; with a networked store (Redis) a
message waits for round trips, and awaiting it inline held every message behind it on the
session (placements queued behind other placements' and reports' round trips). Started
eagerly, a message that completes without waiting is done before the next one is read, as
before, and one that waits goes on in a task of its own while the next ones are handled.

This is ``asyncio.eager_task_factory`` (Python 3.12) for one call, on the Pythons the project
supports (3.10+): the coroutine is stepped once here; if it suspends, the future it waits on is
handed, unchanged, to the task that resumes it, so cancellation and results flow as usual.
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import Coroutine, Generator
from typing import Any


class _Started(collections.abc.Coroutine):
    """An already-started coroutine, as a coroutine a task can run: the task's first step gets
    the future the coroutine is waiting on; every later step (a result, or an exception such as
    a cancel, even one that comes before that first step) goes straight to the coroutine."""

    __slots__ = ("_coro", "_first", "_waiting")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self._coro = coro
        self._waiting: Any = waiting
        self._first = True

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            return self._waiting
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._first:    # cancelled before the task ran: what a task's cancel would do
            self._first = False
            if isinstance(self._waiting, asyncio.Future):
                self._waiting.cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        raise TypeError("only a task runs a started coroutine")


def start_eagerly(coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Run ``coro`` until it first waits. Returns None if it finished without waiting (its
    return value is dropped; an exception it raised propagates here), else the task that runs
    the rest of it."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Started(coro, waiting))
