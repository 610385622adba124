"""An engine that misbehaves at the HTTP level, behind a real control plane and data plane.

Issue 21, #4 and #8: an engine that read a request and closed without answering got it a
second time (a duplicate generation); an interim ``100``/``103`` before the answer became
a 502; one malformed answer marked a single-worker model's only engine unhealthy (503 for
every request until the next health check); a status of 999 was taken for a real one.
The engine here is raw asyncio in a thread, so each case says byte for byte what it sends.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import orjson
import pytest
import requests

from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc

OK_BODY = orjson.dumps({"id": "c", "object": "text_completion", "model": "sim-model",
                        "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
MODELS = orjson.dumps({"object": "list", "data": [{"id": "sim-model", "object": "model"}]})


def _answer(body: bytes, status: str = "200 OK", ctype: str = "application/json") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


class HostileEngine:
    """Healthy for the control plane (/health, /v1/models, /metrics); each generation request
    is answered as ``plan`` says. ``ids`` holds the X-Request-Id of every generation request
    read, in order."""

    def __init__(self) -> None:
        self.plan = "ok"
        self.ids: list[str] = []
        self.aborted = 0     # "slow" requests whose connection the data plane closed first
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()
            server.close()

        self._loop.run_until_complete(main())

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = head.split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                path = lines[0].split(" ")[1]
                if path == "/v1/models":
                    writer.write(_answer(MODELS))
                elif path in ("/health", "/metrics"):
                    writer.write(_answer(b"", ctype="text/plain"))
                else:
                    self.ids.append(headers.get("x-request-id", ""))
                    if not await self._generate(reader, writer):
                        return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _generate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer as the plan says; False: close the connection."""
        plan = self.plan
        if plan == "ok":
            writer.write(_answer(OK_BODY))
        elif plan == "slow":                    # answers after 3 s, unless the data plane hangs up first
            try:
                if await asyncio.wait_for(reader.read(1), 3.0) == b"":
                    self.aborted += 1
                    return False
            except TimeoutError:
                pass
            writer.write(_answer(OK_BODY))
        elif plan == "work_then_close":        # reads the request, works 1 s, closes: no answer
            await asyncio.sleep(1.0)
            return False
        elif plan == "interim":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
                         + _answer(OK_BODY))
        elif plan == "bad_chunk":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\n{\"id\"\r\nzz-not-a-size\r\n")
            await writer.drain()
            return False
        elif plan.startswith("status "):
            writer.write(_answer(b'{"error": "odd"}', status=f"{plan.split()[1]} Odd"))
        elif plan == "stall_stream":            # one event, then silence until the data plane hangs up
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         b'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "h"}]}\n\n')
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(1), 20.0)
            except TimeoutError:
                pass
            return False
        elif plan == "huge_head":
            writer.write(b"HTTP/1.1 200 OK\r\n" + b"X-H: v\r\n" * 200_000 + b"Content-Length: 0\r\n\r\n")
        return True


@pytest.fixture(scope="module")
def system():
    engine = HostileEngine()
    group = ProcessGroup()
    try:
        cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                          "--health-interval", "3", "--worker",
                                          f"http://127.0.0.1:{engine.port},role=both,id=only"])
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address])
        yield engine, dp, cp
    finally:
        group.close()
        engine.close()


def _post(dp, **extra) -> requests.Response:
    return requests.post(dp.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 1},
                         timeout=30, **extra)


def _worker(cp) -> pb.WorkerInfo:
    with grpc.insecure_channel(cp.address) as ch:
        return pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0]


def _served(engine: HostileEngine, dp) -> None:
    """The engine serves through the data plane (it starts unchecked; a test may have left it out)."""
    engine.plan = "ok"
    deadline = time.monotonic() + 15
    while (last := _post(dp)).status_code != 200:
        assert time.monotonic() < deadline, last.text
        time.sleep(0.1)


def test_a_request_the_engine_read_and_dropped_reaches_it_once(system):
    """#4: on a reused connection, the engine reads the request, works 1 s and closes. It may
    have generated: the data plane must not send it again on a new connection."""
    engine, dp, _ = system
    _served(engine, dp)
    with requests.Session() as s:   # one client connection: the data plane's engine connection is pooled
        ok = s.post(dp.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 1},
                    timeout=30)
        assert ok.status_code == 200
        engine.plan = "work_then_close"
        before = len(engine.ids)
        resp = s.post(dp.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 1},
                      headers={"X-Request-Id": "once-only"}, timeout=30)
    sent = engine.ids[before:]
    assert resp.status_code == 502, resp.text
    assert len(sent) == 1, f"the engine got the request {len(sent)} times: {sent}"


def test_interim_answers_before_the_real_one_are_skipped(system):
    engine, dp, _ = system
    _served(engine, dp)
    engine.plan = "interim"
    resp = _post(dp)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "hi"


@pytest.mark.parametrize("plan", ["bad_chunk", "huge_head", "status 999", "status 600"])
def test_a_malformed_answer_fails_the_request_not_the_engine(system, plan):
    """#8: the only engine sends one malformed answer: that request gets a clean 502, and
    the engine stays in rotation (the next request is served, not a 503 until the next
    health check)."""
    engine, dp, cp = system
    _served(engine, dp)
    failures = _worker(cp).failures_total
    engine.plan = plan
    resp = _post(dp)
    assert resp.status_code == 502, resp.text
    err = resp.json()["error"]
    assert err["code"] == 502 and "malformed" in err["message"], err
    deadline = time.monotonic() + 10
    while (w := _worker(cp)).failures_total == failures:   # the failure report reached the control plane
        assert time.monotonic() < deadline, "the failure was never reported"
        time.sleep(0.02)
    assert w.status == pb.STATUS_HEALTHY and w.ejected_for_s == 0, (plan, w)
    engine.plan = "ok"
    nxt = _post(dp)
    assert nxt.status_code == 200, f"after {plan}: {nxt.status_code} {nxt.text}"


def _raw_request(dp) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", dp.port), timeout=10)
    body = b'{"model": "sim-model", "prompt": "x", "max_tokens": 1}'
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_a_half_closed_client_is_answered(system):
    """#9 on a real data plane: a complete request, then shutdown(SHUT_WR) (``nc -N``); the
    engine takes 3 s, so the client first gets an interim 100 Continue, then the answer."""
    engine, dp, _ = system
    _served(engine, dp)
    engine.plan = "slow"
    sock = _raw_request(dp)
    try:
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), data[:300]
    assert b"Connection: close" in data and data.endswith(b"}"), data[-300:]


def test_a_client_that_closes_for_good_still_cancels_its_request(system):
    """The other side of #9: a client that closed (not half-closed) while its answer was
    pending is found out (its reset to the interim 100) and the engine leg is aborted."""
    engine, dp, _ = system
    _served(engine, dp)
    engine.plan = "slow"
    aborted = engine.aborted
    sock = _raw_request(dp)
    deadline = time.monotonic() + 10
    before = len(engine.ids)
    while len(engine.ids) == before:        # the request reached the engine
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    while engine.aborted == aborted:
        assert time.monotonic() < deadline, "the engine leg was not aborted"
        time.sleep(0.02)


def test_a_mid_stream_timeout_is_504_to_the_client_and_to_the_control_plane(system, tmp_path):
    """The engine sends one event and then nothing: past --read-timeout the client's stream
    ends with an error event of code 504, and the failure reported to the control plane (the
    data plane's access line carries what it reported) says 504 too (it said 502 to the client)."""
    engine, _, cp = system
    with ProcessGroup(str(tmp_path)) as group:
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                       "--read-timeout", "0.5"])
        _served(engine, dp)
        failures = _worker(cp).failures_total
        engine.plan = "stall_stream"
        resp = requests.post(dp.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 8,
                                                                "stream": True},
                             headers={"X-Request-Id": "stalls"}, timeout=30)
        assert resp.status_code == 200, resp.text
        events = [ln.removeprefix("data: ") for ln in resp.text.split("\n\n") if ln.startswith("data: ")]
        assert events[0].startswith("{") and '"text": "h"' in events[0], resp.text
        err = orjson.loads(events[-1])["error"]
        assert err["code"] == 504 and "timed out" in err["message"], err
        deadline = time.monotonic() + 10
        while (w := _worker(cp)).failures_total == failures:   # the failure report reached the control plane
            assert time.monotonic() < deadline, "the failure was never reported"
            time.sleep(0.02)
        assert "timed out" in w.last_error, w.last_error
        deadline = time.monotonic() + 10
        while not (lines := [orjson.loads(ln[ln.index("{"):]) for ln in dp.log_path.read_text().splitlines()
                             if '"stalls"' in ln and '"upstream_status"' in ln]):
            assert time.monotonic() < deadline, dp.log_tail()
            time.sleep(0.02)
        assert lines[0]["upstream_status"] == 504, lines[0]
    engine.plan = "ok"
