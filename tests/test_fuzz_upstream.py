"""Bad answers from an engine: the data plane turns them into clean answers, never a 500.

A fake engine (in this process) answers each request as the test says: a connection reset
after some bytes of a stream, malformed SSE, malformed JSON, random bytes, or an error status
with a garbage body. What the client may see: the engine's answer relayed (the data plane
relays engine bytes as they are), the engine's own 4xx, or 502/503/504 as OpenAI JSON; a
stream cut after its first byte ends with a well-formed ``data: {"error": ...}`` event; no
body carries a traceback; the data plane keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

import orjson
import pytest
import requests
from aiohttp import web
from hypothesis import example, given
from hypothesis import strategies as st

from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.fuzz_common import Tally, fuzz_settings, has_traceback

TALLY = Tally("upstream")
CHUNK = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'


class FakeEngine:
    """Healthy for the control plane; answers generation requests as ``self.plan`` says."""

    def __init__(self) -> None:
        self.plan: tuple = ("ok",)
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _serve(self) -> None:
        async def main():
            app = web.Application()
            async def health(_):
                return web.json_response({"ok": True})

            async def models(_):
                return web.json_response({"object": "list", "data": [{"id": "sim-model", "object": "model"}]})

            async def metrics(_):
                return web.Response(text="")

            app.router.add_get("/health", health)
            app.router.add_get("/v1/models", models)
            app.router.add_get("/metrics", metrics)
            app.router.add_post("/v1/completions", self._generate)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(main())

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    async def _generate(self, r: web.Request) -> web.StreamResponse:
        await r.read()
        kind, *args = self.plan
        if kind == "status":
            status, body, ctype = args
            return web.Response(status=status, body=body, headers={"Content-Type": ctype})
        if kind == "body":
            body, ctype = args
            return web.Response(status=200, body=body, headers={"Content-Type": ctype})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        if kind == "reset":          # some bytes of a stream, then the connection is gone
            chunks, = args
            for c in chunks:
                await resp.write(c)
            r.transport.abort()
            return resp
        if kind == "sse":            # whatever bytes, as a stream
            chunks, = args
            for c in chunks:
                await resp.write(c)
            await resp.write_eof()
            return resp
        await resp.write(CHUNK + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    engine = FakeEngine()
    group = ProcessGroup()
    # The breaker would eject the one engine after a few bad answers, and every later input
    # would only see the 503 for that: keep it in rotation so each input reaches it.
    config = tmp_path_factory.mktemp("upstream") / "cp.toml"
    config.write_text("[health]\neject_after = 1000\n")
    try:
        cp = group.start("controlplane", ["controlplane", "--config", str(config), "--listen", "127.0.0.1:0",
                                          "--http-port", "0", "--health-interval", "0.05", "--worker",
                                          f"http://127.0.0.1:{engine.port},role=both,id=fake"])
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address])
        yield engine, dp, cp
    finally:
        group.close()
        engine.close()
        TALLY.flush()


garbage = st.binary(max_size=200)
plans = st.one_of(
    st.tuples(st.just("reset"), st.lists(st.sampled_from([CHUNK, b"data: {", b"\n", b"data: [DONE]"]) | garbage,
                                         min_size=1, max_size=3)),
    st.tuples(st.just("sse"), st.lists(garbage | st.sampled_from([b"data: {not json\n\n", b"event: x\n",
                                                                 b"data: [DONE]\n\n", CHUNK]), max_size=4)),
    st.tuples(st.just("body"), garbage | st.sampled_from([b'{"id": "x", "choices": [', b"null", b"[]", b""]),
              st.sampled_from(["application/json", "text/plain", "application/octet-stream", "text/event-stream"])),
    st.tuples(st.just("status"), st.sampled_from([400, 404, 413, 422, 429, 500, 501, 502, 503, 504, 599]),
              garbage | st.sampled_from([b'{"error": "x"}', b"<html>oops</html>", b""]),
              st.sampled_from(["application/json", "text/html", "text/plain"])),
)


@pytest.mark.timeout(600)
def test_bad_engine_answers_become_clean_answers(system):
    engine, dp, cp = system
    channel = grpc.insecure_channel(cp.address)
    admin = pb_grpc.AdminStub(channel)

    def routable() -> None:
        """An engine reported unreachable (a reset) is out until its next health check."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            w = admin.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0]
            if w.status == pb.STATUS_HEALTHY and w.ejected_for_s == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"the engine did not come back: {w}")

    with requests.Session() as s:
        @fuzz_settings(80)
        @given(plan=plans, stream=st.booleans())
        @example(plan=("reset", [CHUNK, b'data: {"id":"x","obj']), stream=True)   # cut mid-event
        def run(plan, stream):
            routable()
            engine.plan = plan
            body = {"model": "sim-model", "prompt": "x", "max_tokens": 2, "stream": stream}
            resp = s.post(dp.url + "/v1/completions", json=body, timeout=30)
            data = resp.content
            TALLY.add(f"engine {plan[0]}", resp.status_code)
            assert not has_traceback(data), data[:500]
            if plan[0] == "status" and plan[1] < 500 and resp.status_code == plan[1]:
                return                                  # the engine's own 4xx, passed through
            assert resp.status_code in (200, 429, 502, 503, 504) or resp.status_code == plan[1], \
                (plan, resp.status_code, data[:300])
            if resp.status_code >= 400:
                err = orjson.loads(data)["error"]
                assert err["message"] and err["code"] == resp.status_code
            if plan[0] == "reset" and resp.status_code == 200 and resp.headers.get(
                    "Content-Type", "").startswith("text/event-stream"):
                # a stream cut after its first byte ends with a well-formed error event
                last = [ln for ln in data.split(b"\n") if ln.startswith(b"data: ")][-1]
                assert last == b"data: [DONE]" or "error" in orjson.loads(last[6:]), data[-300:]

        run()
        engine.plan = ("ok",)
        assert s.get(dp.url + "/health", timeout=10).status_code == 200
        # Failure reports travel to the control plane after the client's answer, so the engine
        # may leave rotation once more just now: serving again within seconds is the rule.
        deadline = time.monotonic() + 10
        while True:
            routable()
            last = s.post(dp.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2},
                          timeout=30)
            if last.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert last.status_code == 200, last.text
    channel.close()
