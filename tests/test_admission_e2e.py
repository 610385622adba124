"""Admission limits through a real data plane (processes on loopback): the in-flight limit
and its bounded queue answer 429 with Retry-After as OpenAI JSON, waiting requests go by
priority, per-client rate limits, and the body's priority reaches the engine unchanged."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import start_cluster, wait_until

SLOW = {"model": "sim-model", "prompt": "hello there", "max_tokens": 30}


@pytest.fixture(scope="module")
def limits_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("admission") / "limits.toml"
    f.write_text('[default]\nrequests_per_s = 1000\nburst = 1000\n\n'
                 '[keys."key-421c9705553d"]\nrequests_per_s = 0.5\nburst = 2\n')
    return f


@pytest.fixture(scope="module")
def cluster(limits_file):
    c = start_cluster({"agg": "both"}, sim_args={"agg": ["--decode-ms-per-step", "40"]},
                      dp_args=["--max-inflight", "1", "--max-queued", "2", "--queue-timeout", "20",
                               "--rate-limits", str(limits_file)])
    try:
        yield c
    finally:
        c.group.close()


async def _queued(http, cluster) -> int:
    async with http.get(cluster.url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("omni_dp_admission_queued "):
                return int(float(line.split()[1]))
    return -1


async def test_queue_full_is_429_and_priority_orders_the_queue(cluster, http):
    await cluster.fresh()
    done: list[str] = []

    async def post(name: str, body: dict, headers: dict | None = None):
        async with http.post(cluster.url + "/v1/completions", json=body, headers=headers or {}) as r:
            data = await r.json()
            done.append(name)
            return r.status, dict(r.headers), data

    # 4 s on the engine: the queue must fill (two waits for conditions) while it runs, even
    # on a loaded machine (at 1.2 s it once ended before the first wait saw it running).
    first = asyncio.create_task(post("first", {**SLOW, "max_tokens": 100}))
    await wait_until(lambda: _busy(cluster), what="first running")
    low = asyncio.create_task(post("low", {**SLOW, "max_tokens": 2, "priority": 10}))
    await wait_until(lambda: _is(http, cluster, 1), what="one queued")
    high = asyncio.create_task(post("high", {**SLOW, "max_tokens": 2}, {"X-Priority": "-10"}))
    await wait_until(lambda: _is(http, cluster, 2), what="two queued")
    status, headers, data = await post("over", SLOW)
    assert status == 429 and headers["Retry-After"] == "1"
    assert data["error"]["code"] == 429 and "overloaded" in data["error"]["message"]
    results = await asyncio.gather(first, low, high)
    assert [r[0] for r in results] == [200, 200, 200]
    assert done.index("high") < done.index("low")
    # the body's priority went to the engine unchanged, the header's did not become a field
    bodies = [r["body"] for r in await cluster.sim_requests("agg")]
    assert any(b.get("priority") == 10 for b in bodies)
    assert sum("priority" in b for b in bodies) == 1


async def _busy(cluster) -> bool:
    state = await cluster.sim_get("agg", "/sim/state")
    return state["running"] >= 1


async def _is(http, cluster, n: int) -> bool:
    return await _queued(http, cluster) == n


async def test_bad_priority_is_400(cluster, http):
    await cluster.fresh()
    for body, headers in (({**SLOW, "max_tokens": 1, "priority": "high"}, {}),
                          ({**SLOW, "max_tokens": 1}, {"X-Priority": "99999999999"})):
        async with http.post(cluster.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 400
            assert "priority" in (await r.json())["error"]["message"].lower()


async def test_rate_limit_per_key(cluster, http):
    await cluster.fresh()
    body = {**SLOW, "max_tokens": 1}
    limited = {"Authorization": "Bearer slow-client"}     # its hash has its own small bucket
    statuses = []
    for _ in range(3):
        async with http.post(cluster.url + "/v1/completions", json=body, headers=limited) as r:
            statuses.append(r.status)
            last = (r.headers.get("Retry-After"), await r.json())
    assert statuses == [200, 200, 429]
    assert last[0] is not None and int(last[0]) >= 1
    assert last[1]["error"]["code"] == 429 and "rate limit" in last[1]["error"]["message"]
    # another client is not affected
    async with http.post(cluster.url + "/v1/completions", json=body,
                         headers={"Authorization": "Bearer other"}) as r:
        assert r.status == 200
