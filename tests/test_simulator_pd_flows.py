"""Engine simulator: the parallel (bootstrap) and layerwise-push KV-transfer flows, driven by hand.

Real ``omni-proxy sim`` processes, a proxy's part played by the test: SGLang bootstrap
rooms and vLLM's MooncakeConnector (P and D at once, either arriving first), and
vllm-ascend's layerwise flow (D first) with a small metaserver run inside the test.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from omni_proxy.launcher import Child, LaunchError, ProcessGroup
from omni_runtime import start_http_site
from simulator.config import SimConfig
from simulator.context import SIM
from simulator.server import build_app
from simulator.tokens import count_text_tokens
from tests.conftest import wait_until
from tests.ports import refused_port, reserved_port

PROMPT = " ".join(f"word{i}" for i in range(100))  # 100 tokens -> 7 blocks of 16
PROMPT_TOKENS = count_text_tokens(PROMPT)
assert PROMPT_TOKENS == 100


def start_with_own_bootstrap_port(group: ProcessGroup, name: str, args: list[str], tries: int = 5) -> Child:
    """Start a sim on a separate ``--bootstrap-port``. The sim must be given that port as a
    number (port 0 means "the HTTP port"), so the port is picked here and may be taken before
    the sim binds it: then the sim exits with "in use" and we try another one."""
    for attempt in range(tries):
        try:
            return group.start(name, [*args, "--bootstrap-port", str(reserved_port())])
        except LaunchError as exc:
            if "in use" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def sims():
    """Two prefill sims (one with a short bootstrap timeout on its own bootstrap port) and a decode sim."""
    with ProcessGroup() as group:
        yield {
            "p": group.start("sim-p", ["sim", "--role", "prefill", "--port", "0"]),
            "p_short": start_with_own_bootstrap_port(group, "sim-p-short", [
                "sim", "--role", "prefill", "--port", "0", "--bootstrap-timeout-s", "0.5"]),
            "d": group.start("sim-d", ["sim", "--role", "decode", "--port", "0"]),
        }


async def state(http: aiohttp.ClientSession, child: Child) -> dict:
    async with http.get(child.url + "/sim/state") as resp:
        assert resp.status == 200
        return await resp.json()


async def post(http: aiohttp.ClientSession, url: str, body: dict, rid: str | None = None) -> tuple[int, Any]:
    headers = {"X-Request-Id": rid} if rid else None
    async with http.post(url, json=body, headers=headers) as resp:
        if resp.content_type == "text/event-stream":
            return resp.status, await resp.read()
        return resp.status, await resp.json()


async def idle(http: aiohttp.ClientSession, child: Child) -> bool:
    s = await state(http, child)
    return (s["running"] == 0 and s["waiting"] == 0 and s["waiting_for_remote_kv"] == 0
            and s["bootstrap_rooms_waiting"] == 0 and s["bootstrap_pulls_waiting"] == 0
            and s["bootstrap_room_ids"] == [] and s["kv_push_waits"] == 0 and s["used_blocks"] == 0)


def delta(s0: dict, s1: dict, *keys: str) -> int:
    return sum(s1[k] - s0[k] for k in keys)


# A prompt's KV on D is received or, when an earlier test left it in D's prefix cache, reused.
RECEIVED = ("prompt_tokens_external", "prompt_tokens_cached")


def sglang_body(p: Child, room: int, **extra: Any) -> dict:
    return {"prompt": PROMPT, "max_tokens": 6, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.info["bootstrap_port"], "bootstrap_room": room, **extra}


def sse_count(raw: bytes) -> int:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    return raw.count(b"data: ") - 1


# ---- SGLang bootstrap rooms ------------------------------------------------------------

async def test_ready_file_and_state_report_bootstrap_port(sims, http):
    p, p_short = sims["p"], sims["p_short"]
    assert p.info["bootstrap_port"] == p.port
    assert (await state(http, p))["bootstrap_port"] == p.port
    port = p_short.info["bootstrap_port"]
    assert port != p_short.port and (await state(http, p_short))["bootstrap_port"] == port
    # The separate bootstrap port really serves the long-poll.
    status, body = await post(http, f"http://127.0.0.1:{port}/sim/bootstrap/pull", {"room": 1, "timeout_s": 0})
    assert status == 404 and "bootstrap room" in body["error"]["message"]


async def test_sglang_parallel_concurrent(sims, http):
    p, d = sims["p"], sims["d"]
    p0, d0 = await state(http, p), await state(http, d)
    body = sglang_body(p, 2**62 + 17)
    (ps, p_resp), (ds, d_resp) = await asyncio.gather(post(http, p.url + "/v1/completions", body, "sg-1"),
                                                      post(http, d.url + "/v1/completions", body, "sg-1"))
    assert ps == 200 and ds == 200, (p_resp, d_resp)
    assert p_resp["usage"]["completion_tokens"] == 1 and p_resp["kv_transfer_params"] is None
    assert d_resp["usage"]["completion_tokens"] == 6 and d_resp["id"] == "cmpl-sg-1"
    assert d_resp["choices"][0]["text"].startswith(p_resp["choices"][0]["text"])
    p1, d1 = await state(http, p), await state(http, d)
    assert p1["bootstrap_transfers"] == p0["bootstrap_transfers"] + 1
    assert d1["bootstrap_fetches_ok"] == d0["bootstrap_fetches_ok"] + 1
    assert delta(d0, d1, *RECEIVED) == PROMPT_TOKENS
    assert d1["prompt_tokens_local"] == d0["prompt_tokens_local"]
    assert delta(p0, p1, "prompt_tokens_local", "prompt_tokens_cached") == PROMPT_TOKENS
    assert await idle(http, p) and await idle(http, d)


async def test_sglang_decode_arrives_first(sims, http):
    p, d = sims["p"], sims["d"]
    body = sglang_body(p, 42)
    d_task = asyncio.create_task(post(http, d.url + "/v1/completions", body, "sg-dfirst"))

    async def d_polling() -> bool:
        return (await state(http, p))["bootstrap_pulls_waiting"] == 1

    await wait_until(d_polling, what="D's long-poll to wait on P")
    assert (await state(http, d))["waiting_for_remote_kv"] == 1
    status, p_resp = await post(http, p.url + "/v1/completions", body, "sg-dfirst")
    assert status == 200 and p_resp["usage"]["completion_tokens"] == 1
    status, d_resp = await d_task
    assert status == 200 and d_resp["usage"]["completion_tokens"] == 6
    await wait_until(lambda: idle(http, p), what="P idle")
    assert await idle(http, d)


async def test_sglang_prefill_arrives_first_streaming(sims, http):
    """P holds the room until D comes; both legs stream, as SGLang sends both the same JSON."""
    p, d = sims["p"], sims["d"]
    body = sglang_body(p, 7, stream=True)
    p_task = asyncio.create_task(post(http, p.url + "/v1/completions", body, "sg-pfirst"))

    async def p_holding() -> bool:
        s = await state(http, p)
        return s["bootstrap_rooms_waiting"] == 1 and s["bootstrap_room_ids"] == ["7"] and s["used_blocks"] == 7

    await wait_until(p_holding, what="P to hold room 7")
    assert not p_task.done()
    status, d_raw = await post(http, d.url + "/v1/completions", body, "sg-pfirst")
    assert status == 200 and sse_count(d_raw) == 6
    status, p_raw = await p_task
    assert status == 200 and sse_count(p_raw) == 1
    assert await idle(http, p) and await idle(http, d)


async def test_sglang_chat_and_bad_fields(sims, http):
    p, d = sims["p"], sims["d"]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": [p.port], "bootstrap_room": [99]}  # lists of one = a batch of one
    (ps, _), (ds, d_resp) = await asyncio.gather(post(http, p.url + "/v1/chat/completions", chat),
                                                 post(http, d.url + "/v1/chat/completions", chat))
    assert ps == 200 and ds == 200 and d_resp["usage"]["completion_tokens"] == 3

    for url in (p.url, d.url):
        status, err = await post(http, url + "/v1/completions", sglang_body(p, [1, 2]))
        assert status == 400 and err["error"]["param"] == "bootstrap_room", err
    status, err = await post(http, d.url + "/v1/completions", sglang_body(p, 5, bootstrap_port=None))
    assert status == 400 and err["error"]["param"] == "bootstrap_port"
    status, err = await post(http, d.url + "/v1/completions", sglang_body(p, "x", bootstrap_host=3))
    assert status == 400 and err["error"]["param"] == "bootstrap_host"
    assert await idle(http, p) and await idle(http, d)


async def test_sglang_prefill_times_out_without_peer(sims, http):
    p = sims["p_short"]
    s0 = await state(http, p)
    status, err = await post(http, p.url + "/v1/completions", sglang_body(p, 1234), "lonely")
    assert status == 500 and "bootstrap peer never came" in err["error"]["message"]
    s1 = await state(http, p)
    assert s1["bootstrap_timeouts"] == s0["bootstrap_timeouts"] + 1
    assert await idle(http, p)


async def test_sglang_decode_fails_when_prefill_never_offers(sims, http):
    """The long-poll ends (P's short timeout), and D answers an error instead of hanging."""
    p, d = sims["p_short"], sims["d"]
    d0 = await state(http, d)
    status, err = await post(http, d.url + "/v1/completions", sglang_body(p, 555))
    assert status == 500 and "HTTP 404" in err["error"]["message"], err
    d1 = await state(http, d)
    assert d1["bootstrap_fetches_failed"] == d0["bootstrap_fetches_failed"] + 1
    assert (await state(http, p))["bootstrap_pull_timeouts"] >= 1
    # Nobody listening at the bootstrap address: an error too.
    with refused_port() as nobody:
        status, err = await post(http, d.url + "/v1/completions", {**sglang_body(p, 556), "bootstrap_port": nobody})
    assert status == 500 and "failed" in err["error"]["message"]
    assert await idle(http, d)


# ---- vLLM MooncakeConnector (bootstrap by X-Request-Id) ----------------------------------

def mooncake_bodies(p: Child) -> tuple[dict, dict]:
    p_body = {"prompt": PROMPT, "max_tokens": 1, "stream": False,
              "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    d_body = {"prompt": PROMPT, "max_tokens": 5,
              "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                                     "bootstrap_server_host": "127.0.0.1",
                                     "bootstrap_server_port": p.info["bootstrap_port"]}}
    return p_body, d_body


async def test_mooncake_prefill_first(sims, http):
    p, d = sims["p"], sims["d"]
    p_body, d_body = mooncake_bodies(p)
    rid = f"mc-{uuid.uuid4().hex}"
    p0, d0 = await state(http, p), await state(http, d)
    status, p_resp = await post(http, p.url + "/v1/completions", p_body, rid)
    assert status == 200 and p_resp["usage"]["completion_tokens"] == 1
    # vLLM's MooncakeConnector answers P at once and keeps the blocks for D (delayed free).
    s = await state(http, p)
    assert s["bootstrap_room_ids"] == [rid] and f"cmpl-{rid}-0" in s["kv_lease_ids"] and s["used_blocks"] == 7
    status, d_resp = await post(http, d.url + "/v1/completions", d_body, rid)
    assert status == 200 and d_resp["usage"]["completion_tokens"] == 5
    p1, d1 = await state(http, p), await state(http, d)
    assert p1["kv_leases_pulled"] == p0["kv_leases_pulled"] + 1 and p1["kv_leases"] == 0
    assert p1["bootstrap_transfers"] == p0["bootstrap_transfers"] + 1
    assert delta(d0, d1, *RECEIVED) == PROMPT_TOKENS
    assert await idle(http, p) and await idle(http, d)


async def test_mooncake_decode_first_in_parallel(sims, http):
    p, d = sims["p"], sims["d"]
    p_body, d_body = mooncake_bodies(p)
    rid = f"mc-{uuid.uuid4().hex}"
    d_task = asyncio.create_task(post(http, d.url + "/v1/completions", {**d_body, "stream": True}, rid))

    async def d_polling() -> bool:
        return (await state(http, p))["bootstrap_pulls_waiting"] == 1

    await wait_until(d_polling, what="D's long-poll to wait on P")
    status, _ = await post(http, p.url + "/v1/completions", p_body, rid)
    assert status == 200
    status, raw = await d_task
    assert status == 200 and sse_count(raw) == 5
    assert await idle(http, p) and await idle(http, d)


# ---- vllm-ascend layerwise push (D first, metaserver) -------------------------------------

class FakeMetaserver:
    """The proxy's /v1/metaserver: D posts its ticket, we send the prefill to P with it."""

    def __init__(self, p: Child | None) -> None:
        self.p = p
        self.mode = "ok"          # ok | fail (502) | hang
        self.batch = False        # send P batch_kv_transfer_params like a multi-prompt parent
        self.posted: list[dict] = []
        self.p_answers: list[tuple[int, Any]] = []
        self.pending: dict[str, tuple[str, dict, str]] = {}  # engine id -> (path, body, X-Request-Id)
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/metaserver", self.handle)
        self.runner, port = await start_http_site(app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}/v1/metaserver"

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def expect(self, path: str, body: dict, rid: str) -> None:
        engine_id = f"cmpl-{rid}-0" if path == "/v1/completions" else f"chatcmpl-{rid}"
        self.pending[engine_id] = (path, body, rid)

    async def handle(self, request: web.Request) -> web.Response:
        ticket = await request.json()
        self.posted.append(ticket)
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "fail":
            return web.json_response({"error": "prefill failed"}, status=502)
        if ticket["request_id"] not in self.pending:
            return web.json_response({"error": "unknown request"}, status=404)
        path, body, rid = self.pending.pop(ticket["request_id"])
        params = dict(ticket)
        if self.batch:
            params["batch_kv_transfer_params"] = {ticket["request_id"]: ticket}
        p_body = {**body, "kv_transfer_params": params, "stream": False, "max_tokens": 1, "min_tokens": 1}
        p_body.pop("stream_options", None)
        async with aiohttp.ClientSession() as s, s.post(self.p.url + path, json=p_body,
                                                        headers={"X-Request-Id": rid}) as resp:
            self.p_answers.append((resp.status, await resp.json()))
            if resp.status != 200:
                return web.json_response({"error": "prefill failed"}, status=502)
        return web.json_response({"status": "ok"})


@pytest.fixture
async def metaserver(sims):
    ms = FakeMetaserver(sims["p"])
    await ms.start()
    yield ms
    await ms.stop()


def layerwise_params(ms: FakeMetaserver) -> dict:
    return {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": ms.url}


async def test_layerwise_completion(sims, http, metaserver):
    p, d = sims["p"], sims["d"]
    p0, d0 = await state(http, p), await state(http, d)
    rid = f"lw-{uuid.uuid4().hex}"
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": layerwise_params(metaserver)}
    metaserver.expect("/v1/completions", body, rid)
    status, raw = await post(http, d.url + "/v1/completions", body, rid)
    assert status == 200 and sse_count(raw) == 6  # 5 tokens + usage

    (ticket,) = metaserver.posted
    assert ticket == {
        "token_ids": [], "request_id": f"cmpl-{rid}-0", "do_remote_prefill": False, "do_remote_decode": True,
        "remote_block_ids": ticket["remote_block_ids"], "remote_block_size": 16,
        "remote_engine_id": d0["engine_id"], "remote_host": "127.0.0.1", "remote_port": d.port,
        "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_cached_tokens": 0}
    assert len(ticket["remote_block_ids"]) == 7 and all(isinstance(b, int) for b in ticket["remote_block_ids"])
    ((p_status, p_resp),) = metaserver.p_answers
    assert p_status == 200 and p_resp["usage"]["completion_tokens"] == 1
    assert p_resp["kv_transfer_params"] is None  # layerwise keeps no lease

    p1, d1 = await state(http, p), await state(http, d)
    assert p1["kv_pushes_sent"] == p0["kv_pushes_sent"] + 1 and p1["kv_leases_created"] == p0["kv_leases_created"]
    assert d1["kv_pushes_received"] == d0["kv_pushes_received"] + 1
    assert d1["metaserver_calls_ok"] == d0["metaserver_calls_ok"] + 1
    assert delta(d0, d1, *RECEIVED) == PROMPT_TOKENS
    assert d1["prompt_tokens_local"] == d0["prompt_tokens_local"]
    # P's request log shows what the metaserver sent: D's ticket as kv_transfer_params.
    async with http.get(p.url + "/sim/requests") as resp:
        logged = [r for r in (await resp.json())["requests"] if r["request_id"] == rid]
    assert logged[-1]["body"]["kv_transfer_params"] == ticket
    assert await idle(http, p) and await idle(http, d)


async def test_layerwise_chat_with_batch_params(sims, http, metaserver):
    p, d = sims["p"], sims["d"]
    metaserver.batch = True
    rid = f"lw-{uuid.uuid4().hex}"
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "kv_transfer_params": layerwise_params(metaserver)}
    metaserver.expect("/v1/chat/completions", body, rid)
    status, resp = await post(http, d.url + "/v1/chat/completions", body, rid)
    assert status == 200 and resp["usage"]["completion_tokens"] == 4 and resp["id"] == f"chatcmpl-{rid}"
    assert metaserver.posted[0]["request_id"] == f"chatcmpl-{rid}"
    assert await idle(http, p) and await idle(http, d)


async def test_layerwise_metaserver_failure_is_an_error(sims, http, metaserver):
    d = sims["d"]
    d0 = await state(http, d)
    metaserver.mode = "fail"
    body = {"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": layerwise_params(metaserver)}
    status, err = await post(http, d.url + "/v1/completions", body)
    assert status == 500 and "HTTP 502" in err["error"]["message"]
    status, err = await post(http, d.url + "/v1/completions", {**body, "stream": True})
    assert status == 500 and "HTTP 502" in err["error"]["message"]
    # Unknown id at the metaserver (404) and a metaserver nobody listens on: errors too.
    metaserver.mode = "ok"
    status, err = await post(http, d.url + "/v1/completions", body)
    assert status == 500 and "HTTP 404" in err["error"]["message"]
    with refused_port() as nobody:
        dead = {**body, "kv_transfer_params": {**body["kv_transfer_params"],
                                               "metaserver": f"http://127.0.0.1:{nobody}/v1/metaserver"}}
        status, err = await post(http, d.url + "/v1/completions", dead)
    assert status == 500 and "unreachable after 3 tries" in err["error"]["message"]
    d1 = await state(http, d)
    assert d1["metaserver_calls_failed"] == d0["metaserver_calls_failed"] + 4
    assert await idle(http, d)


async def test_layerwise_prefill_push_rejected(sims, http):
    """P pushing to a D that expects nothing (or to another engine id) fails the prefill."""
    p, d = sims["p"], sims["d"]
    d_state = await state(http, d)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "request_id": "nobody-waits",
              "remote_engine_id": d_state["engine_id"], "remote_host": "127.0.0.1", "remote_port": d.port,
              "remote_block_ids": [1, 2, 3]}
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": params}
    status, err = await post(http, p.url + "/v1/completions", body)
    assert status == 500 and "HTTP 404" in err["error"]["message"]
    status, err = await post(http, p.url + "/v1/completions",
                             {**body, "kv_transfer_params": {**params, "remote_engine_id": None}})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"
    p1, d1 = await state(http, p), await state(http, d)
    assert p1["kv_pushes_failed"] >= 1 and d1["kv_pushes_rejected"] > d_state["kv_pushes_rejected"]
    assert await idle(http, p)


# ---- client disconnects during waits --------------------------------------------------------

async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_disconnects_during_waits_leave_sims_idle(sims, http, metaserver):
    p, d = sims["p"], sims["d"]
    aborts0 = (await state(http, d))["finished"]["abort"]

    # P holding a room for a peer that never comes.
    task = asyncio.create_task(post(http, p.url + "/v1/completions", sglang_body(p, 31337)))

    async def p_holding() -> bool:
        return (await state(http, p))["bootstrap_rooms_waiting"] == 1

    await wait_until(p_holding, what="P to hold the room")
    await _cancel(task)
    await wait_until(lambda: idle(http, p), what="P to drop the room and free its blocks")

    # D long-polling for a room P never offers.
    task = asyncio.create_task(post(http, d.url + "/v1/completions", sglang_body(p, 31338)))

    async def d_polling() -> bool:
        return (await state(http, p))["bootstrap_pulls_waiting"] == 1

    await wait_until(d_polling, what="D's long-poll")
    await _cancel(task)
    await wait_until(lambda: idle(http, d), what="D to leave the wait")
    await wait_until(lambda: idle(http, p), what="P's long-poll to end")

    # D waiting for a metaserver that never answers.
    metaserver.mode = "hang"
    body = {"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": layerwise_params(metaserver)}
    task = asyncio.create_task(post(http, d.url + "/v1/completions", body))

    async def d_waiting() -> bool:
        return (await state(http, d))["kv_push_waits"] == 1 and len(metaserver.posted) == 1

    await wait_until(d_waiting, what="D to wait on the metaserver")
    await _cancel(task)
    await wait_until(lambda: idle(http, d), what="D to forget the push wait")
    # Nothing reached D's engine: the waits ended before admission.
    assert (await state(http, d))["finished"]["abort"] == aborts0


# ---- in-process: timeouts and shutdown --------------------------------------------------

async def test_metaserver_timeout_and_shutdown_end_waits(http):
    """A metaserver that never answers fails D after --metaserver-timeout-s; a stopping sim
    ends its KV waits (held room, long-poll) at once instead of waiting for peers."""
    d_app = build_app(SimConfig(role="decode", metaserver_timeout_s=0.3))
    p_app = build_app(SimConfig(role="prefill"))
    d_runner, d_port = await start_http_site(d_app, "127.0.0.1", 0)
    p_runner, p_port = await start_http_site(p_app, "127.0.0.1", 0)
    p_url = f"http://127.0.0.1:{p_port}"
    ms = FakeMetaserver(None)  # type: ignore[arg-type]
    ms.mode = "hang"
    await ms.start()
    try:
        body = {"prompt": PROMPT, "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True, "metaserver": ms.url}}
        status, err = await post(http, f"http://127.0.0.1:{d_port}/v1/completions", body)
        assert status == 500 and "did not answer within 0.3s" in err["error"]["message"]
        assert d_app[SIM].pushes.counters.metaserver_calls_failed == 1 and len(d_app[SIM].pushes) == 0

        room = {"prompt": PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_port": p_port, "bootstrap_room": 8}
        hold = asyncio.create_task(post(http, p_url + "/v1/completions", room))
        poll = asyncio.create_task(post(http, p_url + "/sim/bootstrap/pull", {"room": 9}))

        async def both_waiting() -> bool:
            rooms = p_app[SIM].rooms
            return rooms.holds_waiting == 1 and rooms.pulls_waiting == 1

        await wait_until(both_waiting, what="a held room and a long-poll")
        await asyncio.wait_for(p_runner.cleanup(), 10)  # a deadline, not a timing assert
        p_runner = None
        for task in (hold, poll):
            with pytest.raises(aiohttp.ClientError):
                await task
        assert p_app[SIM].rooms.holds_waiting == 0 and p_app[SIM].rooms.pulls_waiting == 0
    finally:
        await ms.stop()
        await d_runner.cleanup()
        if p_runner is not None:
            await p_runner.cleanup()
