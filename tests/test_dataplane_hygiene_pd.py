"""Client-set PD fields and client ids through the PD flows, on real processes (issue 11,
defects 2, 4 and 8): each flow sets its own KV-transfer fields, whatever the client sent,
and two requests with the same client id never share an engine id.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from engine_api.bodies import PULL_PREFILL_KV_PARAMS
from tests.conftest import Cluster, start_cluster, wait_until
from tests.test_dataplane_hygiene import parse_response, post_bytes, raw_exchange

MODEL = "sim-model"


PD = {"prefill-0": "prefill", "decode-0": "decode"}
STEER = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1,
                                "metaserver": "http://10.9.9.9/", "bootstrap_server_host": "10.9.9.9"},
         "bootstrap_host": "10.9.9.9", "bootstrap_port": 1, "bootstrap_room": 42}


def _pd(*cp_args: str):
    c = start_cluster(PD, cp_args=list(cp_args))
    return c


@pytest.fixture(scope="module")
def sequential():
    c = _pd()
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def sglang():
    c = _pd("--pd-flow", "parallel", "--parallel-protocol", "sglang")
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def mooncake():
    c = _pd("--pd-flow", "parallel", "--parallel-protocol", "mooncake")
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def layerwise():
    c = _pd("--pd-flow", "layerwise", "--metaserver-host", "127.0.0.1")
    yield c
    c.group.close()


async def _steered(c: Cluster, http, **extra) -> tuple[dict, dict]:
    await c.fresh()
    body = {"model": MODEL, "prompt": "steer the kv " * 8, "max_tokens": 3, **STEER, **extra}
    async with http.post(c.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
    (p,) = await c.sim_requests("prefill-0")
    (d,) = await c.sim_requests("decode-0")
    await wait_until(c.all_idle, what="load released")
    for leg in (p, d):
        assert not any(k.startswith("bootstrap_") and leg["body"][k] in ("10.9.9.9", 1, 42) for k in leg["body"])
        assert "10.9.9.9" not in orjson.dumps(leg["body"]).decode()
    return p["body"], d["body"]


async def test_sequential_sets_its_own_pd_fields_only(sequential: Cluster, http):
    p, d = await _steered(sequential, http)
    assert p["kv_transfer_params"] == PULL_PREFILL_KV_PARAMS
    assert d["kv_transfer_params"]["remote_engine_id"] == (
        await sequential.sim_get("prefill-0", "/sim/state"))["engine_id"]
    assert not any(k.startswith("bootstrap_") for k in (*p, *d))


async def test_sglang_parallel_sets_its_own_room(sglang: Cluster, http):
    p, d = await _steered(sglang, http)
    assert p["bootstrap_room"] == d["bootstrap_room"] != 42
    assert p["bootstrap_host"] == "127.0.0.1" and "kv_transfer_params" not in p and "kv_transfer_params" not in d


async def test_mooncake_parallel_sets_its_own_kv_params(mooncake: Cluster, http):
    p, d = await _steered(mooncake, http)
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert d["kv_transfer_params"]["bootstrap_server_host"] == "127.0.0.1"
    assert not any(k.startswith("bootstrap_") for k in (*p, *d))


async def test_layerwise_sets_its_own_metaserver(layerwise: Cluster, http):
    p, d = await _steered(layerwise, http)
    kv = dict(d["kv_transfer_params"])
    assert kv.pop("metaserver").startswith(f"http://127.0.0.1:{layerwise.cp.info['http_port']}/v1/metaserver?token=")
    assert kv == {"do_remote_decode": False, "do_remote_prefill": True}
    assert not any(k.startswith("bootstrap_") for k in (*p, *d))


async def test_layerwise_same_client_id_at_once_each_decoded_from_its_own_prefill(layerwise: Cluster, http):
    await layerwise.fresh()
    # P slow enough that both requests wait at the metaserver at the same time.
    await layerwise.sim_post("prefill-0", "/sim/faults", {"delay_s": 0.5, "count": 2})
    prompts = ["first twin " * 5, "second twin, a longer prompt " * 9]

    async def one(prompt: str) -> bytes:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
        async with http.post(layerwise.url + "/v1/completions", json=body, headers={"X-Request-Id": "twin"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Request-Id"] == "twin"
            return await r.read()

    answers = await asyncio.gather(*(one(p) for p in prompts))
    assert all(a.endswith(b"data: [DONE]\n\n") and b'"error"' not in a for a in answers)
    ps = await layerwise.sim_requests("prefill-0")
    ds = await layerwise.sim_requests("decode-0")
    assert len(ps) == len(ds) == 2
    decodes = {d["request_id"]: d for d in ds}
    assert len(decodes) == 2 and all(rid.startswith("twin-") for rid in decodes)
    for p in ps:
        d = decodes[p["request_id"]]                     # P ran for exactly this D's request...
        assert p["body"]["prompt"] == d["body"]["prompt"]  # ...with that request's prompt
        assert p["body"]["kv_transfer_params"]["request_id"] == f"cmpl-{d['request_id']}-0"
    state = await layerwise.sim_get("decode-0", "/sim/state")
    assert state["metaserver_calls_failed"] == 0
    await wait_until(layerwise.all_idle, what="load released")


@pytest.mark.parametrize("flow", ["sequential", "sglang", "mooncake", "layerwise"])
async def test_undecodable_client_id_works_in_pd_flows(flow, request):
    c: Cluster = request.getfixturevalue(flow)
    await c.fresh()
    body = orjson.dumps({"model": MODEL, "prompt": "odd id in pd", "max_tokens": 2})
    raw, _ = await raw_exchange(c.url, post_bytes("/v1/completions", body, b"X-Request-Id: \xc3\x28\xff\r\n"))
    status, headers, _ = parse_response(raw)
    assert status == 200, raw[:500]
    ids = {r["request_id"] for name in c.sims for r in await c.sim_requests(name)}
    assert len(ids) == 1 and next(iter(ids)).isascii()
    await wait_until(c.all_idle, what="load released")


async def test_prefill_429_reaches_the_client_with_retry_after(sequential: Cluster, http):
    await sequential.fresh()
    await sequential.sim_post("prefill-0", "/sim/faults", {"status": 429, "retry_after": "11", "count": 2})
    async with http.post(sequential.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 429 and r.headers.get("Retry-After") == "11"
    assert await sequential.sim_requests("decode-0") == []
    await wait_until(sequential.all_idle, what="load released")
