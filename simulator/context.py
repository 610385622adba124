"""Everything one simulated engine owns, held by its aiohttp app (no module globals)."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from simulator.bootstrap import BootstrapRooms
from simulator.config import SimConfig
from simulator.engine import Engine
from simulator.faults import Faults
from simulator.kv_transfer import KvLeaseTable, PullCounters
from simulator.layerwise import PushTable
from simulator.metrics import SimMetrics
from simulator.request_log import RequestLog

if TYPE_CHECKING:
    from simulator.kv_events import KvEventPublisher


class TokenizerModel:
    """The API server's tokenizer as a cost: ``us_per_char`` of real time per text character,
    at most ``workers`` prompts at a time (vLLM's async tokenizer runs on one thread), spent
    before the request reaches the engine queue so TTFT includes it."""

    def __init__(self, us_per_char: float, workers: int = 1) -> None:
        self.us_per_char = us_per_char
        self._free_at = [0.0] * workers  # when each worker is next idle (a heap)
        self.busy_s = 0.0
        self.chars = 0
        self.prompts = 0

    async def tokenize(self, chars: int) -> None:
        cost = self.us_per_char * chars / 1e6
        self.chars += chars
        self.prompts += 1
        if cost <= 0:
            return
        self.busy_s += cost
        now = asyncio.get_running_loop().time()
        end = max(now, self._free_at[0]) + cost
        heapq.heapreplace(self._free_at, end)
        await asyncio.sleep(end - now)


@dataclass
class SimContext:
    cfg: SimConfig
    engine: Engine
    metrics: SimMetrics
    leases: KvLeaseTable
    rooms: BootstrapRooms
    faults: Faults = field(default_factory=Faults)
    log: RequestLog = field(default_factory=RequestLog)
    pulls: PullCounters = field(default_factory=PullCounters)
    pushes: PushTable = field(default_factory=PushTable)
    tokenizer: TokenizerModel = field(default_factory=lambda: TokenizerModel(0.0))
    kv_events: KvEventPublisher | None = None
    # Filled in once the server is bound / started.
    port: int = 0
    http: aiohttp.ClientSession | None = None
    # Handlers parked in a KV-transfer wait (room hold, fetch, metaserver, long-poll).
    _kv_waits: set[asyncio.Task] = field(default_factory=set, repr=False)

    @contextmanager
    def kv_wait(self) -> Iterator[None]:
        """Mark the current handler as waiting on a peer, so shutdown can end the wait."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._kv_waits.add(task)
        try:
            yield
        finally:
            self._kv_waits.discard(task)

    def cancel_kv_waits(self) -> None:
        """Shutdown: a peer that may never come must not hold the server open."""
        for task in list(self._kv_waits):
            task.cancel()

    @property
    def bootstrap_port(self) -> int:
        """The port a proxy names as this node's bootstrap_port (serves /sim/bootstrap/pull)."""
        return self.cfg.bootstrap_port or self.port

    @classmethod
    def create(cls, cfg: SimConfig) -> "SimContext":
        metrics = SimMetrics(cfg)
        engine = Engine(cfg, observer=metrics)
        metrics.watch(engine)
        rooms = BootstrapRooms()
        return cls(cfg=cfg, engine=engine, metrics=metrics, leases=KvLeaseTable(engine, cfg.kv_lease_s, rooms),
                   rooms=rooms, port=cfg.port,
                   tokenizer=TokenizerModel(cfg.tokenize_us_per_char, cfg.tokenize_workers))

    def start_kv_events(self) -> None:
        """Open the ZMQ publisher (if configured) and feed it the engine's events."""
        if self.cfg.kv_events_endpoint and self.kv_events is None:
            from simulator.kv_events import KvEventPublisher  # zmq only when events are on

            self.kv_events = KvEventPublisher(self.cfg)
            self.kv_events.start()
            self.engine.set_event_sink(self.kv_events.publish)

    async def stop_kv_events(self) -> None:
        if self.kv_events is not None:
            self.engine.set_event_sink(None)
            await self.kv_events.close()
            self.kv_events = None


SIM = web.AppKey("sim", SimContext)
