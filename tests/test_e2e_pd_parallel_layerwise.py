"""Parallel (bootstrap) and layerwise (metaserver) PD flows through real processes."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest

from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"
PD = {"prefill-0": "prefill", "decode-0": "decode"}


def _cluster(*cp_args, sim_args=None):
    c = start_cluster(PD, cp_args=list(cp_args), sim_args=sim_args)
    return c


@pytest.fixture(scope="module")
def sglang():
    c = _cluster("--pd-flow", "parallel", "--parallel-protocol", "sglang")
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def mooncake():
    c = _cluster("--pd-flow", "parallel", "--parallel-protocol", "mooncake")
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def layerwise():
    c = _cluster("--pd-flow", "layerwise", "--metaserver-host", "127.0.0.1")
    yield c
    c.group.close()


async def test_sglang_parallel_sends_the_same_body_with_one_room_to_both(sglang: Cluster, http):
    await sglang.fresh()
    before = await sglang.sim_get("decode-0", "/sim/state")
    body = {"model": MODEL, "prompt": "parallel please " * 10, "max_tokens": 6, "stream": True}
    async with http.post(sglang.url + "/v1/completions", json=body, headers={"X-Request-Id": "par-1"}) as r:
        assert r.status == 200
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    (p,) = await sglang.sim_requests("prefill-0")
    (d,) = await sglang.sim_requests("decode-0")
    assert p["body"] == d["body"]
    room = d["body"]["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    assert d["body"]["bootstrap_host"] == "127.0.0.1"
    assert d["body"]["bootstrap_port"] == sglang.sims["prefill-0"].info["bootstrap_port"]
    assert p["request_id"] == d["request_id"] and p["request_id"].startswith("par-1-")
    after = await sglang.sim_get("decode-0", "/sim/state")
    assert after["prompt_tokens_external"] > before["prompt_tokens_external"]
    assert after["prompt_tokens_local"] == before["prompt_tokens_local"]
    await wait_until(sglang.all_idle, what="P drained and released")


async def test_parallel_prefill_failure_cancels_decode(sglang: Cluster, http):
    await sglang.fresh()
    # P fails slowly, so that D surely has the request and waits for P's KV when P fails (an
    # instant failure can cancel D's leg before it is sent: then there is nothing to check).
    await sglang.sim_post("prefill-0", "/sim/faults",
                          {"status": 500, "message": "prefill broke", "delay_s": 1.0, "count": 1})
    before = await sglang.sim_get("decode-0", "/sim/state")
    request = asyncio.create_task(http.post(sglang.url + "/v1/completions",
                                            json={"model": MODEL, "prompt": "x", "max_tokens": 4}))
    try:
        async def decode_waits_for_kv() -> bool:
            return (await sglang.sim_get("decode-0", "/sim/state"))["waiting_for_remote_kv"] == 1

        await wait_until(decode_waits_for_kv, what="D to wait for P's KV")
        async with await request as r:
            assert r.status == 502
            assert "prefill broke" in (await r.json())["error"]["message"]
    finally:
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)

    # Well before D's own bootstrap timeout (30 s): D's wait was abandoned, it did not time out.
    await wait_until(lambda: sglang.engine_idle("decode-0"), timeout=10, what="decode abandoned its wait for KV")
    after = await sglang.sim_get("decode-0", "/sim/state")
    assert after["bootstrap_fetches_failed"] == before["bootstrap_fetches_failed"]
    await wait_until(sglang.all_idle, what="load released")


async def test_mooncake_bootstrap_variant(mooncake: Cluster, http):
    await mooncake.fresh()
    client = openai.AsyncOpenAI(base_url=mooncake.url + "/v1", api_key="unused")
    resp = await client.completions.create(model=MODEL, prompt="mooncake " * 12, max_tokens=5,
                                           extra_headers={"X-Request-Id": "mc-1"})
    assert resp.usage.completion_tokens == 5
    await client.close()
    (p,) = await mooncake.sim_requests("prefill-0")
    (d,) = await mooncake.sim_requests("decode-0")
    assert p["body"]["max_tokens"] == 1 and p["body"]["kv_transfer_params"]["do_remote_decode"] is True
    ktp = d["body"]["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["bootstrap_server_host"] == "127.0.0.1"
    assert ktp["bootstrap_server_port"] == mooncake.sims["prefill-0"].info["bootstrap_port"]
    assert p["request_id"] == d["request_id"] and p["request_id"].startswith("mc-1-")


async def test_layerwise_decode_first_then_metaserver_drives_prefill(layerwise: Cluster, http):
    await layerwise.fresh()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "push it layer by layer"}],
            "max_tokens": 5, "stream": True}
    async with http.post(layerwise.url + "/v1/chat/completions", json=body,
                         headers={"X-Request-Id": "lw-1"}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    (d,) = await layerwise.sim_requests("decode-0")
    (p,) = await layerwise.sim_requests("prefill-0")
    dk = d["body"]["kv_transfer_params"]
    assert {k: v for k, v in dk.items() if k != "metaserver"} == {"do_remote_decode": False, "do_remote_prefill": True}
    base, _, token = dk["metaserver"].partition("?token=")
    assert base == f"http://127.0.0.1:{layerwise.cp.info['http_port']}/v1/metaserver" and len(token) >= 20
    # P got the original request, capped, with D's KV destination from the metaserver call.
    assert p["body"]["messages"] == body["messages"] and p["body"]["max_tokens"] == 1
    assert p["body"]["stream"] is False
    pk = p["body"]["kv_transfer_params"]
    d_state = await layerwise.sim_get("decode-0", "/sim/state")
    assert pk["do_remote_decode"] is True and pk["remote_engine_id"] == d_state["engine_id"]
    assert p["request_id"].startswith("lw-1-") and pk["request_id"] == f"chatcmpl-{p['request_id']}"
    assert d_state["metaserver_calls_ok"] >= 1 and d_state["kv_pushes_received"] >= 1
    await wait_until(layerwise.all_idle, what="load released")


async def _placements_decided(c: Cluster, http) -> int:
    """omni_placement_seconds_count: placements decided through the scheduler service."""
    async with http.get(f"http://127.0.0.1:{c.cp.info['http_port']}/metrics") as m:
        text = await m.text()
    (line,) = [x for x in text.splitlines() if x.startswith("omni_placement_seconds_count")]
    return int(float(line.split()[-1]))


async def test_layerwise_prefill_is_placed_the_way_every_request_is(layerwise: Cluster, http):
    """The metaserver places P through the scheduler service, as a data plane would: the
    placement statistics count both of the request's placements (its entry leg and its
    prefill leg), not the entry alone (the metaserver used to call the placer itself)."""
    await layerwise.fresh()
    before = await _placements_decided(layerwise, http)
    async with http.post(layerwise.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "count me twice", "max_tokens": 3}) as r:
        assert r.status == 200, await r.text()
    assert len(await layerwise.sim_requests("prefill-0")) == 1
    assert await _placements_decided(layerwise, http) - before == 2
    await wait_until(layerwise.all_idle, what="load released")


async def test_layerwise_prefill_failure_fails_fast(layerwise: Cluster, http):
    await layerwise.fresh()
    await layerwise.sim_post("prefill-0", "/sim/faults", {"status": 500, "message": "no prefill today", "count": 2})
    async with http.post(layerwise.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "x", "max_tokens": 3}) as r:
        assert r.status == 502
    d_state = await layerwise.sim_get("decode-0", "/sim/state")
    assert d_state["metaserver_calls_failed"] >= 1
    await wait_until(layerwise.all_idle, what="load released")


async def test_metaserver_answers_only_the_placed_decode_engine(layerwise: Cluster, http):
    """A third party that knows a pending id cannot choose where prefill pushes the KV."""
    await layerwise.fresh()
    # Hold D back so the request stays pending while a third party calls the metaserver.
    await layerwise.sim_post("decode-0", "/sim/faults", {"delay_s": 1.5, "count": 1})
    body = {"model": MODEL, "prompt": "mine", "max_tokens": 3}
    task = asyncio.create_task(http.post(layerwise.url + "/v1/completions", json=body,
                                         headers={"X-Request-Id": "victim"}))
    url = f"http://127.0.0.1:{layerwise.cp.info['http_port']}/v1/metaserver"
    forged = {"request_id": "", "remote_engine_id": "evil", "remote_host": "10.9.9.9", "remote_port": 1}

    await wait_until(lambda: _has_pending(layerwise, http), what="the request to wait for its decode call")
    engine_id = (await _decode_request_id(layerwise))
    for query in ("", "?token=guess"):
        forged["request_id"] = f"cmpl-{engine_id}-0"
        async with http.post(url + query, json=forged) as r:
            assert r.status == 403, await r.text()
    r = await task
    assert r.status == 200
    r.release()
    (p,) = await layerwise.sim_requests("prefill-0")
    assert p["body"]["kv_transfer_params"]["remote_engine_id"] != "evil"
    async with http.get(f"http://127.0.0.1:{layerwise.cp.info['http_port']}/metrics") as m:
        assert 'omni_metaserver_calls_total{outcome="forbidden"} 2.0' in await m.text()
    await wait_until(layerwise.all_idle, what="load released")


async def _has_pending(c: Cluster, http) -> bool:
    return bool(await c.sim_requests("decode-0"))


async def _decode_request_id(c: Cluster) -> str:
    (d,) = await c.sim_requests("decode-0")
    return d["request_id"]


async def test_metaserver_rejects_unknown_ids_and_bad_bodies(layerwise: Cluster, http):
    url = f"http://127.0.0.1:{layerwise.cp.info['http_port']}/v1/metaserver"
    async with http.post(url, json={"request_id": "cmpl-nobody-0"}) as r:
        assert r.status == 404
    async with http.post(url, data=b"{nope") as r:
        assert r.status == 400
    async with http.post(url, data=orjson.dumps({"request_id": 5})) as r:
        assert r.status == 400
