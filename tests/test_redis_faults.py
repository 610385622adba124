"""Two control-plane replicas on one real Redis, a real data plane in front: Redis faults.

* Redis restarting **empty** (no persistence, a new pod) must not delete the fleet: each
  replica writes back the workers it knew, and a model that was served answers 503 (retry),
  never 404, while it has no worker.
* Redis **stalled** (SIGSTOP: connections open, nothing answered) is an outage like a
  refused connection: placements go on from memory at once, and no charge or release made
  around the stall is lost (every replica's ledger returns to 0).

The replicas run in this process (their ledgers and fleets can be inspected); the data
plane and the simulator are real processes; requests are real HTTP.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp

from controlplane.config import ControlPlaneConfig, StateConfig, WorkerSpec as WorkerConfig
from controlplane.server import ControlPlane
from controlplane.state.redis import RedisStore
from controlplane.workers import Role
from omni_proxy.launcher import ProcessGroup
from tests.conftest import wait_until
from tests.redis_fixtures import RedisServer

MODEL = "sim-model"


def _config(sim, redis: RedisServer, prefix: str) -> ControlPlaneConfig:
    return ControlPlaneConfig(listen="127.0.0.1:0", http_port=0,
                              workers=[WorkerConfig(url=sim.url, role=Role.BOTH, id="w", model=MODEL)],
                              state=StateConfig(backend="redis", redis_url=redis.url, key_prefix=prefix))


class Replicas:
    """Two control planes sharing ``redis`` and a data plane that knows both."""

    def __init__(self, sim, redis: RedisServer) -> None:
        self.sim, self.redis = sim, redis
        self.prefix = f"t{uuid.uuid4().hex[:8]}:"
        self.planes: list[ControlPlane] = []
        self.group = ProcessGroup()
        self.dp = None

    async def __aenter__(self) -> Replicas:
        try:
            for _ in range(2):
                plane = ControlPlane(_config(self.sim, self.redis, self.prefix))
                await plane.start()
                self.planes.append(plane)
            targets = ",".join(f"127.0.0.1:{p.grpc_port}" for p in self.planes)
            self.dp = self.group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", targets])
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.group.close()
        for plane in self.planes:
            await plane.stop()

    async def ledgers_idle(self) -> bool:
        """No load on any worker, on every replica (the shared ledger and its local part)."""
        for plane in self.planes:
            loads = await plane.store.loads([s.id for s in plane.fleet.specs()])
            if any(load.requests or load.tokens for load in loads.values()):
                return False
        return True


async def _complete(http: aiohttp.ClientSession, url: str, model: str = MODEL, *,
                    timeout: float = 30.0) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_redis_restarting_empty_keeps_the_fleet_on_every_replica(sim_both, http):
    """Without the write-back both replicas emptied their fleets when Redis came back
    empty and every request got 404 until a control plane restarted."""
    redis = RedisServer().start()   # no persistence: a restart loses everything
    try:
        async with Replicas(sim_both, redis) as r:
            a, b = r.planes
            # an operator's worker, added on one replica only, for a model of its own (the
            # simulator behind it does not serve that model: only placement is looked at)
            await a.registry.add(url=sim_both.url, role=Role.BOTH, model="m2", worker_id="extra", source="admin",
                                 weight=2.0)

            async def both_know() -> bool:
                return all(p.fleet.get("extra") is not None for p in r.planes)
            await wait_until(both_know, what="the added worker on both replicas")
            status, _, body = await _complete(http, r.dp.url)
            assert status == 200, body

            redis.stop()
            redis.start()   # empty

            async def restored() -> bool:
                check = RedisStore(redis.url, key_prefix=r.prefix)
                try:
                    stored = {s.id: s for s in await check.specs()}
                except Exception:  # noqa: BLE001 - still coming up
                    return False
                finally:
                    await check.close()
                return (set(stored) == {"w", "extra"} and stored["extra"].weight == 2.0
                        and all(p._sync.restores >= 1 and p._sync.connected for p in r.planes))
            await wait_until(restored, timeout=20, what="both replicas to write their workers back")
            for plane in r.planes:
                assert {s.id for s in plane.fleet.specs()} == {"w", "extra"}
                assert plane.fleet.get("extra").source == "admin"
            for i in range(8):
                status, _, body = await _complete(http, r.dp.url)
                assert status == 200, (i, body)

            # A model that was served and has no worker now: 503 with Retry-After, not 404.
            await b.registry.remove("extra")

            async def gone() -> bool:
                return all(p.fleet.get("extra") is None for p in r.planes)
            await wait_until(gone, what="the removal on both replicas")
            status, headers, body = await _complete(http, r.dp.url, "m2")
            assert status == 503 and int(headers["Retry-After"]) >= 1, (status, body)
            assert "m2" in body["error"]["message"] and body["error"]["type"]
            status, _, body = await _complete(http, r.dp.url, "never-served")
            assert status == 404 and body["error"]["param"] == "model", body
            await wait_until(r.ledgers_idle, what="every replica's ledger back to 0")
    finally:
        redis.close()


async def test_a_stalled_redis_is_an_outage_and_leaks_no_load(sim_both, http):
    """Redis stopped (SIGSTOP) under a bounded stream of requests. Before: each ledger call
    waited its timeout, one after another on the data plane's session, so placements timed
    out (503 after 5 s); ends that failed were dropped, and a reserve that timed out ran
    when Redis woke up, so load stayed charged with nothing in flight."""
    redis = RedisServer().start()
    try:
        async with Replicas(sim_both, redis) as r:
            status, _, body = await _complete(http, r.dp.url)
            assert status == 200, body
            results: list[tuple[int, float]] = []

            async def one() -> None:
                started = time.monotonic()
                status, _, _ = await _complete(http, r.dp.url)
                results.append((status, time.monotonic() - started))

            tasks: list[asyncio.Task] = []
            try:
                for i in range(60):          # 15 requests/s for 4 s; Redis stopped from 1 s to 4 s
                    if i == 15:
                        redis.pause()
                    tasks.append(asyncio.create_task(one()))
                    await asyncio.sleep(1 / 15)
            finally:
                redis.resume()
                await asyncio.gather(*tasks, return_exceptions=True)
            statuses = sorted({s for s, _ in results})
            assert len(results) == 60 and statuses == [200], statuses
            slowest = max(t for _, t in results)
            # (the stall lasts 3 s: a request that waited for Redis takes about that long)
            assert slowest < 2.0, f"a request took {slowest:.1f}s: the stall was waited for, not treated as an outage"
            assert any(p.store.outages for p in r.planes)   # it was seen as one
            await wait_until(r.ledgers_idle, timeout=20, what="every replica's ledger back to 0")

            async def redis_clean() -> bool:
                check = RedisStore(redis.url, key_prefix=r.prefix)
                try:
                    loads = await check.loads(["w"])
                    return loads["w"].requests == 0 and loads["w"].tokens == 0 and not await check.records()
                finally:
                    await check.close()
            await wait_until(redis_clean, timeout=10, what="no charge or record left in Redis")

            async def replayed() -> bool:   # the outage's kept ends (tombstones, mostly) went out
                return all(p.store.pending == 0 for p in r.planes)
            await wait_until(replayed, timeout=10, what="every kept operation replayed")
            assert await redis_clean()
    finally:
        redis.close()
