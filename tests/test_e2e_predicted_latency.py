"""Predicted-latency placement and late binding through real processes.

Simulated engines with a slow prefill, the control plane with the ``predicted_latency``
policy (and a profile whose queue holds every request while prefill work is pending),
and a data plane: the models learn from the data plane's reports, held requests wait in
the control plane and still all succeed, and a client that gives up while its request
waits never reaches an engine.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from tests.conftest import Cluster, start_cluster, wait_until

PROFILE = """
[profiles.held]
scorers = [{name = "predicted_latency"}]
queue = {name = "omni", hold_s = 0.0, max_wait_s = 30.0}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = tmp_path_factory.mktemp("cp") / "cp.toml"
    config.write_text(PROFILE)
    slow = ["--prefill-ms-per-token", "2.0", "--decode-ms-per-step", "5"]
    c = start_cluster({"a": "both", "b": "both"}, policy="held", cp_args=["--config", str(config)],
                      sim_args={"a": slow, "b": slow})
    try:
        yield c
    finally:
        c.group.close()


async def cp_metrics(c: Cluster, http: aiohttp.ClientSession) -> str:
    async with http.get(f"http://127.0.0.1:{c.cp.info['http_port']}/metrics") as r:
        assert r.status == 200
        return await r.text()


def metric(text: str, name: str, **labels) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}{{{re.escape(sel)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$",
                  text, re.M)
    return float(m.group(1)) if m else 0.0


_prompts = iter(range(1, 1_000_000))


async def complete(http, url, tokens: int, max_tokens: int = 4) -> int:
    """A streamed completion of a prompt no other request shares (no prefix-cache hits)."""
    first = next(_prompts)
    body = {"model": "", "prompt": [first] + [7] * (tokens - 1), "max_tokens": max_tokens, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def test_held_requests_wait_in_the_control_plane_and_all_succeed(cluster: Cluster, http):
    await cluster.fresh()
    # Eight 200-token prompts (0.4 s of prefill each) at once on two engines: two start,
    # the others are held until an engine's prefill work is done.
    statuses = await asyncio.gather(*(complete(http, cluster.url, 200) for _ in range(8)))
    assert statuses == [200] * 8
    text = await cp_metrics(cluster, http)
    assert metric(text, "omni_queue_events_total", event="queued") >= 4
    assert metric(text, "omni_queue_events_total", event="dispatched") >= 4
    assert metric(text, "omni_queue_depth") == 0
    # The engines saw no queue of their own: never more than one request prefilling.
    for name in ("a", "b"):
        assert len(await cluster.sim_requests(name)) >= 1
    # The models learned from real first tokens and finished streams.
    learned = sum(metric(text, "omni_worker_prediction_observations_total", kind="ttft", worker=w) for w in "ab")
    assert learned >= 8
    for w in "ab":   # ~2 ms/token measured by the engines' own rhythm (prior was 0.1 ms)
        assert metric(text, "omni_worker_prefill_seconds_per_token", worker=w) > 5e-4
    await wait_until(cluster.all_idle, what="all load released")
    text = await cp_metrics(cluster, http)
    assert all(metric(text, "omni_worker_prefill_tokens_pending", worker=w) == 0 for w in "ab")


async def test_a_client_that_leaves_while_held_never_reaches_an_engine(cluster: Cluster, http):
    await cluster.fresh()
    before = metric(await cp_metrics(cluster, http), "omni_queue_events_total", event="cancelled")
    busy = [asyncio.create_task(complete(http, cluster.url, 1500)) for _ in range(2)]   # 3 s each
    await wait_until(lambda: _pending_on_both(cluster, http), what="both engines busy")
    impatient = asyncio.create_task(complete(http, cluster.url, 10))
    await wait_until(lambda: _queued(cluster, http, 1), what="the short request to be held")
    impatient.cancel()
    await asyncio.gather(impatient, return_exceptions=True)
    await wait_until(lambda: _cancelled(cluster, http, before + 1), what="the held request to leave the queue")
    assert await asyncio.gather(*busy) == [200, 200]
    seen = [r for name in ("a", "b") for r in await cluster.sim_requests(name)]
    assert len(seen) == 2     # the impatient request never reached an engine
    await wait_until(cluster.all_idle, what="all load released")


async def _pending_on_both(c, http) -> bool:
    text = await cp_metrics(c, http)
    return all(metric(text, "omni_worker_prefill_tokens_pending", worker=w) > 0 for w in "ab")


async def _queued(c, http, depth) -> bool:
    return metric(await cp_metrics(c, http), "omni_queue_depth") == depth


async def _cancelled(c, http, n) -> bool:
    return metric(await cp_metrics(c, http), "omni_queue_events_total", event="cancelled") >= n
