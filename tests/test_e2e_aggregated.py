"""The request path end to end on real processes: data plane -> control plane -> engines.

Two aggregated engine simulators, one control plane, one data plane, all on loopback.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import grpc
import openai
import orjson
import pytest

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"


@pytest.fixture(scope="module")
def cluster():
    small = ["--max-model-len", "4096"]
    c = start_cluster({"agg-a": "both", "agg-b": "both"}, dp_args=["--max-body-bytes", "65536"],
                      sim_args={"agg-a": small, "agg-b": small})
    yield c
    c.group.close()


@pytest.fixture
async def idle(cluster: Cluster):
    """Every test starts and ends with no load left on any worker, and leaves no fault, drain,
    weight or added worker behind, even when it fails."""
    await cluster.restore()     # the first call records what later calls restore
    await wait_until(cluster.all_idle, what="all workers idle before the test")
    try:
        yield cluster
    finally:
        await cluster.restore()
    await wait_until(cluster.all_idle, what="all workers idle after the test (load leaked)")


async def test_openai_client_non_streaming_completion(idle: Cluster):
    client = openai.AsyncOpenAI(base_url=idle.url + "/v1", api_key="unused")
    resp = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7)
    assert resp.object == "text_completion"
    assert resp.usage.completion_tokens == 7
    assert resp.choices[0].text
    await client.close()


async def test_openai_client_streaming_chat(idle: Cluster):
    client = openai.AsyncOpenAI(base_url=idle.url + "/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    content, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            content.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(content)
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 5
    await client.close()


async def test_sse_framing_passes_through_exactly(idle: Cluster, http: aiohttp.ClientSession):
    body = {"model": MODEL, "prompt": "frame me", "max_tokens": 4, "stream": True}
    async with http.post(idle.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [orjson.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    assert len(payloads) == 4 and payloads[-1]["choices"][0]["finish_reason"] == "length"


async def test_request_id_reaches_the_engine_and_the_body_is_untouched(idle: Cluster, http):
    await idle.clear_sim_requests()
    sent = b'{"model": "sim-model",  "prompt": "exact bytes", "max_tokens": 2, "temperature": 0}'
    async with http.post(idle.url + "/v1/completions", data=sent,
                         headers={"X-Request-Id": "client-id-123", "Content-Type": "application/json"}) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "client-id-123"
        data = await r.json()
    seen = [req for name in idle.sims for req in await idle.sim_requests(name)]
    assert len(seen) == 1
    # The engine's id is the client's label plus our unique one: client ids are never keys.
    assert seen[0]["request_id"].startswith("client-id-123-")
    assert data["id"] == "cmpl-" + seen[0]["request_id"]
    assert seen[0]["body"] == orjson.loads(sent)


async def test_generated_request_id_when_client_sends_none(idle: Cluster, http):
    await idle.clear_sim_requests()
    async with http.post(idle.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
        rid = r.headers["X-Request-Id"]
        assert r.status == 200 and len(rid) >= 16
    seen = [req for name in idle.sims for req in await idle.sim_requests(name)]
    assert [s["request_id"] for s in seen] == [rid]


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"", 400, "empty"),
    (b'{"model": "sim-model", "prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "sim-model", "prompt": "x", "stream": "yes"}', 400, "stream"),
    (b'{"model": "sim-model", "prompt": {"a": 1}}', 400, "prompt"),
    (b'{"model": 5, "prompt": "x"}', 400, "model"),
    (b'{"model": "sim-model", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "no-such-model", "prompt": "x"}', 404, "no-such-model"),
])
async def test_bad_input_gets_openai_style_errors(idle: Cluster, http, body, status, fragment):
    async with http.post(idle.url + "/v1/completions", data=body,
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert fragment in err["message"]
    assert err["code"] == status and err["type"]


async def test_chat_validation(idle: Cluster, http):
    async with http.post(idle.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "messages"


async def test_body_over_the_limit_is_413_and_the_server_keeps_serving(idle: Cluster, http):
    big = {"model": MODEL, "prompt": "x" * 70_000, "max_tokens": 1}
    async with http.post(idle.url + "/v1/completions", json=big) as r:
        assert r.status == 413
        assert "limit" in (await r.json())["error"]["message"]
    async with http.post(idle.url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}) as r:
        assert r.status == 200


async def test_unknown_route_and_method_are_json_errors(idle: Cluster, http):
    async with http.get(idle.url + "/v1/nothing") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == 404
    async with http.get(idle.url + "/v1/completions") as r:
        assert r.status == 405 and "error" in await r.json()


async def test_upstream_5xx_is_502_with_the_engines_status_and_message(idle: Cluster, http):
    for name in idle.sims:
        await idle.sim_post(name, "/sim/faults", {"status": 500, "message": "engine exploded", "count": 1})
    async with http.post(idle.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert err["upstream_status"] == 500 and "engine exploded" in err["message"]
    for name in idle.sims:
        await idle.sim_post(name, "/sim/faults", {"clear": True})
    workers = await idle.workers()
    assert sum(w.failures_total for w in workers.values()) >= 1


async def test_upstream_4xx_passes_through_with_the_engines_message(idle: Cluster, http):
    long_prompt = list(range(5000))  # longer than the simulators' max_model_len
    async with http.post(idle.url + "/v1/completions",
                         json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"]


async def test_concurrent_burst_is_balanced_and_fully_released(idle: Cluster, http):
    await idle.clear_sim_requests()

    async def one(i):
        async with http.post(idle.url + "/v1/completions",
                             json={"model": MODEL, "prompt": f"burst {i}", "max_tokens": 8}) as r:
            assert r.status == 200
            await r.read()

    await asyncio.gather(*(one(i) for i in range(24)))
    counts = [len(await idle.sim_requests(name)) for name in idle.sims]
    assert sum(counts) == 24
    assert min(counts) >= 8, f"unbalanced burst {counts}"


async def test_client_disconnect_cancels_upstream_and_frees_load(idle: Cluster, http):
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 3000, "stream": True}

    async def aborts() -> int:
        return sum([(await idle.sim_get(n, "/sim/state"))["finished"].get("abort", 0) for n in idle.sims])

    aborts0 = await aborts()
    async with http.post(idle.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()       # the stream is flowing
        workers = await idle.workers()
        assert sum(w.load.inflight_requests for w in workers.values()) == 1
        assert not r.content.at_eof()
    # Leaving the block closed the connection mid-stream.

    async def engines_aborted():
        return all([await idle.engine_idle(n) for n in idle.sims]) and await aborts() == aborts0 + 1

    # aborted, not finished on its own: the disconnect reached the engine
    await wait_until(engines_aborted, what="engines to abort the cancelled request")
    await wait_until(idle.all_idle, what="control plane to release the cancelled request")


async def test_models_health_and_metrics(idle: Cluster, http):
    # One placement of its own, so the placement histogram has a sample whatever ran before.
    async with http.post(idle.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200
    async with http.get(idle.url + "/v1/models") as r:
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with http.get(idle.url + "/health") as r:
        assert r.status == 200
    async with http.get(idle.url + "/metrics") as r:
        text = await r.text()
    assert "omni_dp_requests_total" in text and 'route="/v1/completions"' in text
    assert "omni_dp_placement_seconds_bucket" in text
    # vLLM's model_name label beside ours, on every per-model series
    assert (f'omni_dp_e2e_request_latency_seconds_count{{flow="aggregated",model="{MODEL}",model_name="{MODEL}"}}'
            in text)
    async with http.get(f"http://127.0.0.1:{idle.cp.info['http_port']}/metrics") as r:
        text = await r.text()
    assert "omni_worker_inflight_requests" in text and "omni_placements_total" in text
    assert f'model="{MODEL}",model_name="{MODEL}"' in text


async def test_drain_undrain_and_no_healthy_worker_is_503(idle: Cluster, http):
    async with grpc.aio.insecure_channel(idle.cp.address) as ch:
        admin = pb_grpc.AdminStub(ch)
        await admin.Drain(pb.WorkerRef(worker_id="agg-a"))
        await idle.clear_sim_requests()
        for _i in range(4):
            async with http.post(idle.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": "d", "max_tokens": 1}) as r:
                assert r.status == 200
        assert len(await idle.sim_requests("agg-a")) == 0
        assert len(await idle.sim_requests("agg-b")) == 4
        await admin.Drain(pb.WorkerRef(worker_id="agg-b"))
        async with http.post(idle.url + "/v1/completions", json={"model": MODEL, "prompt": "d"}) as r:
            assert r.status == 503
            assert "draining" in (await r.json())["error"]["message"]
        await admin.Undrain(pb.WorkerRef(worker_id="agg-a"))
        await admin.Undrain(pb.WorkerRef(worker_id="agg-b"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.Drain(pb.WorkerRef(worker_id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_weight_zero_parks_a_worker(idle: Cluster, http):
    async with grpc.aio.insecure_channel(idle.cp.address) as ch:
        admin = pb_grpc.AdminStub(ch)
        await admin.SetWeight(pb.SetWeightRequest(worker_id="agg-b", weight=0))
        await idle.clear_sim_requests()
        for _ in range(4):
            async with http.post(idle.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": "w", "max_tokens": 1}) as r:
                assert r.status == 200
        assert len(await idle.sim_requests("agg-b")) == 0
        await admin.SetWeight(pb.SetWeightRequest(worker_id="agg-b", weight=1))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.SetWeight(pb.SetWeightRequest(worker_id="agg-b", weight=-1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unhealthy_engine_gets_no_placements_until_it_recovers(idle: Cluster, http):
    await idle.sim_post("agg-a", "/sim/faults", {"healthy": False})

    async def a_unhealthy():
        return (await idle.workers())["agg-a"].status == pb.STATUS_UNHEALTHY

    await wait_until(a_unhealthy, what="agg-a marked unhealthy")
    await idle.clear_sim_requests()
    for _ in range(4):
        async with http.post(idle.url + "/v1/completions", json={"model": MODEL, "prompt": "h", "max_tokens": 1}) as r:
            assert r.status == 200
    assert len(await idle.sim_requests("agg-a")) == 0
    await idle.sim_post("agg-a", "/sim/faults", {"clear": True})

    async def a_healthy():
        return (await idle.workers())["agg-a"].status == pb.STATUS_HEALTHY

    await wait_until(a_healthy, what="agg-a healthy again")


async def test_registry_register_heartbeat_deregister_and_ttl(idle: Cluster):
    url = idle.sims["agg-a"].url
    async with grpc.aio.insecure_channel(idle.cp.address) as ch:
        reg = pb_grpc.RegistryStub(ch)
        r = await reg.Register(pb.RegisterRequest(url=url, role=pb.ROLE_BOTH, worker_id="plugin-1",
                                                  heartbeat_ttl_s=30))
        assert r.worker_id == "plugin-1" and r.heartbeat_interval_s > 0

        async def discovered():
            w = (await idle.workers()).get("plugin-1")
            return w is not None and w.status == pb.STATUS_HEALTHY and w.model == MODEL

        await wait_until(discovered, what="registered worker health-checked and its model discovered")
        assert (await reg.Heartbeat(pb.HeartbeatRequest(worker_id="plugin-1", running=-1))).known
        await reg.Deregister(pb.DeregisterRequest(worker_id="plugin-1"))
        assert "plugin-1" not in await idle.workers()
        assert not (await reg.Heartbeat(pb.HeartbeatRequest(worker_id="plugin-1"))).known

        await reg.Register(pb.RegisterRequest(url=url, role=pb.ROLE_BOTH, worker_id="plugin-2", heartbeat_ttl_s=0.3))

        async def expired():
            return "plugin-2" not in await idle.workers()

        await wait_until(expired, what="a worker that stopped heart-beating to be removed")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reg.Register(pb.RegisterRequest(url="", role=pb.ROLE_BOTH))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_omni_ctl_lists_and_explains(cluster: Cluster):
    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", cluster.cp.address,
                               *args], capture_output=True, text=True, timeout=60)

    out = ctl("--json", "workers")
    assert out.returncode == 0, out.stderr
    data = orjson.loads(out.stdout)
    assert {w["id"] for w in data["workers"]} >= {"agg-a", "agg-b"} and data["policy"] == "least_load"
    out = ctl("explain", "--model", MODEL, "--prompt-tokens", "500")
    assert out.returncode == 0, out.stderr
    assert "flow aggregated" in out.stdout and "policy=least_load" in out.stdout
    out = ctl("drain", "no-such-worker")
    assert out.returncode == 3 and "NOT_FOUND" in out.stderr
