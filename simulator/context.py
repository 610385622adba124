"""Everything one simulated engine owns, held by its aiohttp app (no module globals)."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from simulator.bootstrap import BootstrapRooms
from simulator.config import SimConfig
from simulator.dp_barrier import DpGroup
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
    # Data parallelism (cfg.dp_size > 1): every rank's engine (ranks[0] is ``engine``), the
    # other ranks' KV event publishers, and the round robin of requests that name no rank.
    ranks: list[Engine] = field(default_factory=list)
    rank_publishers: list = field(default_factory=list)
    _next_rank: list[int] = field(default_factory=lambda: [0], repr=False)
    # The ranks' lockstep loop (cfg.dp_barrier with dp_size > 1); None: each engine runs its own.
    group: DpGroup | None = None

    def for_rank(self, rank: int) -> SimContext:
        """This context as DP rank ``rank`` sees it (the same shared state, that rank's engine)."""
        return self if rank == 0 or not self.ranks else dataclasses.replace(self, engine=self.ranks[rank])

    def pick_rank(self, headers, body) -> int:
        """vLLM's ``X-data-parallel-rank`` header, else SGLang's ``routed_dp_rank`` /
        ``data_parallel_rank`` body fields, else round robin. ValueError when out of range."""
        size = self.cfg.dp_size
        named = headers.get("X-data-parallel-rank")
        if named is None and isinstance(body, dict):
            named = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if named is None:
            if size <= 1:
                return 0
            rank = self._next_rank[0] % size
            self._next_rank[0] = rank + 1
            return rank
        try:
            rank = int(named)
        except (TypeError, ValueError):
            raise ValueError(f"data parallel rank must be an integer, got {named!r}") from None
        if not 0 <= rank < size:
            raise ValueError(f"data_parallel_rank {rank} is out of range [0, {size})")
        return rank

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
    def create(cls, cfg: SimConfig) -> SimContext:
        metrics = SimMetrics(cfg)
        barrier = cfg.dp_size > 1 and cfg.dp_barrier
        wake = asyncio.Event() if barrier else None   # the group's: any rank's submit wakes it
        engine = Engine(cfg, observer=metrics, wake=wake)
        metrics.watch(engine)   # (DP ranks > 0: request metrics count, engine gauges are rank 0's)
        rooms = BootstrapRooms()
        ranks = [engine] + [Engine(cfg, observer=metrics, wake=wake) for _ in range(cfg.dp_size - 1)] \
            if cfg.dp_size > 1 else []
        return cls(cfg=cfg, engine=engine, metrics=metrics, leases=KvLeaseTable(engine, cfg.kv_lease_s, rooms),
                   rooms=rooms, port=cfg.port, ranks=ranks, group=DpGroup(ranks, wake) if wake else None,
                   tokenizer=TokenizerModel(cfg.tokenize_us_per_char, cfg.tokenize_workers))

    @property
    def engines(self) -> list[Engine]:
        return self.ranks or [self.engine]

    def start_engines(self) -> None:
        """Start the model clocks: the DP group's one, else every engine's own."""
        if self.group is not None:
            self.group.start()
        else:
            for engine in self.engines:
                engine.start()

    async def stop_engines(self) -> None:
        if self.group is not None:
            await self.group.stop()
        for engine in self.engines:
            await engine.stop()

    def start_kv_events(self) -> None:
        """Open the ZMQ publisher (if configured) and feed it the engine's events."""
        if self.cfg.kv_events_endpoint and self.kv_events is None:
            from simulator.kv_events import KvEventPublisher  # zmq only when events are on

            self.kv_events = KvEventPublisher(self.cfg)
            self.kv_events.start()
            self.engine.set_event_sink(self.kv_events.publish)
            for rank in range(1, len(self.ranks)):   # vLLM: rank r publishes on port + r
                cfg = dataclasses.replace(
                    self.cfg, kv_events_endpoint=_offset_port(self.cfg.kv_events_endpoint, rank),
                    kv_events_replay_endpoint=_offset_port(self.cfg.kv_events_replay_endpoint, rank))
                pub = KvEventPublisher(cfg)
                pub.dp_rank = rank
                pub.start()
                self.ranks[rank].set_event_sink(pub.publish)
                self.rank_publishers.append(pub)

    async def stop_kv_events(self) -> None:
        if self.kv_events is not None:
            for e in self.engines:
                e.set_event_sink(None)
            await self.kv_events.close()
            self.kv_events = None
        for pub in self.rank_publishers:
            await pub.close()
        self.rank_publishers.clear()


def _offset_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's ``offset_endpoint_port``: tcp port + rank (port 0 stays 0: any free port)."""
    if not endpoint:
        return endpoint
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if m:
        port = int(m.group(2))
        return f"{m.group(1)}{port + rank if port else 0}"
    return f"{endpoint}_dp{rank}"


SIM = web.AppKey("sim", SimContext)
