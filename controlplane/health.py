"""Background checks of every worker: liveness (/health), model discovery, engine load.

Health decides whether a worker gets placements at all. Engine metrics only refine the
control plane's own load counts (see scheduling.scorers.effective_requests).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, replace

import aiohttp

from controlplane.fleet import Fleet
from controlplane.registry import WorkerRegistry
from controlplane.workers import EngineMetrics, Health, WorkerSpec

log = logging.getLogger(__name__)


def lora_adapters(models: list) -> tuple[tuple[str, str], ...]:
    """(name, path) of each LoRA adapter in a /v1/models list: vLLM lists an adapter as a
    model with a ``parent`` (the base model) and its path as ``root``; the block hashes of
    its requests carry that name (and, in newer vLLM, that path)."""
    out = []
    for m in models:
        if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str) and m["id"]:
            root = m.get("root")
            out.append((m["id"][:256], root[:4096] if isinstance(root, str) else ""))
    return tuple(sorted(set(out)))


@dataclass
class HealthConfig:
    interval_s: float = 2.0
    timeout_s: float = 2.0
    unhealthy_after: int = 2       # consecutive failures before a healthy worker is dropped
    metrics_interval_s: float = 1.0
    poll_metrics: bool = True
    # The circuit breaker on real requests (controlplane.lifecycle.BreakerConfig).
    eject_after: int = 5
    eject_base_s: float = 10.0
    eject_max_s: float = 300.0


# The only samples placement reads from an engine's /metrics. vLLM's page is hundreds of
# lines (histograms with dozens of buckets each), polled every second from every worker on
# the loop that answers placements: prometheus_client's parser builds an object per line
# of it in Python. One regex scan in C picks out these few lines instead.
_WANTED = re.compile(
    r"^(vllm:(?:num_requests_running|num_requests_waiting|prefix_cache_hits_total|prefix_cache_queries_total"
    r"|kv_cache_usage_perc|gpu_cache_usage_perc))(?:\{.*\})?[ \t]+(\S+)", re.MULTILINE)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_engine_metrics(text: str) -> tuple[int, int, float, float, float]:
    """Sum vLLM's running/waiting gauges and prefix-cache counters over engines; average
    KV usage (of the first of its two names the page has). -1 = absent."""
    sums: dict[str, float] = {}
    kv_name = ""
    kv_total, kv_n = 0.0, 0
    for name, value in _WANTED.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue      # not a sample value: prometheus_client would refuse the page
        if name in _KV_USAGE:
            kv_name = kv_name or name
            if name == kv_name:
                kv_total += number
                kv_n += 1
        else:
            sums[name] = sums.get(name, 0.0) + number
    running = sums.get("vllm:num_requests_running")
    waiting = sums.get("vllm:num_requests_waiting")
    return (-1 if running is None else int(running), -1 if waiting is None else int(waiting),
            kv_total / kv_n if kv_n else -1.0, sums.get("vllm:prefix_cache_hits_total", -1.0),
            sums.get("vllm:prefix_cache_queries_total", -1.0))


class HealthChecker:
    """Checks every worker this replica knows; results go to the fleet view as new values."""

    def __init__(self, fleet: Fleet, registry: WorkerRegistry, config: HealthConfig, *,
                 engine_api_key: str = "") -> None:
        self.fleet = fleet
        self._headers = {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else None
        self.registry = registry
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The HTTP session engines are checked with (its timeout and engine API key), for
        another check made at once (omni-ctl add's first check); None until ``start``."""
        return self._session

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
                                              headers=self._headers)
        await self.check_all()  # workers from config are usable as soon as we are up
        self._tasks.append(asyncio.create_task(self._loop(self.check_all, self.config.interval_s)))
        if self.config.poll_metrics:
            self._tasks.append(asyncio.create_task(
                self._loop(self.poll_all_metrics, self.config.metrics_interval_s)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self, fn, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # a bug here must not stop health checking for good
                log.exception("background check failed")

    async def check_all(self) -> None:
        await self.expire_heartbeats()
        await asyncio.gather(*(self.check(spec) for spec in self.fleet.specs()))

    async def check(self, spec: WorkerSpec) -> None:
        assert self._session is not None
        error = ""
        try:
            async with self._session.get(spec.url + "/health") as resp:
                await resp.read()
                if resp.status != 200:
                    error = f"/health returned {resp.status}"
            if not error and (not spec.model or not self.fleet.state(spec.id).max_model_len):
                await self._read_models(spec)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._apply(spec, error)

    def _apply(self, spec: WorkerSpec, error: str) -> None:
        state = self.fleet.state(spec.id)
        if not error:
            if state.health is not Health.HEALTHY:
                log.info("worker %s (%s) is healthy", spec.id, spec.url, extra={"worker": spec.id})
            if state.health is not Health.HEALTHY or state.consecutive_failures:
                self.fleet.set_state(spec.id, replace(state, health=Health.HEALTHY, consecutive_failures=0))
            return
        failures = state.consecutive_failures + 1
        health = state.health
        if health is not Health.HEALTHY or failures >= self.config.unhealthy_after:
            if health is not Health.UNHEALTHY:
                log.warning("worker %s (%s) is unhealthy: %s", spec.id, spec.url, error, extra={"worker": spec.id})
            health = Health.UNHEALTHY
        self.fleet.set_state(spec.id, replace(state, health=health, consecutive_failures=failures,
                                              last_error=error, max_model_len=0))

    async def _read_models(self, spec: WorkerSpec) -> None:
        """The engine's /v1/models: its model (when the spec names none; a failure then fails
        the check), its max_model_len (ListModels passes it on) and its LoRA adapters (routed
        and hashed as theirs), once per healthy spell."""
        try:
            model, limit, loras = await self._discover_model(spec)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError):
            if not spec.model:
                raise
            model, limit, loras = spec.model, -1, ()   # the model is configured: health is /health's to say
        if not spec.model:
            await self.registry.update(spec.id, model=model)
        state = self.fleet.state(spec.id)
        if state.max_model_len != limit or state.loras != loras:
            if loras != state.loras:
                log.info("worker %s serves LoRA adapters %s", spec.id, ", ".join(n for n, _ in loras) or "(none now)",
                         extra={"worker": spec.id})
            self.fleet.set_state(spec.id, replace(state, max_model_len=limit, loras=loras))

    async def _discover_model(self, spec: WorkerSpec) -> tuple[str, int, tuple[tuple[str, str], ...]]:
        assert self._session is not None
        async with self._session.get(spec.url + "/v1/models") as resp:
            if resp.status != 200:
                raise ValueError(f"/v1/models returned {resp.status}")
            data = await resp.json(content_type=None)
        models = data.get("data") or []
        if not models:
            raise ValueError("/v1/models lists no model")
        base = [m for m in models if isinstance(m, dict) and not m.get("parent")] or models
        limit = base[0].get("max_model_len")
        return (str(base[0]["id"]), (limit if type(limit) is int and 0 < limit < 2**31 else -1),
                lora_adapters(models))

    async def poll_all_metrics(self) -> None:
        fleet = self.fleet
        specs = [s for s in fleet.specs() if fleet.state(s.id).health is Health.HEALTHY]
        await asyncio.gather(*(self.poll_metrics(s) for s in specs))

    async def poll_metrics(self, spec: WorkerSpec) -> None:
        assert self._session is not None
        try:
            async with self._session.get(spec.url + "/metrics") as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return
        # A vLLM metrics page with histograms is large: parse it off the event loop, where
        # placements are answered.
        running, waiting, kv, hits, queries = await asyncio.get_running_loop().run_in_executor(
            None, parse_engine_metrics, text)
        self.fleet.set_engine(spec.id, EngineMetrics(running=running, waiting=waiting, kv_usage=kv,
                                                     prefix_hits=hits, prefix_queries=queries,
                                                     updated_at=time.monotonic()))

    async def expire_heartbeats(self) -> None:
        now = time.monotonic()
        for spec in self.fleet.specs():
            if spec.heartbeat_ttl_s > 0 and self.fleet.heard_from(spec.id) and \
                    now - self.fleet.last_heartbeat(spec.id) > spec.heartbeat_ttl_s:
                log.warning("worker %s missed heartbeats for %.1fs: removed", spec.id,
                            now - self.fleet.last_heartbeat(spec.id))
                await self.registry.remove(spec.id)
