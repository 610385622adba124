"""Sequential PD (vLLM pull flow) end to end: one prefill and one decode simulator."""

from __future__ import annotations

import openai
import orjson
import pytest

from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"prefill-0": "prefill", "decode-0": "decode"})
    yield c
    c.group.close()


@pytest.fixture
async def pd(cluster: Cluster):
    await cluster.fresh()
    yield cluster
    await cluster.restore()      # faults armed "until cleared" must not outlive a failed test
    await wait_until(cluster.all_idle, what="idle after the test (load leaked)")


async def test_prefill_leg_then_decode_leg_with_kv_transfer_params(pd: Cluster, http):
    before = await pd.sim_get("decode-0", "/sim/state")
    body = {"model": MODEL, "prompt": "disaggregate me please " * 20, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3}
    async with http.post(pd.url + "/v1/completions", json=body, headers={"X-Request-Id": "pd-req-1"}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")

    (p_req,) = await pd.sim_requests("prefill-0")
    (d_req,) = await pd.sim_requests("decode-0")
    # P: capped at one token, not streamed, asked to keep the KV for a remote decode.
    pb = p_req["body"]
    assert pb["max_tokens"] == 1 and pb["min_tokens"] == 1 and pb["stream"] is False
    assert "stream_options" not in pb
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert pb["kv_transfer_params"]["do_remote_prefill"] is False
    assert pb["prompt"] == body["prompt"]
    # D: the client's own request plus what P returned.
    db = d_req["body"]
    assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == body
    ktp = db["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["remote_block_ids"]
    assert ktp["remote_engine_id"] == (await pd.sim_get("prefill-0", "/sim/state"))["engine_id"]
    # Same X-Request-Id on both legs: the client's label plus our unique id.
    assert p_req["request_id"] == d_req["request_id"] and p_req["request_id"].startswith("pd-req-1-")
    # D got the prompt by KV transfer, not by computing it again; P's lease was released.
    after = await pd.sim_get("decode-0", "/sim/state")
    assert after["prompt_tokens_external"] > before["prompt_tokens_external"]
    assert after["prompt_tokens_local"] == before["prompt_tokens_local"]
    assert (await pd.sim_get("prefill-0", "/sim/state"))["kv_leases"] == 0


async def test_openai_client_through_pd_streaming_chat_and_plain_completion(pd: Cluster):
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "split me"}], max_tokens=6, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    resp = await client.completions.create(model=MODEL, prompt="and me", max_tokens=3)
    assert resp.usage.completion_tokens == 3
    await client.close()
    workers = await pd.workers()
    assert workers["prefill-0"].placements_total >= 2 and workers["decode-0"].placements_total >= 2


async def test_prefill_without_kv_transfer_params_fails_cleanly_and_decode_is_never_called(pd: Cluster, http):
    await pd.sim_post("prefill-0", "/sim/faults", {"omit_kv_transfer_params": True, "count": 1})
    async with http.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}) as r:
        assert r.status == 502
        assert "kv_transfer_params" in (await r.json())["error"]["message"]
    assert await pd.sim_requests("decode-0") == []


async def test_prefill_error_is_502_with_the_engines_message(pd: Cluster, http):
    await pd.sim_post("prefill-0", "/sim/faults", {"status": 500, "message": "prefill overloaded", "count": 1})
    async with http.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert err["upstream_status"] == 500 and "prefill overloaded" in err["message"]
    assert await pd.sim_requests("decode-0") == []


async def test_decode_error_after_prefill_releases_both(pd: Cluster, http):
    await pd.sim_post("decode-0", "/sim/faults", {"status": 500, "message": "decode died", "count": 1})
    async with http.post(pd.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}) as r:
        assert r.status == 502
        assert "decode died" in (await r.json())["error"]["message"]


async def test_client_disconnect_during_decode_aborts_and_frees_everything(pd: Cluster, http):
    body = {"model": MODEL, "prompt": "long decode", "max_tokens": 3000, "stream": True}
    aborts = (await pd.sim_get("decode-0", "/sim/state"))["finished"].get("abort", 0)
    async with http.post(pd.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()

        # P is released at D's first chunk; D holds the request. Both reach the control plane
        # as lifecycle reports after the chunk reached us: wait for them, do not race them.
        async def p_released_d_holds() -> bool:
            w = await pd.workers()
            return w["prefill-0"].load.inflight_requests == 0 and w["decode-0"].load.inflight_requests == 1

        await wait_until(p_released_d_holds, what="P released and D holding the request while D streams")
        assert not r.content.at_eof(), "the stream ended before the disconnect: the test checked nothing"

    async def decode_aborted() -> bool:
        state = await pd.sim_get("decode-0", "/sim/state")
        return state["running"] == 0 and state["finished"].get("abort", 0) == aborts + 1

    # aborted, not finished on its own: the disconnect reached the engine
    await wait_until(decode_aborted, what="decode engine to abort the request")
    await wait_until(pd.all_idle, what="control plane to release the request")


async def test_non_streaming_pd_response_passes_through(pd: Cluster, http):
    async with http.post(pd.url + "/v1/chat/completions", headers={"X-Request-Id": "abc"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}) as r:
        assert r.status == 200
        data = orjson.loads(await r.read())
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-abc-")
    assert data["usage"]["completion_tokens"] == 5
