"""The data plane's own HTTP/1.1 server (``dataplane.server``), in process, over raw sockets.

Keep-alive, pipelining, chunked bodies both ways, Expect: 100-continue, HTTP/1.0, the
head deadline, oversized heads, and a disconnect cancelling its handler.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from dataplane.messages import BodyTooLarge, Request, Response, StreamResponse, json_response
from dataplane.server import App, ClientLimits, serve

HEAD_TIMEOUT_S = 0.5


class Harness:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def echo(self, http: Request) -> Response:
        try:
            body = await http.read()
        except BodyTooLarge:
            return json_response({"error": "too large"}, status=413)
        return Response(body=body, headers={"X-Path": http.path, "X-Query": http.query_string},
                        content_type="application/octet-stream")

    async def slow(self, http: Request) -> Response:
        await asyncio.sleep(float(http.headers.get("X-Sleep", "0.2")))
        return Response(body=b"slow", content_type="text/plain")

    async def hang(self, http: Request) -> Response:
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response(body=b"never")

    async def stream(self, http: Request) -> StreamResponse:
        out = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(http)
        for i in range(3):
            await out.write(b"data: %d\n\n" % i)
        await out.write_eof()
        return out

    async def ping(self, http: Request) -> Response:
        return json_response({"ok": True, "remote": http.remote})


@pytest.fixture
async def server():
    h = Harness()
    app = App(limits=ClientLimits(header_timeout_s=HEAD_TIMEOUT_S, keepalive_timeout_s=5, max_header_bytes=1024,
                                  max_headers=20), max_body_bytes=1000)
    app.add_route("POST", "/echo", h.echo)
    app.add_route("GET", "/slow", h.slow)
    app.add_route("GET", "/hang", h.hang)
    app.add_route("GET", "/stream", h.stream)
    app.add_route("GET", "/ping", h.ping)
    site, port = await serve(app, "127.0.0.1", 0)
    h.port = port
    try:
        yield h
    finally:
        await site.cleanup()


async def connect(h: Harness):
    return await asyncio.open_connection("127.0.0.1", h.port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: Content-Length, chunked, or until close."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 10)
    return status, headers, body


async def test_keep_alive_serves_several_requests_on_one_connection(server):
    reader, writer = await connect(server)
    for i in range(3):
        writer.write(b"POST /echo?n=%d HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" % i)
        status, headers, body = await read_response(reader)
        assert (status, body, headers["x-query"]) == (200, b"hello", f"n={i}")
        assert "connection" not in headers and "date" in headers
    writer.close()


async def test_pipelined_requests_are_answered_in_order(server):
    reader, writer = await connect(server)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Sleep: 0.2\r\n\r\n"
                 b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
                 b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    answers = [await read_response(reader) for _ in range(3)]
    assert [a[2] for a in answers[:2]] == [b"slow", b"one"]
    assert orjson.loads(answers[2][2])["ok"] is True
    writer.close()


async def test_chunked_request_body_is_decoded(server):
    reader, writer = await connect(server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    await asyncio.sleep(0.05)
    writer.write(b"6\r\n world\r\n0\r\n\r\n")
    status, _, body = await read_response(reader)
    assert (status, body) == (200, b"hello world")
    writer.close()


async def test_expect_100_continue_is_answered_when_the_body_is_read(server):
    reader, writer = await connect(server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    assert (await read_response(reader))[2] == b"body"
    writer.close()


async def test_body_over_the_limit_is_refused_and_the_connection_closed(server):
    reader, writer = await connect(server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
    status, headers, _ = await read_response(reader)
    assert status == 413
    writer.close()


async def test_streamed_answer_is_chunked(server):
    reader, writer = await connect(server)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert (await read_response(reader))[0] == 200       # still keep-alive after the stream
    writer.close()


async def test_http_1_0_closes_unless_asked_to_keep_alive(server):
    reader, writer = await connect(server)
    writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
    status, headers, body = await read_response(reader)      # no chunking: ends at our close
    assert status == 200 and "transfer-encoding" not in headers and body.endswith(b"data: 2\n\n")
    writer.close()
    reader, writer = await connect(server)
    writer.write(b"GET /ping HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"].lower() == "keep-alive"
    writer.write(b"GET /ping HTTP/1.0\r\n\r\n")
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_unknown_paths_and_methods_are_json_and_head_is_served(server):
    reader, writer = await connect(server)
    writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 404 and orjson.loads(body)["error"]["code"] == 404
    writer.write(b"POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 405 and headers["allow"] == "GET,HEAD" and orjson.loads(body)["error"]["code"] == 405
    writer.write(b"HEAD /ping HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
    assert (await read_response(reader))[0] == 200      # the HEAD answer had no body
    writer.close()


async def test_a_partial_head_gets_408_and_a_silent_connection_is_closed(server):
    reader, writer = await connect(server)
    writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Half: ")
    status, _, body = await read_response(reader)
    assert status == 408 and orjson.loads(body)["error"]["code"] == 408
    writer.close()
    reader, writer = await connect(server)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert loop.time() - started >= HEAD_TIMEOUT_S * 0.8
    writer.close()


@pytest.mark.parametrize("extra,status", [(b"X-Big: " + b"S3CRET" * 300 + b"\r\n", 431),
                                          (b"".join(b"X-H%d: v\r\n" % i for i in range(30)), 431),
                                          (b"Content-Length: <b>\r\n", 400)])
async def test_oversized_or_malformed_heads_are_json_without_the_input(server, extra, status):
    reader, writer = await connect(server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
    got, headers, body = await read_response(reader)
    assert got == status and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == status
    assert b"S3CRET" not in body and b"<b>" not in body
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_client_that_leaves_cancels_its_handler(server):
    reader, writer = await connect(server)
    writer.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(server.started.wait(), 5)
    writer.close()
    await asyncio.wait_for(server.cancelled.wait(), 5)


async def test_pipelined_requests_before_a_malformed_one_are_all_answered_then_the_400(server):
    """Issue 21 #7: A and B, then a malformed line, in one write: A, B, then the 400, then close."""
    reader, writer = await connect(server)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Sleep: 0.1\r\n\r\n"
                 b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo"
                 b"NOT HTTP AT ALL\r\n\r\n")
    answers = [await read_response(reader) for _ in range(3)]
    assert [(a[0], a[2]) for a in answers[:2]] == [(200, b"slow"), (200, b"two")]
    assert "connection" not in answers[0][1] and "connection" not in answers[1][1]
    status, headers, body = answers[2]
    assert status == 400 and headers["connection"] == "close" and orjson.loads(body)["error"]["code"] == 400
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


@pytest.mark.parametrize("pipelined", [1, 2])
async def test_a_client_that_half_closes_after_its_requests_is_answered(server, pipelined):
    """Issue 21 #9: complete requests, then shutdown(SHUT_WR) (``nc -N``): every one is
    answered in order, then the connection closes."""
    reader, writer = await connect(server)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Sleep: 0.2\r\n\r\n"
                 + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo" * (pipelined - 1))
    writer.write_eof()
    answers = [await read_response(reader) for _ in range(pipelined)]
    assert [(a[0], a[2]) for a in answers] == [(200, b"slow"), (200, b"two")][:pipelined]
    assert answers[-1][1]["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_half_closed_client_waiting_long_gets_an_interim_100_then_its_answer(server):
    """Past PROBE_AFTER_S the half-closed client is sent ``100 Continue`` (how a client that
    closed for good is found out); one that is still there then gets its answer."""
    reader, writer = await connect(server)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Sleep: 1.5\r\n\r\n")
    writer.write_eof()
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    status, headers, body = await read_response(reader)
    assert (status, body, headers["connection"]) == (200, b"slow", "close")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_half_closed_client_with_a_cut_body_is_closed(server):
    reader, writer = await connect(server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


@pytest.mark.parametrize("te", [b"identity, chunked", b"gzip, chunked", b"chunked\r\nTransfer-Encoding: chunked",
                                b"identity"])
async def test_transfer_encoding_other_than_chunked_alone_is_400(server, te):
    """Issue 21 #10: llhttp takes ``identity, chunked`` as chunked; a proxy in front may not."""
    reader, writer = await connect(server)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + te + b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 400 and headers["connection"] == "close" and orjson.loads(body)["error"]["code"] == 400
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def _capped(max_connections: int, per_client: int = 0):
    h = Harness()
    app = App(limits=ClientLimits(header_timeout_s=10, keepalive_timeout_s=30, max_connections=max_connections,
                                  max_connections_per_client=per_client), max_body_bytes=1000)
    app.add_route("GET", "/hang", h.hang)
    app.add_route("GET", "/ping", h.ping)
    site, h.port = await serve(app, "127.0.0.1", 0)
    return h, site


async def _ping(reader, writer) -> int:
    writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    return (await read_response(reader))[0]


async def test_at_the_connection_cap_the_longest_idle_is_shed_then_new_ones_get_503():
    """Issue 21 #6: at --max-connections a new client is served by closing the connection
    idle the longest; busy connections are never shed, and with none idle the new one gets
    a 503 with Retry-After."""
    h, site = await _capped(3)
    conns = []
    try:
        busy = await connect(h)
        conns.append(busy)
        busy[1].write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(h.started.wait(), 5)
        old = await connect(h)                   # opened, never used
        kept = await connect(h)
        conns += [old, kept]
        assert await _ping(*kept) == 200         # kept alive: idle since now, after `old`
        new = await connect(h)
        conns.append(new)
        assert await _ping(*new) == 200
        assert await asyncio.wait_for(old[0].read(), 5) == b""     # the longest idle went
        assert await _ping(*kept) == 200                            # the other idle one stayed
        for _r, w in (kept, new):                 # now every connection is busy
            w.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = asyncio.get_running_loop().time() + 5
        while site.idle:                         # (until their heads reached the server)
            assert asyncio.get_running_loop().time() < deadline, "the requests never arrived"
            await asyncio.sleep(0.01)
        refused = await connect(h)
        conns.append(refused)
        status, headers, body = await read_response(refused[0])
        assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
        assert orjson.loads(body)["error"]["code"] == 503
        assert len(site.connections) == 3 and not busy[0].at_eof()
    finally:
        for _, w in conns:
            w.close()
        await site.cleanup()


async def test_the_per_client_cap_sheds_that_clients_idle_connections_only():
    h, site = await _capped(100, per_client=2)
    conns = []
    try:
        other = await asyncio.open_connection("127.0.0.1", h.port, local_addr=("127.0.0.2", 0))   # another address
        first = await connect(h)
        second = await connect(h)
        conns += [other, first, second]
        third = await connect(h)
        conns.append(third)
        assert await _ping(*third) == 200
        assert await asyncio.wait_for(first[0].read(), 5) == b""     # 127.0.0.1's longest idle
        assert await _ping(*second) == 200 and await _ping(*other) == 200
    finally:
        for _, w in conns:
            w.close()
        await site.cleanup()
