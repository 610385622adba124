"""Sequential PD with two prefill workers: a failing P is retried on the other one."""

from __future__ import annotations

import pytest

from protos import omni_proxy_pb2 as pb
from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"p-a": "prefill", "p-b": "prefill", "d": "decode"}, policy="round_robin",
                      dp_args=["--prefill-timeout", "1.5"])
    yield c
    c.group.close()


@pytest.fixture
async def pd(cluster: Cluster):
    await cluster.fresh()
    yield cluster
    await cluster.restore()      # faults armed "until cleared" must not outlive a failed test
    await wait_until(cluster.all_idle, what="idle after the test (load leaked)")


async def test_failed_prefill_is_retried_on_another_prefill_worker(pd: Cluster, http):
    await pd.sim_post("p-a", "/sim/faults", {"status": 500, "message": "p-a is sick", "count": -1})
    ids = []
    for i in range(4):
        async with http.post(pd.url + "/v1/completions", headers={"X-Request-Id": f"retry-{i}"},
                             json={"model": MODEL, "prompt": "retry me", "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
            ids.append(f"retry-{i}")
    on_a = {x["request_id"] for x in await pd.sim_requests("p-a")}
    on_b = {x["request_id"] for x in await pd.sim_requests("p-b")}
    assert on_a, "round robin never tried p-a first"
    assert on_a <= on_b            # everything p-a failed was redone on p-b
    assert {x["request_id"].rsplit("-", 1)[0] for x in await pd.sim_requests("d")} == set(ids)
    assert (await pd.workers())["p-a"].failures_total >= len(on_a)


async def test_all_prefill_workers_failing_gives_the_engines_error_and_decode_is_never_called(pd: Cluster, http):
    for name in ("p-a", "p-b"):
        await pd.sim_post(name, "/sim/faults", {"status": 503, "message": f"{name} down", "count": -1})
    async with http.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}) as r:
        assert r.status == 503     # an engine's 503 reaches the client as such (a 500 would be a 502)
        err = (await r.json())["error"]
    assert err["upstream_status"] == 503 and "down" in err["message"]
    assert len(await pd.sim_requests("p-a")) == 1 and len(await pd.sim_requests("p-b")) == 1
    assert await pd.sim_requests("d") == []


async def test_prefill_over_its_timeout_is_retried_elsewhere_and_stays_in_rotation(pd: Cluster, http):
    await pd.sim_post("p-a", "/sim/faults", {"delay_s": 5, "count": -1})
    for _i in range(2):   # round robin: one of the two starts on p-a
        async with http.post(pd.url + "/v1/completions",
                             json={"model": MODEL, "prompt": "slow", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
    assert len(await pd.sim_requests("p-a")) >= 1 and len(await pd.sim_requests("p-b")) == 2
    a = (await pd.workers())["p-a"]
    assert a.failures_total >= 1 and a.status == pb.STATUS_HEALTHY   # slow is not dead



async def test_a_prefill_4xx_is_not_tried_on_another_prefill_worker(pd: Cluster, http):
    """A 4xx would fail on every P: one P sees the request, D never does. (Most 4xx pass
    through as the client's own error before any retry decision; 408 reaches the retry
    policy, omni_runtime.retry, which never retries a 4xx.) A P that answers 5xx is retried, above."""
    for name in ("p-a", "p-b"):
        await pd.sim_post(name, "/sim/faults", {"status": 408, "message": f"{name}: request timeout", "count": -1})
    async with http.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert err["upstream_status"] == 408 and "request timeout" in err["message"]
    assert len(await pd.sim_requests("p-a")) + len(await pd.sim_requests("p-b")) == 1
    assert await pd.sim_requests("d") == []
