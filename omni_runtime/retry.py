"""The one retry policy of every retried thing: engine legs, the placement session's
reconnects, the engine plugin's registration, the metaserver's prefill POSTs.

Exponential backoff with *full jitter* (uniform in [0, min(base * 2**(n-1), max)]), so that
a fleet-wide hiccup does not turn into a synchronized retry storm; an attempt cap; an
overall deadline; a predicate for what is worth retrying (by default a lost connection, a
timeout, or an HTTP 429/5xx gateway-type status, never a 4xx: the request's own fault
fails on every worker); and an ``on_retry(attempt, delay, error)`` hook for logs and
metrics.

Written here (~60 lines) rather than taken from tenacity or backoff: both build per-call
state (tenacity copies its Retrying object and makes a RetryCallState, backoff a wait
generator and a details dict) even when the first attempt succeeds, which every request's
leg would pay; neither lets a caller do async work between attempts (a leg picks another
worker) except through hooks; and the plugin's agent waits on a ``threading.Event``, not a
sleep. So loops that need their own step between attempts ask ``next_delay``; a plain
operation goes through ``call``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

# 0 = no answer at all (connection refused or reset); 501 and 505 would fail anywhere.
RETRYABLE_STATUSES = frozenset({0, 429, 500, 502, 503, 504})


def retryable_error(exc: BaseException) -> bool:
    """The default predicate: an error that carries an HTTP status (``upstream_status`` or
    ``status``) by that status; otherwise a lost connection or a timeout."""
    status = getattr(exc, "upstream_status", None)
    if status is None:
        status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status in RETRYABLE_STATUSES
    return isinstance(exc, (ConnectionError, TimeoutError))   # asyncio.TimeoutError is TimeoutError


@dataclass(frozen=True)
class Retry:
    attempts: int = 2                  # retries after the first failure (sys.maxsize: no cap)
    base_s: float = 0.02               # the first retry's jitter window
    max_s: float = 1.0                 # the largest window
    deadline_s: float = math.inf       # overall, from the first attempt of ``call``
    retryable: Callable[[BaseException], bool] = retryable_error
    on_retry: Callable[[int, float, BaseException], None] | None = None
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1 = the first retry)."""
        return self.rng.uniform(0.0, min(self.base_s * 2.0 ** min(attempt - 1, 64), self.max_s))

    def next_delay(self, error: BaseException, attempt: int, started: float = 0.0) -> float | None:
        """The pause before retry ``attempt`` after ``error``, or None: give up (not
        retryable, attempts spent, or the deadline, counted from ``started``, would pass
        before the retry starts). ``on_retry`` hears of every retry granted."""
        if attempt > self.attempts or not self.retryable(error):
            return None
        pause = self.delay(attempt)
        if self.deadline_s < math.inf and self.clock() + pause - started >= self.deadline_s:
            return None
        if self.on_retry is not None:
            self.on_retry(attempt, pause, error)
        return pause

    async def call(self, op: Callable[[], Awaitable[T]]) -> T:
        """``op()``'s result, retried by this policy; the last error when it gives up.
        Nothing is allocated here unless an attempt fails (the clock is read only with a deadline)."""
        started = self.clock() if self.deadline_s < math.inf else 0.0
        attempt = 0
        while True:
            try:
                return await op()
            except Exception as exc:
                attempt += 1
                pause = self.next_delay(exc, attempt, started)
                if pause is None:
                    raise
                await self.sleep(pause)
