"""Everything one simulated engine owns, held by its aiohttp app (no module globals)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

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
                   rooms=rooms, port=cfg.port)


SIM = web.AppKey("sim", SimContext)
