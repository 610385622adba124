"""The control plane's KV-cache view: which worker holds how much of a prompt.

Two sources, one answer per worker:
  * exact: workers that publish vLLM KV events feed ``exact`` through a subscriber each;
  * approximate: for workers without events, what was routed where is remembered for
    ``approx_ttl_s`` (the best a router can do when the engine does not say).
Placement asks :meth:`KVCache.match` once per request and hands the depths to the scorers.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig
from controlplane.kvcache.subscriber import KVEventSource, KVEventSubscriber
from controlplane.workers import Worker

log = logging.getLogger(__name__)


@dataclass
class KVCacheConfig:
    """Must match the engines' prefix-cache settings for exact matching."""

    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None        # the engines' PYTHONHASHSEED; None = unset
    lora_key_format: str = "tuple"      # vLLM >= 0.1x: ("lora", name, path); older: "name"
    max_blocks: int = 2_000_000         # bound on indexed blocks (LRU beyond it)
    approx_ttl_s: float = 120.0         # approximate mode: how long a routed prefix counts
    replay_timeout_s: float = 2.0


def _offset_port(endpoint: str, rank: int) -> str:
    """vLLM publishes DP rank r on the endpoint's port + r."""
    if not rank or not endpoint:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.port is None:
        raise ValueError(f"cannot offset {endpoint!r} for data-parallel rank {rank}")
    return endpoint.replace(f":{parts.port}", f":{parts.port + rank}")


class KVCache:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.exact = PrefixIndex(PrefixIndexConfig(max_blocks=config.max_blocks))
        self.approx = PrefixIndex(PrefixIndexConfig(max_blocks=config.max_blocks))
        self._approx_expiry: deque[tuple[float, str, tuple[int, ...]]] = deque()
        # (worker, block hash) -> when it stops counting; a block shared by a newer routed
        # prompt (the next turn of a conversation) must outlive the older prompt's expiry.
        self._approx_latest: dict[tuple[str, int], float] = {}
        self._subscribers: dict[str, list[KVEventSubscriber]] = {}

    # ------------------------------------------------------------------ subscriptions

    async def watch(self, worker: Worker) -> None:
        """Subscribe to a worker's KV events (idempotent); no-op for workers without any."""
        if not worker.kv_events or worker.id in self._subscribers:
            return
        subs = []
        for rank in range(max(worker.dp_size, 1)):
            source = KVEventSource(engine_key=worker.id, endpoint=_offset_port(worker.kv_events, rank),
                                   replay_endpoint=_offset_port(worker.kv_replay, rank) or None)
            sub = KVEventSubscriber(source, self._on_events, self._on_reset,
                                    replay_timeout_s=self.config.replay_timeout_s)
            await sub.start()
            subs.append(sub)
        self._subscribers[worker.id] = subs
        log.info("worker %s: following KV events at %s (%d rank(s))", worker.id, worker.kv_events, len(subs))

    async def unwatch(self, worker_id: str) -> None:
        for sub in self._subscribers.pop(worker_id, []):
            await sub.stop()
        self.exact.drop_worker(worker_id)
        self.approx.drop_worker(worker_id)

    async def stop(self) -> None:
        for worker_id in list(self._subscribers):
            await self.unwatch(worker_id)

    def _on_events(self, engine: str, dp_rank: int | None, events) -> None:
        self.exact.apply(engine, dp_rank, events)

    def _on_reset(self, engine: str) -> None:
        # A gap we could not replay: what we believed about this engine may be wrong.
        self.exact.reset_worker(engine)

    def counters(self) -> dict[str, dict[str, int]]:
        out = {}
        for worker_id, subs in self._subscribers.items():
            total: dict[str, int] = {}
            for sub in subs:
                for k, v in vars(sub.counters).items():
                    total[k] = total.get(k, 0) + v
            out[worker_id] = total
        return out

    # ------------------------------------------------------------------ placement

    def match(self, chain: list[int], workers: list[Worker]) -> dict[str, int]:
        """Per worker id, the number of leading blocks of ``chain`` it holds (0 omitted).

        DP ranks of one worker count as the best rank: the engine routes within itself.
        """
        if not chain:
            return {}
        self._expire()
        out: dict[str, int] = {}
        exact_ids = {w.id for w in workers if w.kv_events}
        approx_ids = {w.id for w in workers if not w.kv_events}
        if exact_ids:
            keys = [k for k in self.exact.workers() if k[0] in exact_ids]
            for (worker_id, _rank), depth in self.exact.match_depths(chain, keys).items():
                out[worker_id] = max(out.get(worker_id, 0), depth)
        if approx_ids:
            keys = [k for k in self.approx.workers() if k[0] in approx_ids]
            for (worker_id, _rank), depth in self.approx.match_depths(chain, keys).items():
                out[worker_id] = max(out.get(worker_id, 0), depth)
        return out

    def placed(self, worker: Worker, chain: list[int], predicted_depth: int) -> None:
        """For workers without events, remember the routed prefix; for the others, keep the
        matched prefix recent in the index."""
        if chain and not worker.kv_events:
            expiry = time.monotonic() + self.config.approx_ttl_s
            self.approx.store((worker.id, None), chain, None)
            self._approx_expiry.append((expiry, worker.id, tuple(chain)))
            latest = self._approx_latest
            for h in chain:
                latest[(worker.id, h)] = expiry
        elif chain:
            self.exact.touch(chain[:predicted_depth])

    def _expire(self) -> None:
        now = time.monotonic()
        q = self._approx_expiry
        while q and q[0][0] <= now:
            _, worker_id, chain = q.popleft()
            latest = self._approx_latest
            gone = [h for h in chain if latest.get((worker_id, h), 0.0) <= now]
            for h in gone:
                latest.pop((worker_id, h), None)
            if gone:
                self.approx.remove((worker_id, None), gone)

    def cached_blocks(self) -> dict[str, int]:
        """Blocks each worker holds, by events or by routing."""
        out = self.exact.blocks_by_worker()
        for worker_id, n in self.approx.blocks_by_worker().items():
            out[worker_id] = out.get(worker_id, 0) + n
        return out
