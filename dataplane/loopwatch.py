"""How long the data plane's event loop stalls: a timer that should fire every 10 ms, and
how late it fires.

Anything that holds the loop (tokenizing, hashing, a big JSON body, a slow callback)
delays every other request's placement, reads and writes by as much. Exposed on
``/metrics`` as ``omni_dp_event_loop_lag_seconds`` (a histogram of the lateness of each
tick, so a scraper or a benchmark can take deltas over any window) and
``omni_dp_event_loop_lag_max_seconds`` (the longest in the last 10 s). Cost: 100 timer
callbacks a second.
"""

from __future__ import annotations

import asyncio
import collections
import time

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily

INTERVAL_S = 0.01
WINDOW_S = 10
BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)


class LoopWatch:
    def __init__(self, registry) -> None:
        self.lag = Histogram("omni_dp_event_loop_lag_seconds", "Lateness of a 10 ms event-loop timer",
                             buckets=BUCKETS, registry=registry)
        self._maxima: collections.deque[tuple[int, float]] = collections.deque()   # (second, max lag)
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        registry.register(self)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + INTERVAL_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None   # started
        now = loop.time()
        late = max(0.0, now - self._due)
        self.lag.observe(late)
        second = int(time.monotonic())
        if self._maxima and self._maxima[-1][0] == second:
            if late > self._maxima[-1][1]:
                self._maxima[-1] = (second, late)
        else:
            self._maxima.append((second, late))
            while self._maxima and self._maxima[0][0] <= second - WINDOW_S:
                self._maxima.popleft()
        self._due = now + INTERVAL_S
        self._handle = loop.call_at(self._due, self._tick)

    def max_recent(self) -> float:
        horizon = int(time.monotonic()) - WINDOW_S
        return max((m for s, m in self._maxima if s > horizon), default=0.0)

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("omni_dp_event_loop_lag_max_seconds",
                                "Longest event-loop stall (timer lateness) in the last 10 s", value=self.max_recent())
