"""Recompute: D ends a stream with stop_reason "recomputed"; the client sees one unbroken answer.

vLLM-Ascend's decode nodes do this; neither the simulator nor upstream vLLM does, so the
decode engine here is a small in-test server that speaks exactly that wire form. The
prefill engine, control plane and data plane are the real processes.
"""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from aiohttp import web

from omni_proxy.launcher import ProcessGroup
from omni_runtime import start_http_site
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until

MODEL = "sim-model"


class RecomputingDecode:
    """Streams ``give_back_after`` tokens then "recomputed" on the first request; finishes later ones."""

    def __init__(self, give_back_after: int = 3) -> None:
        self.bodies: list[dict] = []
        self.give_back_after = give_back_after

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    @staticmethod
    def _event(text: str, stop_reason=None, finish=None) -> bytes:
        return b"data: " + orjson.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [
            {"index": 0, "text": text, "finish_reason": finish, "stop_reason": stop_reason}]}) + b"\n\n"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        first = len(self.bodies) == 1
        n = self.give_back_after if first else body["max_tokens"]
        if not body.get("stream"):
            text = "".join(f" w{i}" for i in range(n))
            return web.json_response({"id": "cmpl-x", "object": "text_completion", "choices": [
                {"index": 0, "text": text, "finish_reason": "stop" if first else "length",
                 "stop_reason": "recomputed" if first else None}],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(n):
            await out.write(self._event(f" w{i}" if first else f" v{i}"))
        if first:
            await out.write(self._event("", stop_reason="recomputed", finish="stop"))
        else:
            await out.write(self._event("", finish="length"))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@pytest.fixture
async def system():
    fake = RecomputingDecode()
    runner, port = await start_http_site(fake.app(), "127.0.0.1", 0)
    group = ProcessGroup()
    try:
        # Start and stop in a thread: the in-test engine must keep answering health checks meanwhile.
        p = await asyncio.to_thread(group.start, "prefill", ["sim", "--role", "prefill", "--port", "0"])
        cp = await asyncio.to_thread(group.start, "controlplane", [
            "controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--health-interval", "0.2",
            "--prefill", f"{p.url},id=p", "--decode", f"http://127.0.0.1:{port},id=d"])
        dp = await asyncio.to_thread(group.start, "dataplane", ["dataplane", "--port", "0", "--controlplane",
                                                                cp.address])

        async def both_healthy():
            async with grpc.aio.insecure_channel(cp.address) as ch:
                ws = (await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest())).workers
            return len(ws) == 2 and all(w.status == pb.STATUS_HEALTHY for w in ws)

        await wait_until(both_healthy, what="prefill and decode healthy")
        yield fake, dp
    finally:
        await asyncio.to_thread(group.close)
        await runner.cleanup()


async def test_streamed_recompute_continues_without_a_break(system, http):
    fake, dp = system
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "stream": True}
    async with http.post(dp.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and raw.count(b"[DONE]") == 1
    assert b"recomputed" not in raw
    texts = [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == " w0 w1 w2" + "".join(f" v{i}" for i in range(5))
    # The continuation asked for the rest, with the text so far appended to the prompt.
    assert fake.bodies[1]["prompt"] == "Once upon w0 w1 w2" and fake.bodies[1]["max_tokens"] == 5


async def test_non_streamed_recompute_merges_the_answer(system, http):
    fake, dp = system
    async with http.post(dp.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 6}) as r:
        assert r.status == 200
        data = await r.json()
    assert data["choices"][0]["text"] == " w0 w1 w2 w0 w1 w2"
    assert data["usage"]["completion_tokens"] == 6
    assert fake.bodies[1]["prompt"] == "Hi w0 w1 w2" and fake.bodies[1]["max_tokens"] == 3
