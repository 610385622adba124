"""An engine that fails before the first byte is replaced by another worker.

Reliability issue, upstream faults: 40 injected engine 500s reached clients as 502 while a
healthy engine stood beside the failing one. Now aggregated and decode legs are retried
on another worker (bounded, with jittered backoff), never for the client's own 4xx, and
the failing engine's Retry-After keeps it out of rotation.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Cluster, start_cluster, wait_until

BODY = {"model": "sim-model", "prompt": "retry me", "max_tokens": 3}


@pytest.fixture(scope="module")
def agg():
    c = start_cluster({"a": "both", "b": "both"}, policy="round_robin")
    try:
        yield c
    finally:
        c.group.close()


@pytest.fixture(scope="module")
def pd():
    c = start_cluster({"p": "prefill", "d1": "decode", "d2": "decode"}, policy="round_robin")
    try:
        yield c
    finally:
        c.group.close()


async def _failures(c: Cluster) -> dict[str, int]:
    return {wid: w.failures_total for wid, w in (await c.workers()).items()}


async def _upstream_errors(c: Cluster, http, worker: str, status: str) -> float:
    """The data plane's omni_dp_upstream_errors for ``worker`` and ``status``."""
    async with http.get(c.url + "/metrics") as r:
        text = await r.text()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "omni_dp_upstream_errors_total" and s.labels == {"worker": worker, "status": status})


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_5xx_before_the_first_byte_is_retried_on_another_worker(agg: Cluster, http, stream):
    await agg.fresh()
    before = await _failures(agg)
    counted = await _upstream_errors(agg, http, "a", "500")
    try:
        await agg.sim_post("a", "/sim/faults", {"status": 500, "message": "engine fell over", "count": 2})
        for _ in range(4):
            async with http.post(agg.url + "/v1/completions", json={**BODY, "stream": stream}) as r:
                assert r.status == 200, await r.text()
                await r.read()
        after = await _failures(agg)
        assert after["a"] - before["a"] == 2 and after["b"] == before["b"]
        # the retry policy's on_retry hook counted each on the data plane
        assert await _upstream_errors(agg, http, "a", "500") - counted == 2
    finally:
        await agg.sim_post("a", "/sim/faults", {"clear": True})
    await wait_until(agg.all_idle, what="load released")


async def test_client_errors_are_not_retried(agg: Cluster, http):
    await agg.fresh()
    try:
        for name in ("a", "b"):
            await agg.sim_post(name, "/sim/faults", {"status": 400, "message": "bad prompt", "count": 1})
        async with http.post(agg.url + "/v1/completions", json=BODY) as r:
            assert r.status == 400 and "bad prompt" in await r.text()
        served = [len(await agg.sim_requests(n)) for n in ("a", "b")]
        assert sorted(served) == [0, 1]         # one engine saw it, nobody was asked again
    finally:
        for name in ("a", "b"):
            await agg.sim_post(name, "/sim/faults", {"clear": True})
    await wait_until(agg.all_idle, what="load released")


async def test_retry_after_keeps_the_engine_out_of_rotation(agg: Cluster, http):
    await agg.fresh()
    try:
        await agg.sim_post("a", "/sim/faults", {"status": 429, "message": "busy", "retry_after": "30", "count": 1})
        await agg.sim_post("b", "/sim/faults", {"clear": True})
        for _ in range(6):
            async with http.post(agg.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200
        workers = await agg.workers()
        assert workers["a"].circuit == "open" and workers["a"].ejected_for_s > 20
        assert len(await agg.sim_requests("a")) == 1    # only the request it refused
    finally:
        await agg.sim_post("a", "/sim/faults", {"clear": True})
    await wait_until(agg.all_idle, what="load released")


async def test_a_decode_engine_failing_before_the_first_byte_is_replaced(pd: Cluster, http):
    await pd.fresh()
    try:
        await pd.sim_post("d1", "/sim/faults", {"status": 503, "message": "decode busy", "count": 100})
        for _ in range(4):   # round robin sends some of them to d1 first
            async with http.post(pd.url + "/v1/completions", json={**BODY, "stream": True}) as r:
                assert r.status == 200, await r.text()
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
        assert len(await pd.sim_requests("d2")) == 4
        assert (await pd.workers())["d1"].failures_total >= 1
    finally:
        await pd.sim_post("d1", "/sim/faults", {"clear": True})
    await wait_until(pd.all_idle, what="load released")
