"""Input hygiene through real processes (issue 11, defects 2, 4, 6, 7, 8 and part of 12).

Client ids are labels, never keys; client-set PD fields never reach an engine; slow,
malformed, oversized and compressed input gets a clean 4xx; an engine's 429/503 reaches
the client as such, with its Retry-After.
"""

from __future__ import annotations

import asyncio
import gzip
import time
from urllib.parse import urlsplit

import orjson
import pytest

from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"agg": "both"}, dp_args=[
        "--max-body-bytes", "65536", "--client-header-timeout", str(HEADER_TIMEOUT_S),
        "--client-body-timeout", str(BODY_TIMEOUT_S), "--max-header-bytes", "2048"])
    yield c
    c.group.close()


@pytest.fixture
async def agg(cluster: Cluster):
    await cluster.fresh()
    yield cluster
    await cluster.sim_post("agg", "/sim/faults", {"clear": True})
    await wait_until(cluster.all_idle, what="idle after the test (load leaked)")


# ---------------------------------------------------------------- raw HTTP helpers

async def raw_exchange(url: str, data: bytes, *, timeout: float = 15.0) -> tuple[bytes, float]:
    """Send ``data`` and read until the server closes; (everything read, seconds it took)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    started = time.monotonic()
    try:
        writer.write(data)
        await writer.drain()
        received = await asyncio.wait_for(reader.read(), timeout)   # returns at the server's close
        return received, time.monotonic() - started
    finally:
        writer.close()


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.decode().strip().lower()] = v.decode("latin-1").strip()
    return status, headers, body


def post_bytes(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


# ---------------------------------------------------------------- defect 2 / 8: request ids

async def test_same_client_id_at_once_gives_distinct_engine_ids_and_echoes_the_clients(agg: Cluster, http):
    async def one(i: int) -> str:
        body = {"model": MODEL, "prompt": f"twin {i}", "max_tokens": 3}
        async with http.post(agg.url + "/v1/completions", json=body, headers={"X-Request-Id": "twin"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Request-Id"] == "twin"
            return (await r.json())["id"]

    ids = await asyncio.gather(one(0), one(1))
    seen = [s["request_id"] for s in await agg.sim_requests("agg")]
    assert len(set(seen)) == 2 and all(s.startswith("twin-") for s in seen)
    assert sorted(ids) == sorted(f"cmpl-{s}" for s in seen)


@pytest.mark.parametrize("given,label", [(b"\xff\xfe not utf-8", b"_not_utf-8"), (b"x" * 1500, b"x" * 64),
                                         (b"a b\tc", b"a_b_c")])
async def test_odd_client_ids_are_sanitized_never_a_500(agg: Cluster, given, label):
    body = orjson.dumps({"model": MODEL, "prompt": "odd id", "max_tokens": 2})
    raw, _ = await raw_exchange(agg.url, post_bytes("/v1/completions", body, b"X-Request-Id: " + given + b"\r\n"))
    status, headers, _ = parse_response(raw)
    assert status == 200, raw[:500]
    assert headers["x-request-id"].encode() == label
    (seen,) = await agg.sim_requests("agg")
    assert seen["request_id"].startswith(label.decode() + "-")


# ---------------------------------------------------------------- defect 4: PD fields

async def test_client_pd_fields_never_reach_an_aggregated_engine(agg: Cluster, http):
    body = {"model": MODEL, "prompt": "steer me", "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1},
            "bootstrap_host": "10.9.9.9", "bootstrap_port": 1, "bootstrap_room": 42}
    async with http.post(agg.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
    (seen,) = await agg.sim_requests("agg")
    assert seen["body"] == {"model": MODEL, "prompt": "steer me", "max_tokens": 2}


async def test_allowed_client_fields_pass(cluster: Cluster, http):
    dp = cluster.group.start("dataplane-allow", ["dataplane", "--port", "0", "--controlplane", cluster.cp.address,
                                                 "--allow-client-fields", "kv_transfer_params,bootstrap_room"])
    try:
        await cluster.fresh()
        ktp = {"do_remote_decode": False, "do_remote_prefill": False}
        body = {"model": MODEL, "prompt": "allowed", "max_tokens": 2, "kv_transfer_params": ktp,
                "bootstrap_room": 7, "bootstrap_host": "10.9.9.9"}
        async with http.post(dp.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        (seen,) = await cluster.sim_requests("agg")
        assert seen["body"]["kv_transfer_params"] == ktp and seen["body"]["bootstrap_room"] == 7
        assert "bootstrap_host" not in seen["body"]
    finally:
        dp.proc.terminate()
        dp.proc.wait(10)


# ---------------------------------------------------------------- defect 6: slow clients

async def test_a_head_that_never_finishes_is_cut_off(agg: Cluster):
    raw, took = await raw_exchange(agg.url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
    assert HEADER_TIMEOUT_S * 0.8 <= took < HEADER_TIMEOUT_S + 5
    status, headers, body = parse_response(raw)
    assert status == 408 and "error" in orjson.loads(body)


async def test_a_connection_that_sends_nothing_is_closed_silently(agg: Cluster):
    raw, took = await raw_exchange(agg.url, b"")
    assert HEADER_TIMEOUT_S * 0.8 <= took < HEADER_TIMEOUT_S + 5 and raw == b""


async def test_a_trickled_head_is_cut_off_at_its_deadline(agg: Cluster):
    parts = urlsplit(agg.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    started = time.monotonic()
    try:
        async def trickle() -> None:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" * 10:
                writer.write(bytes([byte]))
                await asyncio.sleep(0.05)

        sender = asyncio.create_task(trickle())
        try:
            received = await asyncio.wait_for(reader.read(), 15)    # returns at the server's close
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    finally:
        writer.close()
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
    assert parse_response(received)[0] == 408


async def test_a_body_that_never_finishes_is_408_and_closed(agg: Cluster, http):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\": ")
    raw, took = await raw_exchange(agg.url, head)
    assert BODY_TIMEOUT_S * 0.8 <= took < BODY_TIMEOUT_S + 5
    status, _, body = parse_response(raw)
    assert status == 408 and orjson.loads(body)["error"]["code"] == 408
    async with http.post(agg.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200


async def test_oversized_header_is_431_json_without_the_input(agg: Cluster):
    secret = b"S3CRET" * 600
    raw, _ = await raw_exchange(agg.url, post_bytes("/v1/completions", b"{}", b"X-Big: " + secret + b"\r\n"))
    status, headers, body = parse_response(raw)
    assert status == 431 and headers["content-type"].startswith("application/json")
    assert orjson.loads(body)["error"]["code"] == 431 and b"S3CRET" not in raw


async def test_too_many_headers_is_431_json(agg: Cluster):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    raw, _ = await raw_exchange(agg.url, post_bytes("/v1/completions", b"{}", many))
    status, headers, body = parse_response(raw)
    assert status == 431 and orjson.loads(body)["error"]["code"] == 431


@pytest.mark.parametrize("request_bytes", [
    b"GET /<script>alert(1)</script> HTTP/1.1\x00\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope<script>\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03<script>\r\n\r\n",
])
async def test_malformed_http_is_400_json_without_the_input(agg: Cluster, http, request_bytes):
    raw, _ = await raw_exchange(agg.url, request_bytes)
    status, headers, body = parse_response(raw)
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert orjson.loads(body)["error"]["code"] == 400 and b"<script>" not in raw
    async with http.get(agg.url + "/health") as r:
        assert r.status == 200


# ---------------------------------------------------------------- defect 7: compression

async def test_gzip_body_is_accepted(agg: Cluster, http):
    body = gzip.compress(orjson.dumps({"model": MODEL, "prompt": "zipped", "max_tokens": 2}))
    async with http.post(agg.url + "/v1/completions", data=body,
                         headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()
    (seen,) = await agg.sim_requests("agg")
    assert seen["body"]["prompt"] == "zipped"


@pytest.mark.parametrize("data,encoding,status", [
    (b"definitely not gzip", "gzip", 400),
    (gzip.compress(b"{" + b" " * (4 << 20) + b"}"), "gzip", 413),     # 4 KB on the wire, 4 MiB inflated
    (b"{}", "br", 415),
])
async def test_bad_compressed_bodies_get_clean_4xx(agg: Cluster, http, data, encoding, status):
    async with http.post(agg.url + "/v1/completions", data=data,
                         headers={"Content-Encoding": encoding, "Content-Type": "application/json"}) as r:
        assert r.status == status
        assert (await r.json())["error"]["code"] == status
    async with http.post(agg.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200


async def test_engine_answers_are_never_relayed_mislabelled(agg: Cluster, http):
    # The engine compresses whenever the request allows it; the data plane asks for identity.
    await agg.sim_post("agg", "/sim/faults", {"compress": True, "count": -1})
    async with http.post(agg.url + "/v1/completions", json={"model": MODEL, "prompt": "plain", "max_tokens": 3},
                         headers={"Accept-Encoding": "gzip"}) as r:
        assert r.status == 200
        assert r.headers.get("Content-Encoding", "identity") in ("identity", "gzip")
        data = await r.json()     # aiohttp decodes gzip only when it is labelled as such
    assert data["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- defect 8: bad values

@pytest.mark.parametrize("body", [
    b'{"model": "sim-model", "prompt": "x", "max_tokens": 9223372036854775808}',
    b'{"model": "sim-model", "prompt": "x", "max_tokens": 18446744073709551615}',
    b'{"model": "sim-model", "prompt": "x", "max_completion_tokens": 99999999999999}',
    b'{"model": "sim-model", "prompt": "x", "n": 9223372036854775807}',
])
async def test_counts_out_of_range_are_400(agg: Cluster, http, body):
    async with http.post(agg.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] in ("max_tokens", "max_completion_tokens", "n")


@pytest.mark.parametrize("model", [None, "", "missing"])
async def test_no_model_runs_where_only_one_model_is_served(agg: Cluster, http, model):
    body = {"prompt": "which model?", "max_tokens": 2}
    if model != "missing":
        body["model"] = model
    async with http.post(agg.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def test_no_model_is_400_where_several_are_served(http):
    c = start_cluster({"m1": "both", "m2": "both"}, sim_args={"m1": ["--model", "one"], "m2": ["--model", "two"]})
    try:
        await wait_until(lambda: _models_known(c), what="both models discovered")
        for model in (None, ""):
            async with http.post(c.url + "/v1/completions", json={"model": model, "prompt": "x"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "model"
        assert await c.sim_requests("m1") == [] and await c.sim_requests("m2") == []
        async with http.post(c.url + "/v1/completions", json={"model": "two", "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 200
        assert len(await c.sim_requests("m2")) == 1
    finally:
        c.group.close()


async def _models_known(c: Cluster) -> bool:
    return {w.model for w in (await c.workers()).values()} == {"one", "two"}


# ---------------------------------------------------------------- defect 12: 429 / 503

@pytest.mark.parametrize("status,retry_after", [(429, "1"), (503, "1"), (429, None)])
async def test_engine_busy_statuses_pass_through_with_retry_after(agg: Cluster, http, status, retry_after):
    fault = {"status": status, "message": "busy, come back", "count": 1}
    if retry_after:
        fault["retry_after"] = retry_after
    await agg.sim_post("agg", "/sim/faults", fault)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with http.post(agg.url + "/v1/completions", json=body) as r:
        assert r.status == status
        assert r.headers.get("Retry-After") == retry_after
        err = (await r.json())["error"]
    assert err["upstream_status"] == status and "busy, come back" in err["message"]
    if retry_after:
        # The engine's Retry-After keeps it out of rotation: the control plane answers for
        # it now (503, with when to come back), and takes it back after that.
        async with http.post(agg.url + "/v1/completions", json=body) as r:
            assert r.status == 503 and 0 < int(r.headers["Retry-After"]) <= 1
        await wait_until(lambda: _back(agg), what="the engine back in rotation")


async def _back(c: Cluster) -> bool:
    return (await c.workers())["agg"].circuit != "open"
