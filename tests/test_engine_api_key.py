"""Engines behind an API key (vLLM's --api-key) get it on every call the proxy makes.

The control plane's model discovery and the metaserver's prefill leg used to go without
it; then a worker never became routable, or every layerwise request failed.
"""

from __future__ import annotations

import pytest

from tests.conftest import start_cluster, wait_until

KEY = "s3cret-engine-key"


async def _routable(cluster, n: int) -> bool:
    workers = await cluster.workers()
    return sum(1 for w in workers.values() if w.model == "sim-model" and w.status == 1) == n


@pytest.mark.parametrize("flow,sims", [
    ("sequential", {"agg": "both"}),
    ("layerwise", {"prefill-0": "prefill", "decode-0": "decode"}),
])
async def test_every_engine_call_carries_the_key(flow, sims, http):
    cluster = start_cluster(sims, cp_args=["--engine-api-key", KEY, "--pd-flow", flow, "--metaserver-host",
                                           "127.0.0.1"],
                            dp_args=["--engine-api-key", KEY], sim_args={n: ["--api-key", KEY] for n in sims})
    try:
        await wait_until(lambda: _routable(cluster, len(sims)), what="models discovered with the key")
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3}
        async with http.post(cluster.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        for name in sims:
            for req in await cluster.sim_requests(name):
                assert req["headers"].get("authorization") == f"Bearer {KEY}"
    finally:
        cluster.group.close()


async def test_without_the_key_the_control_plane_cannot_discover_the_model(http):
    cluster = start_cluster({"agg": "both"}, dp_args=["--engine-api-key", KEY], sim_args={"agg": ["--api-key", KEY]})
    try:
        await wait_until(lambda: _has_error(cluster), what="a failed discovery")
        assert not await _routable(cluster, 1)
    finally:
        cluster.group.close()


async def _has_error(cluster) -> bool:
    return any("401" in w.last_error for w in (await cluster.workers()).values())
