"""A data plane with several control-plane replicas: fail over, then fall back, then return.

Two control planes (each knowing both engines) and one data plane given both addresses.
Killing the replica it uses moves it to the other without failing requests; killing both
leaves it placing locally over the last known workers (its /health says "degraded");
starting a replica again ends the fallback.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from omni_proxy.launcher import ProcessGroup
from tests.conftest import wait_until

BODY = {"model": "sim-model", "prompt": "still here?", "max_tokens": 3}


def _cp_args(sims, listen: str = "127.0.0.1:0") -> list[str]:
    args = ["controlplane", "--listen", listen, "--http-port", "0", "--policy", "round_robin",
            "--health-interval", "0.2"]
    for name, child in sims.items():
        args += ["--worker", f"{child.url},role=both,id={name}"]
    return args


@pytest.fixture
def system():
    group = ProcessGroup()
    try:
        sims = {n: group.start(n, ["sim", "--role", "both", "--port", "0"]) for n in ("a", "b")}
        cps = [group.start(f"cp{i}", _cp_args(sims)) for i in (1, 2)]
        dp = group.start("dp", ["dataplane", "--port", "0", "--controlplane", ",".join(c.address for c in cps),
                                "--fallback-after", "0.5", "--placement-timeout", "5"])
        yield group, sims, cps, dp
    finally:
        group.close()


async def _health(http, dp) -> dict:
    async with http.get(dp.url + "/health") as r:
        return await r.json()


async def _metric(http, dp, name: str) -> float:
    async with http.get(dp.url + "/metrics") as r:
        m = re.search(rf"^{name} (\S+)$", await r.text(), re.M)
    return float(m.group(1)) if m else 0.0


async def _burst(http, dp, n: int) -> list[int]:
    async def one() -> int:
        async with http.post(dp.url + "/v1/completions", json=BODY) as r:
            await r.read()
            return r.status
    return await asyncio.gather(*(one() for _ in range(n)))


async def test_failover_then_local_fallback_then_back(system, http):
    group, sims, cps, dp = system
    await wait_until(lambda: _connected_and_listed(http, dp), what="the data plane connected with a worker list")
    assert await _burst(http, dp, 6) == [200] * 6
    # round_robin needs no shared state: the data plane places itself and tells the replica.
    assert await _metric(http, dp, "omni_dp_local_placements_total") == 6

    # The replica in use dies: the other one takes over, no request fails.
    using = (await _health(http, dp))["controlplane"]
    first = next(c for c in cps if c.address == using)
    other = next(c for c in cps if c is not first)
    group.kill(first)
    statuses = await _burst(http, dp, 6)
    assert statuses == [200] * 6
    await wait_until(lambda: _uses(http, dp, other.address), what="the data plane on the other replica")
    assert await _burst(http, dp, 4) == [200] * 4

    # No replica left: local round robin over the last known workers.
    group.kill(other)
    assert await _burst(http, dp, 6) == [200] * 6
    health = await _health(http, dp)
    assert health["status"] == "degraded" and health["fallback_workers"] == 2
    assert await _metric(http, dp, "omni_dp_fallback_placements_total") >= 6
    async with http.get(dp.url + "/v1/models") as r:
        assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["sim-model"]
    served = {n: len(await _requests(http, s)) for n, s in sims.items()}
    assert all(v > 0 for v in served.values())

    # A replica comes back (on the same address): placement returns to it.
    group.start("cp1-again", _cp_args(sims, listen=first.address))
    await wait_until(lambda: _uses(http, dp, first.address), timeout=20, what="the data plane back on a replica")
    before = await _metric(http, dp, "omni_dp_fallback_placements_total")
    local = await _metric(http, dp, "omni_dp_local_placements_total")
    assert await _burst(http, dp, 4) == [200] * 4
    assert await _metric(http, dp, "omni_dp_fallback_placements_total") == before
    assert await _metric(http, dp, "omni_dp_local_placements_total") == local + 4


async def _connected_and_listed(http, dp) -> bool:
    return (await _health(http, dp)).get("status") == "ok" and \
        await _metric(http, dp, "omni_dp_fallback_workers") == 2


async def _uses(http, dp, address: str) -> bool:
    return (await _health(http, dp)).get("controlplane") == address


async def _requests(http: aiohttp.ClientSession, sim) -> list:
    async with http.get(sim.url + "/sim/requests") as r:
        return (await r.json())["requests"]
