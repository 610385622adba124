"""The data plane's API beyond generation, against real processes: model cards, version and
probes, /tokenize and /detokenize, the pass-through routes (embeddings, rerank, responses),
one error vocabulary, X-Request-Id on every answer, and refused keys logged and counted.

One cluster: an aggregated simulator serving ``sim-model`` (max_model_len 4096), a
prefill/decode pair serving ``pd-model``, a control plane, and a data plane with a
tokenizer and client API keys.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from dataplane.errors import ERROR_TYPES
from dataplane.tokenizer import Tokenizer
from omni_proxy import __version__
from omni_proxy.launcher import ProcessGroup
from tests.conftest import Cluster, start_cluster, wait_until
from tests.data.tokenizer.fixture_dirs import build
from tests.ports import refused_port

MODEL, PD_MODEL, MAX_LEN = "sim-model", "pd-model", 4096
KEY = "s3cret-alice-key"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build("tiny_llama", tmp_path_factory.mktemp("tok") / "tiny_llama")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"alice:{KEY}\n")
    return path


@pytest.fixture(scope="module")
def cluster(tok_dir, keys_file):
    c = start_cluster({"agg": "both", "p": "prefill", "d": "decode"},
                      sim_args={"agg": ["--max-model-len", str(MAX_LEN)], "p": ["--model", PD_MODEL],
                                "d": ["--model", PD_MODEL]},
                      dp_args=["--tokenizer", str(tok_dir), "--api-keys", str(keys_file)])
    try:
        yield c
    finally:
        c.group.close()


@pytest.fixture
async def api(cluster: Cluster):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=aiohttp.ClientTimeout(total=60)) as s:
        await cluster.fresh()
        await wait_until(lambda: _models_known(s, cluster), what="both models listed with max_model_len")
        yield s
    await cluster.restore()


async def _models_known(s, cluster) -> bool:
    async with s.get(cluster.url + "/v1/models") as r:
        data = (await r.json()).get("data", []) if r.status == 200 else []
    cards = {m["id"]: m for m in data}
    return PD_MODEL in cards and cards.get(MODEL, {}).get("max_model_len") == MAX_LEN


def _assert_error(status: int, body: bytes, expected_status: int, expected_type: str) -> dict:
    assert status == expected_status, body[:300]
    err = orjson.loads(body)["error"]
    assert err["type"] == expected_type and err["code"] == expected_status and err["message"], err
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] in ERROR_TYPES
    return err


async def test_model_cards_keep_max_model_len_and_unknown_model_is_404(cluster, api):
    async with api.get(cluster.url + "/v1/models") as r:
        cards = {m["id"]: m for m in (await r.json())["data"]}
    assert cards[MODEL]["max_model_len"] == MAX_LEN and cards[MODEL]["object"] == "model"
    async with api.get(cluster.url + f"/v1/models/{MODEL}") as r:
        assert r.status == 200 and r.headers["X-Request-Id"]
        card = await r.json()
    assert card == cards[MODEL]
    async with api.get(cluster.url + "/v1/models/org/not-served") as r:   # ids may hold slashes
        err = _assert_error(r.status, await r.read(), 404, "not_found_error")
        assert r.headers["X-Request-Id"] and err["param"] == "model" and "org/not-served" in err["message"]


async def test_version_liveness_and_readiness(cluster, api, tmp_path):
    for path in ("/version", "/liveness", "/livez", "/readiness", "/readyz"):
        async with aiohttp.ClientSession() as anonymous, anonymous.get(cluster.url + path) as r:   # no key
            assert r.status == 200, (path, await r.text())
            if path == "/version":
                assert (await r.json()) == {"version": __version__}
    # A data plane whose control plane is not there: alive, not ready.
    with refused_port() as nobody, ProcessGroup(str(tmp_path)) as group:
        lonely = group.start("dp-lonely", ["dataplane", "--port", "0", "--controlplane", f"127.0.0.1:{nobody}",
                                           "--placement-timeout", "0.2"])
        async with aiohttp.ClientSession() as s:
            for path in ("/liveness", "/livez"):
                async with s.get(lonely.url + path) as r:
                    assert r.status == 200
            for path in ("/readiness", "/readyz"):
                async with s.get(lonely.url + path) as r:
                    err = _assert_error(r.status, await r.read(), 503, "server_error")
                    assert "control-plane" in err["message"]


async def test_tokenize_and_detokenize_use_the_data_planes_tokenizer(cluster, api, tok_dir, tmp_path):
    tok = Tokenizer.from_dir(tok_dir)
    text = "Hello world, tokenize me"
    async with api.post(cluster.url + "/tokenize", json={"model": MODEL, "prompt": text}) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    ids = tok.encode_prompt(text)
    assert out == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids, "token_strs": None}
    messages = [{"role": "user", "content": text}]
    async with api.post(cluster.url + "/tokenize", json={"model": MODEL, "messages": messages}) as r:
        assert r.status == 200, await r.text()
        chat = await r.json()
    assert chat["tokens"] == tok.encode_chat_request({"messages": messages}) and chat["count"] == len(chat["tokens"])
    async with api.post(cluster.url + "/detokenize", json={"model": MODEL, "tokens": ids}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json()) == {"prompt": tok.decode(ids)}
    async with api.post(cluster.url + "/tokenize", json={"model": "nope", "prompt": text}) as r:
        _assert_error(r.status, await r.read(), 404, "not_found_error")
    async with api.post(cluster.url + "/detokenize", json={"model": MODEL, "tokens": ["x"]}) as r:
        _assert_error(r.status, await r.read(), 400, "invalid_request_error")
    # Without --tokenizer: a clear error naming the flag.
    with ProcessGroup(str(tmp_path)) as group:
        plain = group.start("dp-plain", ["dataplane", "--port", "0", "--controlplane", cluster.cp.address])
        async with aiohttp.ClientSession() as s:
            for path, body in (("/tokenize", {"prompt": text}), ("/detokenize", {"tokens": ids})):
                async with s.post(plain.url + path, json=body) as r:
                    err = _assert_error(r.status, await r.read(), 400, "invalid_request_error")
                    assert "--tokenizer" in err["message"] and r.headers["X-Request-Id"]


PASSTHROUGH = [("/v1/embeddings", {"input": ["a cat", "a dog"]}),
               ("/v1/rerank", {"query": "cat", "documents": ["a cat", "a car"]}),
               ("/rerank", {"query": "cat", "documents": ["a cat"]}),
               ("/v2/rerank", {"query": "cat", "documents": ["a cat"], "top_n": 1}),
               ("/v1/responses", {"input": "hello", "max_output_tokens": 4})]


@pytest.mark.parametrize("path,fields", PASSTHROUGH, ids=[p for p, _ in PASSTHROUGH])
async def test_passthrough_routes_reach_a_worker_of_the_model_unchanged(cluster, api, path, fields):
    body = {"model": MODEL, **fields, "extra_engine_field": {"kept": [1, 2]}}
    async with api.post(cluster.url + path, json=body, headers={"X-Request-Id": "cli-7"}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Request-Id"] == "cli-7"
        answer = await r.json()
    seen = [q for q in await cluster.sim_requests("agg") if q["path"] == path]
    assert len(seen) == 1 and seen[0]["body"] == body, seen
    assert not await cluster.sim_requests("p") and not await cluster.sim_requests("d")
    if path == "/v1/embeddings":
        assert [d["index"] for d in answer["data"]] == [0, 1]
    await wait_until(cluster.all_idle, what="the placement released")
    # A model served only by prefill/decode pairs: a clear 400, nothing sent to its engines.
    async with api.post(cluster.url + path, json={**body, "model": PD_MODEL}) as r:
        err = _assert_error(r.status, await r.read(), 400, "invalid_request_error")
        assert "prefill/decode" in err["message"] and path in err["message"] and r.headers["X-Request-Id"]
    assert not await cluster.sim_requests("p") and not await cluster.sim_requests("d")
    await wait_until(cluster.all_idle, what="the refused placement released")
    async with api.post(cluster.url + path, json={**body, "model": "nope"}) as r:
        _assert_error(r.status, await r.read(), 404, "not_found_error")


async def test_every_error_uses_openai_types_and_carries_a_request_id(cluster, api):
    cases = [(api.get(cluster.url + "/v1/nope"), 404, "not_found_error"),
             (api.get(cluster.url + "/v1/completions"), 405, "invalid_request_error"),
             (api.post(cluster.url + "/v1/completions", data=b"{not json"), 400, "invalid_request_error"),
             (api.post(cluster.url + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404,
              "not_found_error")]
    async with aiohttp.ClientSession() as anonymous:
        cases.append((anonymous.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}), 401,
                      "authentication_error"))
        for call, status, kind in cases:
            async with call as r:
                _assert_error(r.status, await r.read(), status, kind)
                assert r.headers.get("X-Request-Id"), (status, dict(r.headers))
        async with anonymous.get(cluster.url + "/v1/nope", headers={"X-Request-Id": "mine-1"}) as r:
            assert r.status == 401 and r.headers["X-Request-Id"] == "mine-1"   # the client's label, echoed
        async with api.get(cluster.url + "/v1/nope", headers={"X-Request-Id": "mine-2"}) as r:
            assert r.status == 404 and r.headers["X-Request-Id"] == "mine-2"
    # Malformed HTTP, answered by the server itself before any route.
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.dp.port)
    writer.write(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    head = (await asyncio.wait_for(reader.read(4096), 10)).split(b"\r\n\r\n")[0].lower()
    writer.close()
    assert head.startswith(b"http/1.1 400") and b"\r\nx-request-id: " in head, head


async def test_refused_keys_are_logged_counted_and_the_access_log_names_the_key_not_the_secret(cluster, api):
    async def failures() -> dict[str, float]:
        async with api.get(cluster.url + "/metrics") as r:
            text = await r.text()
        return {reason: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                for reason in ("missing", "invalid")
                if line.startswith(f'omni_dp_auth_failures_total{{reason="{reason}"}}')}

    before = await failures()
    assert set(before) == {"missing", "invalid"}
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
            assert r.status == 401
        async with anonymous.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                                  headers={"Authorization": "Bearer wrong-key-123"}) as r:
            assert r.status == 401
    after = await failures()
    assert after == {"missing": before["missing"] + 1, "invalid": before["invalid"] + 1}
    async with api.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                        headers={"X-Request-Id": "keyed-1"}) as r:
        assert r.status == 200

    def log_lines() -> list[str]:
        return cluster.dp.log_path.read_text(errors="replace").splitlines()

    async def logged() -> bool:
        lines = log_lines()
        return (any("keyed-1" in line and "omni_proxy.access" in line for line in lines)
                and sum("401 POST /v1/completions" in line for line in lines) >= 2)

    await wait_until(logged, what="the access line and the 401 lines")
    lines = log_lines()
    access = orjson.loads(next(line for line in lines if "keyed-1" in line and "omni_proxy.access" in line)
                          .split("omni_proxy.access: ", 1)[1])
    assert access["client_key"] == "alice"
    refused = [line for line in lines if "401 POST /v1/completions" in line]
    assert any("missing API key" in line for line in refused)
    assert any("invalid API key (client key-" in line for line in refused)
    text = "\n".join(lines)
    assert KEY not in text and "wrong-key-123" not in text
