"""Engine simulator: vLLM wire formats, PD roles, faults, disconnects and the cost model.

Most tests talk to real ``omni-proxy sim`` processes (started once per module); the
scheduler tests drive ``Engine`` step by step in-process, with no real time involved.
"""

from __future__ import annotations

import asyncio
import math
import re
import time

import aiohttp
import openai
import orjson
import pytest

from omni_proxy.launcher import Child, ProcessGroup
from omni_runtime import start_http_site
from simulator.config import SimConfig
from simulator.engine import Engine, SimRequest
from simulator.server import SIM_VERSION, build_app
from simulator.tokens import CHAT_GENERATION_PROMPT_TOKENS, CHAT_TOKENS_PER_MESSAGE, count_text_tokens
from tests.conftest import wait_until

MODEL = "sim-model"
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
PROMPT_TOKENS = count_text_tokens(PROMPT)


# ---- helpers -------------------------------------------------------------------------

async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def post_json(session: aiohttp.ClientSession, url: str, body: dict,
                    headers: dict | None = None) -> tuple[int, dict]:
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body, asserting vLLM's exact framing: ``data: ...\\n\\n`` events."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    for ev in events:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
    return [ev[len(b"data: "):] for ev in events]


def metric_value(text: str, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)\{(.*)\} (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if got == want:
            return float(m.group(3))
    raise AssertionError(f"{name}{want} not in /metrics")


@pytest.fixture(scope="module")
def sims():
    """prefill, decode and aggregated sims as real processes."""
    with ProcessGroup() as group:
        yield {
            "p": group.start("sim-p", ["sim", "--role", "prefill", "--port", "0"]),
            "d": group.start("sim-d", ["sim", "--role", "decode", "--port", "0"]),
            "b": group.start("sim-b", ["sim", "--role", "both", "--port", "0"]),
        }


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture(autouse=True)
async def no_fault_outlives_its_test(request):
    """A test that armed a fault and failed before using it must not hand it to the next."""
    yield
    if "sims" in request.fixturenames:
        async with aiohttp.ClientSession() as session:
            for child in request.getfixturevalue("sims").values():
                async with session.post(child.url + "/sim/faults", json={"clear": True}) as resp:
                    assert resp.status == 200


# ---- OpenAI wire formats -------------------------------------------------------------

async def test_completion_non_streaming(sims, http):
    b: Child = sims["b"]
    status, body = await post_json(http, b.url + "/v1/completions",
                                   {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "temperature": 0},
                                   headers={"X-Request-Id": "req-abc"})
    assert status == 200, body
    assert body["id"] == "cmpl-req-abc"
    assert body["object"] == "text_completion" and body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["logprobs"] is None and choice["prompt_logprobs"] is None
    assert len(choice["text"].split()) == 7
    assert body["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 7,
                             "total_tokens": PROMPT_TOKENS + 7, "prompt_tokens_details": None}
    assert body["kv_transfer_params"] is None

    # Same prompt, same text ("temperature 0"); a one-element batch and token ids work too.
    status, again = await post_json(http, b.url + "/v1/completions", {"prompt": [PROMPT], "max_tokens": 7})
    assert status == 200 and again["choices"][0]["text"] == choice["text"]
    assert again["id"].startswith("cmpl-") and again["id"] != body["id"]
    status, ids = await post_json(http, b.url + "/v1/completions", {"prompt": [[5, 6, 7, 8]], "max_tokens": 3})
    assert status == 200 and ids["usage"]["prompt_tokens"] == 4 and ids["usage"]["completion_tokens"] == 3


async def test_completion_streaming_sse_framing(sims, http):
    b: Child = sims["b"]
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(b.url + "/v1/completions", json=body, headers={"X-Request-Id": "s1"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    tokens, usage_chunk = chunks[:-1], chunks[-1]
    assert len(tokens) == 5
    for i, c in enumerate(tokens):
        assert c["id"] == "cmpl-s1" and c["object"] == "text_completion" and c["model"] == MODEL
        (choice,) = c["choices"]
        assert choice["text"].strip() and choice["logprobs"] is None and choice["stop_reason"] is None
        assert choice["finish_reason"] == ("length" if i == 4 else None)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["prompt_tokens"] == PROMPT_TOKENS

    # Without include_usage there is no usage chunk.
    async with http.post(b.url + "/v1/completions", json={**body, "stream_options": None}) as resp:
        events = sse_events(await resp.read())
    assert len(events) == 6 and all(b'"usage"' not in e for e in events)


async def test_stream_is_flushed_per_token(sims, http):
    """Tokens reach the client while generation is still going, not at the end."""
    b: Child = sims["b"]
    t0 = time.monotonic()
    first = None
    reads = 0
    async with http.post(b.url + "/v1/completions",
                         json={"prompt": PROMPT, "max_tokens": 60, "stream": True}) as resp:
        async for _ in resp.content.iter_any():
            reads += 1
            if first is None:
                first = time.monotonic()
    end = time.monotonic()
    assert first is not None and reads > 5
    assert (first - t0) < 0.5 * (end - t0)


async def test_chat_with_openai_client(sims):
    b: Child = sims["b"]
    client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0)
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
        resp = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                                    extra_headers={"X-Request-Id": "chat-1"})
        assert resp.id == "chatcmpl-chat-1" and resp.object == "chat.completion"
        assert resp.choices[0].message.role == "assistant"
        assert len(resp.choices[0].message.content.split()) == 6
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
        template = 2 * CHAT_TOKENS_PER_MESSAGE + CHAT_GENERATION_PROMPT_TOKENS
        assert resp.usage.prompt_tokens == template + count_text_tokens("Be brief.") + count_text_tokens("Hello there!")

        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
        content = [c for c in chunks[1:] if c.choices]
        assert len(content) == 4 and all(c.choices[0].delta.content for c in content)
        assert [c.choices[0].finish_reason for c in content] == [None, None, None, "length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        # Streamed and non-streamed text agree for the same conversation.
        streamed = "".join(c.choices[0].delta.content for c in content)
        assert streamed.split() == resp.choices[0].message.content.split()[:4]

        comp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert comp.usage.completion_tokens == 3 and comp.choices[0].finish_reason == "length"
    finally:
        await client.close()


async def test_chat_stream_raw_framing(sims, http):
    b: Child = sims["b"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with http.post(b.url + "/v1/chat/completions", json=body) as resp:
        events = sse_events(await resp.read())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [list(c["choices"][0]["delta"]) for c in chunks[1:]] == [["content"]] * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")


async def test_info_routes(sims, http):
    b: Child = sims["b"]
    async with http.get(b.url + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    models = await get_json(http, b.url + "/v1/models")
    assert models["object"] == "list"
    (m,) = models["data"]
    assert m["id"] == MODEL and m["object"] == "model" and m["owned_by"] == "vllm"
    assert m["root"] == MODEL and m["parent"] is None and m["max_model_len"] == 32768
    assert await get_json(http, b.url + "/version") == {"version": SIM_VERSION}

    # /load is vLLM's server_load: the requests the engine holds (running and waiting). It
    # counts two streams while they run and drops back when their clients leave.
    async def server_load() -> int:
        return (await get_json(http, b.url + "/load"))["server_load"]

    async def idle() -> bool:
        return await server_load() == 0

    await wait_until(idle, what="an idle engine")
    streams = [await http.post(b.url + "/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": 5000, "stream": True}) for _ in range(2)]
    try:
        for resp in streams:
            assert resp.status == 200 and (await resp.content.readany()).startswith(b"data: ")   # generating
        assert await server_load() == 2
    finally:
        for resp in streams:
            resp.close()
    await wait_until(idle, what="the load back at 0 once the clients left")


async def test_errors(sims, http):
    b: Child = sims["b"]
    url = b.url + "/v1/completions"

    async def expect(status: int, err_type: str, data: bytes) -> dict:
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status, await resp.text()
            err = (await resp.json())["error"]
        assert err["type"] == err_type and err["code"] == status and err["message"] and "param" in err
        return err

    await expect(400, "BadRequestError", b"{not json")
    await expect(400, "BadRequestError", orjson.dumps({"prompt": PROMPT, "max_tokens": "many"}))
    await expect(400, "BadRequestError", orjson.dumps({"prompt": 42}))
    await expect(400, "BadRequestError", orjson.dumps({"prompt": ["a", "b"]}))
    await expect(400, "BadRequestError", orjson.dumps({"prompt": PROMPT, "stream": "yes"}))
    err = await expect(404, "NotFoundError", orjson.dumps({"model": "gpt-9", "prompt": PROMPT}))
    assert "gpt-9" in err["message"]
    err = await expect(400, "BadRequestError", orjson.dumps({"prompt": [1] * 32769, "max_tokens": 1}))
    assert "maximum context length" in err["message"]
    await expect(400, "BadRequestError", orjson.dumps({"prompt": PROMPT, "n": 2}))
    async with http.post(b.url + "/v1/chat/completions", json={"messages": "hi"}) as resp:
        assert resp.status == 400


async def test_stop_word_ends_generation(sims, http):
    b: Child = sims["b"]
    url = b.url + "/v1/completions"
    _, full = await post_json(http, url, {"prompt": PROMPT, "max_tokens": 8})
    words = full["choices"][0]["text"].split()
    stop_at = max(i for i, w in enumerate(words) if w not in words[:i])  # a first occurrence
    _, body = await post_json(http, url, {"prompt": PROMPT, "max_tokens": 8, "stop": [words[stop_at]]})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == words[stop_at]
    assert choice["text"].split() == words[:stop_at]  # the stop word itself is not returned
    assert body["usage"]["completion_tokens"] == stop_at + 1


# ---- metrics and debug routes -------------------------------------------------------

async def test_metrics_move(sims, http):
    b: Child = sims["b"]

    async def scrape() -> str:
        async with http.get(b.url + "/metrics") as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            return await resp.text()

    before = await scrape()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        metric_value(before, name)
    status, _ = await post_json(http, b.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 9})
    assert status == 200
    after = await scrape()

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == PROMPT_TOKENS
    assert delta("vllm:generation_tokens_total") == 9
    assert delta("vllm:prefix_cache_queries_total") == PROMPT_TOKENS
    assert delta("vllm:prefix_cache_hits_total") == 0
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert metric_value(after, "vllm:num_requests_running") == 0
    assert 0 <= metric_value(after, "vllm:kv_cache_usage_perc") <= 1
    assert "vllm:time_to_first_token_seconds_bucket{" in after


async def test_request_log(sims, http):
    b: Child = sims["b"]
    async with http.delete(b.url + "/sim/requests") as resp:
        assert resp.status == 200
    sent = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    await post_json(http, b.url + "/v1/completions", sent, headers={"X-Request-Id": "logged-1"})
    _, chat = await post_json(http, b.url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}], "request_id": "body-id"})
    assert chat["id"] == "chatcmpl-body-id"  # vLLM falls back to the body's request_id
    reqs = (await get_json(http, b.url + "/sim/requests"))["requests"]
    assert [r["path"] for r in reqs] == ["/v1/completions", "/v1/chat/completions"]
    assert reqs[1]["request_id"] == "body-id"
    assert reqs[0]["request_id"] == "logged-1" and reqs[0]["body"] == sent
    assert isinstance(reqs[0]["received_at"], float) and reqs[0]["received_at"] <= reqs[1]["received_at"]
    # role "both" ignores kv_transfer_params
    state = await get_json(http, b.url + "/sim/state")
    assert state["kv_leases"] == 0 and state["role"] == "both"


async def test_faults(sims, http):
    b: Child = sims["b"]
    url = b.url + "/v1/completions"
    try:
        status, _ = await post_json(http, b.url + "/sim/faults", {"status": 503, "message": "boom", "count": 2})
        assert status == 200
        for _ in range(2):
            status, body = await post_json(http, url, {"prompt": PROMPT, "max_tokens": 2})
            assert status == 503 and body["error"]["message"] == "boom"
            assert body["error"]["type"] == "ServiceUnavailableError" and body["error"]["code"] == 503
        status, _ = await post_json(http, url, {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200

        await post_json(http, b.url + "/sim/faults", {"healthy": False})
        async with http.get(b.url + "/health") as resp:
            assert resp.status == 503
        await post_json(http, b.url + "/sim/faults", {"clear": True})
        async with http.get(b.url + "/health") as resp:
            assert resp.status == 200

        await post_json(http, b.url + "/sim/faults", {"delay_s": 0.3, "count": 1})
        t0 = time.monotonic()
        status, _ = await post_json(http, url, {"prompt": PROMPT, "max_tokens": 1})
        assert status == 200 and time.monotonic() - t0 >= 0.3

        status, body = await post_json(http, b.url + "/sim/faults", {"status": "x"})
        assert status == 400
    finally:
        await post_json(http, b.url + "/sim/faults", {"clear": True})


# ---- prefill / decode ----------------------------------------------------------------

P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
LONG_PROMPT = " ".join(f"word{i}" for i in range(100))  # 100 tokens -> 7 blocks of 16


async def test_prefill_decode_flow(sims, http):
    p, d, b = sims["p"], sims["d"], sims["b"]
    p_state0 = await get_json(http, p.url + "/sim/state")
    d_state0 = await get_json(http, d.url + "/sim/state")
    status, p_resp = await post_json(
        http, p.url + "/v1/completions",
        {"prompt": LONG_PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": P_PARAMS},
        headers={"X-Request-Id": "pd-1"})
    assert status == 200, p_resp
    assert p_resp["usage"]["completion_tokens"] == 1
    kv = p_resp["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert len(kv["remote_block_ids"]) == math.ceil(100 / 16)
    assert all(isinstance(i, int) for i in kv["remote_block_ids"])
    assert kv["remote_engine_id"] == p_state0["engine_id"] and kv["remote_request_id"] == "cmpl-pd-1-0"
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.port and kv["tp_size"] == 1
    p_state = await get_json(http, p.url + "/sim/state")
    assert "cmpl-pd-1-0" in p_state["kv_lease_ids"] and p_state["used_blocks"] >= 7

    status, d_resp = await post_json(http, d.url + "/v1/completions",
                                     {"prompt": LONG_PROMPT, "max_tokens": 5, "kv_transfer_params": kv},
                                     headers={"X-Request-Id": "pd-1"})
    assert status == 200, d_resp
    assert d_resp["id"] == "cmpl-pd-1" and d_resp["usage"]["completion_tokens"] == 5
    assert d_resp["kv_transfer_params"] is None
    d_state = await get_json(http, d.url + "/sim/state")
    assert d_state["prompt_tokens_external"] - d_state0["prompt_tokens_external"] == 100
    assert d_state["prompt_tokens_local"] == d_state0["prompt_tokens_local"]
    p_state = await get_json(http, p.url + "/sim/state")
    assert "cmpl-pd-1-0" not in p_state["kv_lease_ids"]
    assert p_state["kv_leases_pulled"] == p_state0["kv_leases_pulled"] + 1
    assert p_state["used_blocks"] == p_state0["used_blocks"]

    # Output is a function of the prompt, so P->D gives what an aggregated engine gives.
    status, b_resp = await post_json(http, b.url + "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 5})
    assert d_resp["choices"][0]["text"] == b_resp["choices"][0]["text"]
    assert d_resp["choices"][0]["text"].startswith(p_resp["choices"][0]["text"])

    # A ticket can be used once: a second pull gets 404 on P, so D recomputes locally (all but
    # the full blocks its prefix cache kept from the first request: the received KV is cached).
    status, again = await post_json(http, d.url + "/v1/completions",
                                    {"prompt": LONG_PROMPT, "max_tokens": 2, "kv_transfer_params": kv})
    assert status == 200
    d_state2 = await get_json(http, d.url + "/sim/state")
    assert d_state2["prompt_tokens_local"] - d_state["prompt_tokens_local"] == 100 - 96
    assert d_state2["prompt_tokens_cached"] - d_state["prompt_tokens_cached"] == 96
    # vLLM reports the prefill node's hits (the ticket's remote_prefill_cached_tokens, 0 here)
    # for a do_remote_prefill request, whatever happened on D.
    assert kv["remote_prefill_cached_tokens"] == 0 and again["usage"]["prompt_tokens_details"] is None
    assert d_state2["kv_pulls_failed"] == d_state["kv_pulls_failed"] + 1


async def test_chat_prefill_decode_streaming(sims, http):
    p, d = sims["p"], sims["d"]
    messages = [{"role": "user", "content": LONG_PROMPT}]
    status, p_resp = await post_json(http, p.url + "/v1/chat/completions",
                                     {"messages": messages, "max_tokens": 1, "max_completion_tokens": 1,
                                      "kv_transfer_params": P_PARAMS}, headers={"X-Request-Id": "pd-chat"})
    assert status == 200
    kv = p_resp["kv_transfer_params"]
    assert kv["remote_request_id"] == "chatcmpl-pd-chat"
    d0 = await get_json(http, d.url + "/sim/state")
    body = {"messages": messages, "max_tokens": 4, "stream": True, "kv_transfer_params": kv}
    async with http.post(d.url + "/v1/chat/completions", json=body) as resp:
        events = sse_events(await resp.read())
    assert len(events) == 1 + 4 + 1
    d1 = await get_json(http, d.url + "/sim/state")
    assert d1["prompt_tokens_external"] - d0["prompt_tokens_external"] == p_resp["usage"]["prompt_tokens"]


async def test_prefill_streaming_returns_params_on_last_chunk(sims, http):
    p = sims["p"]
    body = {"prompt": LONG_PROMPT, "max_tokens": 9, "stream": True, "kv_transfer_params": P_PARAMS}
    async with http.post(p.url + "/v1/completions", json=body, headers={"X-Request-Id": "pd-stream"}) as resp:
        events = sse_events(await resp.read())
    assert len(events) == 2  # a prefill node stops after the first token
    last = orjson.loads(events[0])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["kv_transfer_params"]["remote_request_id"] == "cmpl-pd-stream-0"
    assert "cmpl-pd-stream-0" in (await get_json(http, p.url + "/sim/state"))["kv_lease_ids"]


async def test_decode_with_invalid_params_recomputes(sims, http):
    d = sims["d"]
    d0 = await get_json(http, d.url + "/sim/state")
    broken = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
              "remote_engine_id": "e", "remote_request_id": "r", "remote_host": None, "remote_port": None}
    status, body = await post_json(http, d.url + "/v1/completions",
                                   {"prompt": LONG_PROMPT, "max_tokens": 3, "kv_transfer_params": broken})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    d1 = await get_json(http, d.url + "/sim/state")
    recomputed = d1["prompt_tokens_local"] - d0["prompt_tokens_local"]
    assert recomputed + d1["prompt_tokens_cached"] - d0["prompt_tokens_cached"] == 100
    assert d1["prompt_tokens_external"] == d0["prompt_tokens_external"]
    assert d1["kv_pulls_ok"] == d0["kv_pulls_ok"] and d1["kv_pulls_failed"] == d0["kv_pulls_failed"]


async def test_prefill_omit_kv_fault(sims, http):
    p = sims["p"]
    p0 = await get_json(http, p.url + "/sim/state")
    await post_json(http, p.url + "/sim/faults", {"omit_kv_transfer_params": True, "count": 1})
    status, body = await post_json(http, p.url + "/v1/completions",
                                   {"prompt": LONG_PROMPT, "max_tokens": 1, "kv_transfer_params": P_PARAMS})
    assert status == 200 and body["kv_transfer_params"] is None
    p1 = await get_json(http, p.url + "/sim/state")
    assert p1["kv_leases_created"] == p0["kv_leases_created"] and p1["used_blocks"] == p0["used_blocks"]
    status, body = await post_json(http, p.url + "/v1/completions",
                                   {"prompt": LONG_PROMPT, "max_tokens": 1, "kv_transfer_params": P_PARAMS})
    assert body["kv_transfer_params"] is not None


async def test_kv_lease_expires():
    """In-process prefill sim with a short lease: unpulled KV is freed on time."""
    app = build_app(SimConfig(role="prefill", kv_lease_s=0.2))
    runner, port = await start_http_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await post_json(http, url + "/v1/completions",
                                           {"prompt": LONG_PROMPT, "max_tokens": 1, "kv_transfer_params": P_PARAMS})
            assert status == 200 and body["kv_transfer_params"]["remote_block_ids"]

            async def expired() -> bool:
                s = await get_json(http, url + "/sim/state")
                return s["kv_leases"] == 0 and s["kv_leases_expired"] == 1 and s["used_blocks"] == 0

            await wait_until(expired, what="lease expiry")
            status, _ = await post_json(http, url + "/sim/kv/pull", {
                "remote_request_id": body["kv_transfer_params"]["remote_request_id"],
                "remote_engine_id": body["kv_transfer_params"]["remote_engine_id"]})
            assert status == 404
    finally:
        await runner.cleanup()


# ---- disconnects ---------------------------------------------------------------------

async def _state(http: aiohttp.ClientSession, child: Child) -> dict:
    return await get_json(http, child.url + "/sim/state")


async def test_disconnect_mid_stream_aborts(sims, http):
    b = sims["b"]
    s0 = await _state(http, b)
    async with aiohttp.ClientSession() as client:
        resp = await client.post(b.url + "/v1/completions",
                                 json={"prompt": PROMPT, "max_tokens": 5000, "stream": True})
        got = b""
        while got.count(b"\n\n") < 3:
            got += await resp.content.readany()
        assert (await _state(http, b))["running"] == 1
        resp.close()  # drop the connection mid-stream

    async def freed() -> bool:
        s = await _state(http, b)
        return s["running"] == 0 and s["finished"]["abort"] == s0["finished"]["abort"] + 1

    await wait_until(freed, what="aborted stream to leave the batch")
    assert (await _state(http, b))["used_blocks"] == 0


async def test_disconnect_non_streaming_aborts(sims, http):
    b = sims["b"]
    s0 = await _state(http, b)
    task = asyncio.create_task(post_json(http, b.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 5000}))
    await wait_until(lambda: _running_at_least(http, b, 1), what="request to start running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def freed() -> bool:
        s = await _state(http, b)
        return s["running"] == 0 and s["finished"]["abort"] == s0["finished"]["abort"] + 1

    await wait_until(freed, what="aborted request to leave the batch")


async def _running_at_least(http: aiohttp.ClientSession, child: Child, n: int) -> bool:
    return (await _state(http, child))["running"] >= n


# ---- cost model ----------------------------------------------------------------------

async def _ttft(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    t0 = time.monotonic()
    async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": True}) as resp:
        await resp.content.readuntil(b"\n\n")
        ttft = time.monotonic() - t0
        await resp.read()
    return ttft


async def test_ttft_grows_with_prompt_length(sims, http):
    """10x the prompt tokens, clearly more prefill time (a ratio; no absolute timings)."""
    b = sims["b"]
    short = min([await _ttft(http, b.url, list(range(i, i + 400))) for i in range(3)])
    long = min([await _ttft(http, b.url, list(range(i, i + 4000))) for i in range(2)])
    assert long > 3 * short, (short, long)


async def test_many_concurrent_streams(sims):
    """Hundreds of simultaneous streams, each getting exactly its tokens."""
    b = sims["b"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(i: int) -> int:
            body = {"prompt": f"stream number {i}", "max_tokens": 20, "stream": True}
            async with http.post(b.url + "/v1/completions", json=body) as resp:
                return len(sse_events(await resp.read())) - 1

        counts = await asyncio.gather(*(one(i) for i in range(200)))
        assert counts == [20] * 200
        assert (await _state(http, b))["running"] == 0


# ---- scheduler, stepped in-process ----------------------------------------------------

def _req(rid: str, prompt: int, max_tokens: int) -> SimRequest:
    return SimRequest(request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens, rng=1, arrival=0.0)


async def test_engine_chunked_prefill_and_step_cost():
    cfg = SimConfig(max_num_batched_tokens=100, prefill_ms_per_token=1.0, decode_ms_per_step=4.0,
                    decode_ms_per_seq=0.5, max_model_len=1000, num_gpu_blocks=1000)
    engine = Engine(cfg)
    long, short = _req("long", 250, 3), _req("short", 10, 3)
    engine.submit(long)
    plans = []
    for _ in range(3):
        plan = engine.plan_step()
        plans.append([(r.request_id, n) for r, n in plan.prefill])
        engine.complete_step(plan, 0.0)
    assert plans == [[("long", 100)], [("long", 100)], [("long", 50)]]
    assert len(long.output) == 1  # first token sampled by the step that finishes the prompt
    engine.submit(short)
    plan = engine.plan_step()
    assert [r.request_id for r in plan.decode] == ["long"]
    assert [(r.request_id, n) for r, n in plan.prefill] == [("short", 10)]
    # decode step + one sequence + 10 prefill tokens
    assert engine.step_duration(plan) == pytest.approx((4.0 + 0.5 + 10 * 1.0) / 1000)
    engine.complete_step(plan, 0.0)
    while engine.num_running:
        engine.complete_step(engine.plan_step(), 0.0)
    assert len(long.output) == 3 and len(short.output) == 3 and engine.used_blocks == 0
    assert engine.totals.finished["length"] == 2


async def test_engine_max_num_seqs_queues():
    engine = Engine(SimConfig(max_num_seqs=2, max_model_len=100, num_gpu_blocks=100))
    reqs = [_req(str(i), 5, 2) for i in range(3)]
    for r in reqs:
        engine.submit(r)
    engine.complete_step(engine.plan_step(), 0.0)
    assert engine.num_running == 2 and engine.num_waiting == 1
    engine.complete_step(engine.plan_step(), 0.0)  # first two finish
    assert reqs[0].done and reqs[1].done and not reqs[2].done
    engine.complete_step(engine.plan_step(), 0.0)
    assert engine.num_running == 1 and engine.num_waiting == 0


async def test_engine_preempts_when_kv_is_full():
    # 4 blocks of 4 tokens: two 6-token prompts fit (2 blocks each) until they grow.
    engine = Engine(SimConfig(block_size=4, num_gpu_blocks=4, max_model_len=16))
    a, b = _req("a", 6, 6), _req("b", 6, 6)
    engine.submit(a)
    engine.submit(b)
    for _ in range(40):
        if a.done and b.done:
            break
        engine.complete_step(engine.plan_step(), 0.0)
    assert a.done and b.done and len(a.output) == 6 and len(b.output) == 6
    assert engine.totals.preemptions >= 1 and engine.used_blocks == 0


async def test_engine_abort_frees_slot():
    engine = Engine(SimConfig())
    r = _req("x", 100, 50)
    engine.submit(r)
    engine.complete_step(engine.plan_step(), 0.0)
    assert engine.num_running == 1 and engine.used_blocks > 0
    engine.abort(r)
    assert engine.num_running == 0 and engine.used_blocks == 0 and r.finish_reason == "abort"
    assert engine.totals.finished["abort"] == 1
