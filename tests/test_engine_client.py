"""engine_api.client against real HTTP servers on loopback, on both event loops the planes
use (uvloop in production, asyncio's own where uvloop is missing).

The servers are raw asyncio servers, so each test says byte for byte what the engine does:
chunked or sized bodies, keep-alive or ``Connection: close``, dying mid-body, silence,
closing an idle keep-alive connection just as the next request comes."""

from __future__ import annotations

import asyncio
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from engine_api import client as client_mod
from engine_api.client import (EngineClient, EngineClientError, EngineConnectError, EngineDisconnected,
                               EngineProtocolError, EngineResponse)
from tests.conftest import wait_until
from tests.ports import refused_port


class Request:
    def __init__(self, head: bytes, body: bytes, conn: int, nth: int) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self.line = lines[0]
        self.headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        self.body = body
        self.conn = conn     # which connection (0, 1, ...)
        self.nth = nth       # which request on that connection (0, 1, ...)


Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class RawServer:
    """HTTP/1.1 on loopback: reads requests, lets ``handler`` write the answer by hand;
    the connection is kept for the next request while the handler returns True."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.requests: list[Request] = []
        self.closed = asyncio.Event()   # set when a client closed a connection we were serving
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        conn = self.connections
        self.connections += 1
        try:
            nth = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed.set()
                    return
                req = Request(head, b"", conn, nth)
                req.body = await reader.readexactly(int(req.headers.get("content-length", "0")))
                self.requests.append(req)
                nth += 1
                if not await self.handler(req, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed.set()
        finally:
            writer.close()


def answer(body: bytes = b"", status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def replies(data: bytes, keep: bool = True) -> Handler:
    """A handler that answers every request with ``data`` as it is; ``keep``: keep the connection."""

    async def handler(req, reader, writer) -> bool:
        writer.write(data)
        await writer.drain()
        return keep

    return handler


async def sized(req, reader, writer) -> bool:
    writer.write(answer(b'{"echo": %d}' % len(req.body), extra="Content-Type: application/json\r\nX-Thing: a\r\n"))
    await writer.drain()
    return True


class Harness:
    """Servers and clients of one test, closed at its end."""

    def __init__(self) -> None:
        self.servers: list[RawServer] = []
        self.clients: list[EngineClient] = []

    async def __call__(self, handler: Handler, server_tls: ssl.SSLContext | None = None,
                       **kwargs) -> tuple[RawServer, str, EngineClient]:
        server = RawServer(handler, server_tls)
        url = await server.start()
        self.servers.append(server)
        self.clients.append(EngineClient(**{"connect_timeout_s": 5.0, "read_timeout_s": 10.0, **kwargs}))
        return server, url, self.clients[-1]

    async def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            await s.stop()


LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    """Runs a test's coroutine on each event loop the planes use, with a fresh Harness."""

    def run(case: Callable[[Harness], Awaitable[None]]) -> None:
        async def main() -> None:
            harness = Harness()
            try:
                await case(harness)
            finally:
                await harness.close()

        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            runner.run(main())

    return run


def test_sized_answer_headers_and_request_bytes(run):
    async def case(make):
        server, url, client = await make(sized)
        resp = await client.post(url + "/v1/completions?x=1", b'{"prompt": "hi"}',
                                 [("X-Request-Id", "r-1"), ("Authorization", "Bearer k")])
        assert (resp.status, resp.reason) == (200, "OK")
        assert (resp.header("Content-Type"), resp.header("x-thing"), resp.header("X-Missing", "d")) == (
            "application/json", "a", "d")      # read from the raw fields, before the multidict exists
        assert resp.headers["content-type"] == "application/json"
        assert resp.headers["X-THING"] == "a"
        assert resp.header("X-Thing") == "a" and resp.header("Content-Encoding") is None
        assert await resp.read() == b'{"echo": 16}'
        req = server.requests[0]
        assert req.line == "POST /v1/completions?x=1 HTTP/1.1"
        assert req.headers["host"] == url.removeprefix("http://")
        assert req.headers["x-request-id"] == "r-1"
        assert req.headers["authorization"] == "Bearer k"
        assert req.headers["content-length"] == "16"
        assert req.body == b'{"prompt": "hi"}'

    run(case)


def test_content_headers_are_read_in_one_scan_like_header():
    """The relay's two headers in one scan: first values, any case, None when absent; the
    same answers as ``header`` before and after the multidict exists."""
    resp = EngineResponse("http://e/")
    resp._raw_headers = [(b"X-Thing", b"a"), (b"content-TYPE", b"text/plain"), (b"Content-Encoding", b"gzip"),
                         (b"Content-Type", b"application/json"), (b"Content-Encodings", b"no")]
    assert resp.content_headers() == ("text/plain", "gzip")
    assert resp.content_headers() == (resp.header("Content-Type"), resp.header("Content-Encoding"))
    assert resp.headers["content-type"] == "text/plain"         # (built now)
    assert resp.content_headers() == ("text/plain", "gzip")
    bare = EngineResponse("http://e/")
    bare._raw_headers = [(b"Content-Length", b"2")]
    assert bare.content_headers() == (None, None)


def test_header_lines_encoded_by_the_caller_go_as_they_are(run):
    async def case(make):
        server, url, client = await make(sized)
        resp = await client.post(url + "/v1/completions", b"{}", b"X-Request-Id: r-2\r\n")
        assert await resp.read() == b'{"echo": 2}'
        req = server.requests[0]
        assert req.headers["x-request-id"] == "r-2" and req.headers["content-length"] == "2"

    run(case)


def test_chunked_answer_is_decoded_chunk_by_chunk(run):
    async def case(make):
        parts = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
        step = asyncio.Event()

        async def chunked(req, reader, writer) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
            for part in parts:
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                if req.nth == 0:      # the next chunk only once the client has the previous one
                    await step.wait()
                    step.clear()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True

        server, url, client = await make(chunked)
        resp = await client.post(url + "/v1/completions", b"{}")
        got = []
        async for chunk in resp:
            got.append(chunk)
            step.set()
        assert got == parts
        # Fully read: its connection went back to the pool and serves the next request.
        resp = await client.post(url + "/v1/completions", b"{}", {"X-N": "2"})
        assert b"".join([c async for c in resp]).startswith(b"data: one")
        assert server.connections == 1

    run(case)


def test_keep_alive_one_connection_for_sequential_requests(run):
    async def case(make):
        server, url, client = await make(sized)
        for i in range(5):
            resp = await client.post(url + "/v1/completions", b"x" * i)
            assert await resp.read() == b'{"echo": %d}' % i
        assert server.connections == 1
        assert [r.nth for r in server.requests] == [0, 1, 2, 3, 4]

    run(case)


def test_connection_close_answer_is_not_reused(run):
    async def case(make):
        # The socket stays open: only the header says not to reuse it.
        server, url, client = await make(replies(answer(b"bye", extra="Connection: close\r\n")))
        for _ in range(3):
            resp = await client.post(url + "/", b"")
            assert await resp.read() == b"bye"
            resp.release()
        assert server.connections == 3
        assert all(r.nth == 0 for r in server.requests)

    run(case)


def test_body_until_close_without_length(run):
    async def case(make):
        server, url, client = await make(replies(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall until close",
                                                 keep=False))
        resp = await client.post(url + "/", b"")
        assert await resp.read() == b"all until close"

    run(case)


def test_server_dying_mid_body_is_a_disconnect(run):
    async def case(make):
        dies = replies(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten..", keep=False)
        server, url, client = await make(dies)
        resp = await client.post(url + "/", b"")
        with pytest.raises(EngineDisconnected):
            await resp.read()
        # A stream gets what came, then the error.
        resp = await client.post(url + "/", b"")
        got = b""
        with pytest.raises(EngineDisconnected):
            async for chunk in resp:
                got += chunk
        assert got == b"only ten.."

    run(case)


def test_malformed_answer(run):
    async def case(make):
        server, url, client = await make(replies(b"SMTP ready\r\n\r\n"))
        with pytest.raises(EngineProtocolError):
            await client.post(url + "/", b"")

    run(case)


def test_read_timeout_waiting_for_head_and_for_body(run):
    async def case(make):
        hung_up = []

        async def silent(req, reader, writer) -> bool:
            if req.conn == 1:   # the second connection: a head, then silence
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
                await writer.drain()
            assert await reader.read(1) == b""   # silent until the client gives up
            hung_up.append(req.conn)
            return False

        server, url, client = await make(silent, read_timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await client.post(url + "/", b"")
        assert time.monotonic() - start >= 0.29
        resp = await client.post(url + "/", b"")
        with pytest.raises(asyncio.TimeoutError):
            await resp.read()
        await wait_until(lambda: sorted(hung_up) == [0, 1], what="both timed-out connections closed", timeout=5)

    run(case)


def test_read_timeout_on_a_reused_connection(run):
    async def case(make):
        async def second_is_silent(req, reader, writer) -> bool:
            if req.nth == 0:
                return await sized(req, reader, writer)
            assert await reader.read(1) == b""
            return False

        server, url, client = await make(second_is_silent, read_timeout_s=0.3)
        assert await (await client.post(url + "/", b"")).read() == b'{"echo": 0}'
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await client.post(url + "/", b"")
        assert time.monotonic() - start >= 0.29
        assert [(r.conn, r.nth) for r in server.requests] == [(0, 0), (0, 1)]   # a timeout is not retried

    run(case)


def test_total_timeout_covers_a_trickling_answer(run):
    async def case(make):
        async def trickle(req, reader, writer) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:   # a byte every 20 ms: never silent for the read timeout, never done
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.02)

        server, url, client = await make(trickle, read_timeout_s=0.2)
        start = time.monotonic()
        resp = await client.post(url + "/", b"", total_timeout_s=0.5)
        with pytest.raises(asyncio.TimeoutError):
            await resp.read()
        assert 0.49 <= time.monotonic() - start < 5

    run(case)


def test_early_close_drops_the_connection(run):
    async def case(make):
        release = asyncio.Event()

        async def streams(req, reader, writer) -> bool:
            if req.conn == 0:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
                await writer.drain()
                assert await reader.read(1) == b""    # the client hung up: the engine aborts
                release.set()
                return False
            return await sized(req, reader, writer)

        server, url, client = await make(streams)
        resp = await client.post(url + "/", b"")
        assert await resp.__anext__() == b"first"
        resp.close()
        await asyncio.wait_for(release.wait(), 5)
        with pytest.raises(EngineDisconnected):
            await resp.read()
        resp = await client.post(url + "/", b"")
        assert await resp.read() == b'{"echo": 0}'
        assert server.connections == 2

    run(case)


class ThreadEngine:
    """An engine on blocking sockets in a thread, one script per connection: it decides
    byte for byte when to read, answer, half-close or close, independently of the client's
    event loop (which the asyncio servers above share)."""

    def __init__(self, scripts: list[Callable[[socket.socket, ThreadEngine], None]]) -> None:
        self.scripts = scripts
        self.read: list[tuple[int, bytes]] = []    # (connection, body) of every request it read
        self.errors: list[BaseException] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    def _accept(self) -> None:
        for _n, script in enumerate(self.scripts):
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._run, args=(script, sock), daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, script, sock: socket.socket) -> None:
        try:
            script(sock, self)
        except BaseException as exc:   # noqa: BLE001 - reported by close()
            self.errors.append(exc)
        finally:
            sock.close()

    def read_request(self, sock: socket.socket, conn: int) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                return b""
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(v for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                          if k.strip().lower() == b"content-length"))
        while len(body) < length:
            body += sock.recv(65536)
        self.read.append((conn, body))
        return head

    def close(self) -> None:
        self._listener.close()
        for t in self._threads:
            t.join(5)
        assert not self.errors, self.errors


def _wait_readable(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(5000), "the engine's close never reached the client"


def test_pooled_connection_the_engine_closed_is_not_used(run):
    """The engine half-closes a kept connection while it is idle (FIN) but would still read
    from it: a request written into it would run and never be answered. The client checks
    a pooled connection before reuse, so the request goes out on a new one."""

    async def case(make):
        half_closed = threading.Event()

        def first(sock, engine):
            engine.read_request(sock, 0)
            sock.sendall(answer(b"one"))
            sock.shutdown(socket.SHUT_WR)
            half_closed.set()
            if engine.read_request(sock, 0):   # a request sent into the stale connection
                return

        def second(sock, engine):
            engine.read_request(sock, 1)
            sock.sendall(answer(b"two"))

        engine = ThreadEngine([first, second])
        client = EngineClient(connect_timeout_s=5.0, read_timeout_s=10.0)
        try:
            assert await (await client.post(engine.url + "/", b"a")).read() == b"one"
            assert half_closed.wait(5)
            (host,) = client._hosts.values()
            _wait_readable(host.idle[0].fd)   # the FIN is there; the event loop has not run since
            assert await (await client.post(engine.url + "/", b"bb")).read() == b"two"
        finally:
            client.close()
            engine.close()
        assert engine.read == [(0, b"a"), (1, b"bb")]

    run(case)


def test_request_the_engine_reset_unread_is_sent_again(run):
    """The engine closes a kept connection with our request unread in its socket (its kernel
    answers with a reset): it cannot have run it, so it goes out once more on a new one."""

    async def case(make):
        def first(sock, engine):
            engine.read_request(sock, 0)
            sock.sendall(answer(b"one"))
            _wait_readable(sock.fileno())    # the next request arrived: close without reading it

        def second(sock, engine):
            engine.read_request(sock, 1)
            sock.sendall(answer(b"two"))

        engine = ThreadEngine([first, second])
        client = EngineClient(connect_timeout_s=5.0, read_timeout_s=10.0)
        try:
            assert await (await client.post(engine.url + "/", b"a")).read() == b"one"
            assert await (await client.post(engine.url + "/", b"bb")).read() == b"two"
        finally:
            client.close()
            engine.close()
        assert engine.read == [(0, b"a"), (1, b"bb")]

    run(case)


def test_request_the_engine_read_and_dropped_is_not_sent_again(run):
    """Issue 21 #4: an engine reads a request on a reused connection, works 1 s and closes
    without answering. It may have generated: the request must reach it once, and the
    failure goes to the caller (whose retry policy picks another worker)."""

    async def case(make):
        async def works_then_closes(req, reader, writer) -> bool:
            if req.nth == 1:
                await asyncio.sleep(1.0)     # the engine's work
                return False                 # ... then it closes, no answer
            return await sized(req, reader, writer)

        server, url, client = await make(works_then_closes)
        assert await (await client.post(url + "/", b"a", [("X-Request-Id", "r-1")])).read() == b'{"echo": 1}'
        with pytest.raises(EngineDisconnected):
            await client.post(url + "/", b"bb", [("X-Request-Id", "r-2")])
        ids = [r.headers["x-request-id"] for r in server.requests]
        assert ids == ["r-1", "r-2"], ids

    run(case)


def test_interim_answers_are_skipped(run):
    async def case(make):
        interim = (b"HTTP/1.1 100 Continue\r\n\r\n"
                   b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
        server, url, client = await make(replies(interim + answer(b"real", extra="X-Final: 1\r\n")))
        for _ in range(2):   # and the connection stays good for the next request
            resp = await client.post(url + "/", b"{}")
            assert (resp.status, resp.headers.get("X-Final"), resp.headers.get("Link")) == (200, "1", None)
            assert await resp.read() == b"real"
        assert server.connections == 1

    run(case)


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (2 * 1024 * 1024) + b"\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X-H: v\r\n" * 200_000 + b"Content-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X-H: v\r\n" * (client_mod.MAX_HEADERS + 1) + b"Content-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * client_mod.MAX_FIELD_BYTES + b"\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" * 5000,
], ids=["2MiB-field", "200k-fields", "101-fields", "8191-byte-field", "endless-interim"])
def test_oversized_answer_heads_are_malformed(run, head):
    async def case(make):
        server, url, client = await make(replies(head))
        with pytest.raises(EngineProtocolError):
            await client.post(url + "/", b"")

    run(case)


@pytest.mark.parametrize("status", [101, 600, 999])
def test_status_out_of_range_is_malformed(run, status):
    async def case(make):
        server, url, client = await make(replies(answer(b"x", status=f"{status} Odd")))
        with pytest.raises(EngineProtocolError, match=f"status {status}"):
            await client.post(url + "/", b"")

    run(case)


def test_a_new_connection_that_breaks_is_not_retried(run):
    async def case(make):
        server, url, client = await make(replies(b"", keep=False))
        with pytest.raises(EngineDisconnected):
            await client.post(url + "/", b"")
        assert len(server.requests) == 1

    run(case)


def test_slow_consumer_keeps_buffer_bounded(run, monkeypatch):
    async def case(make):
        size, piece = 8 * 1024 * 1024, b"y" * 65536

        async def big(req, reader, writer) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            for _ in range(size // len(piece)):
                writer.write(piece)
                await writer.drain()
            return True

        most = 0
        feed = EngineResponse._feed

        def watched(self, data):
            nonlocal most
            feed(self, data)
            most = max(most, self._buffered)

        monkeypatch.setattr(EngineResponse, "_feed", watched)
        server, url, client = await make(big)
        resp = await client.post(url + "/", b"")
        got = 0
        async for chunk in resp:
            got += len(chunk)
            await asyncio.sleep(0.005)   # a slow client
        assert got == size
        # Reading pauses past the bound; what was already read from the socket still lands.
        assert most <= client_mod.BUFFER_HIGH + 512 * 1024, most

    run(case)


def test_pipe_hands_every_chunk_in_order_and_pools_the_connection(run):
    """``pipe``: the chunks already buffered, then each as it arrives, in order, from the
    connection's callback; at the end the connection is back in the pool."""
    async def case(make):
        go = asyncio.Event()

        async def chunked(req, reader, writer) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
            await writer.drain()
            await go.wait()
            for part in (b"two", b"three"):
                writer.write(b"%x\r\n%b\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True

        server, url, client = await make(chunked)
        resp = await client.post(url + "/", b"")
        await wait_until(lambda: resp._chunks, timeout=5)      # "one" is buffered before the pipe
        got: list[bytes] = []
        drains = 0

        async def drain() -> None:
            nonlocal drains
            drains += 1

        def sink(chunk: bytes) -> bool:
            got.append(chunk)
            return False

        go.set()
        await resp.pipe(sink, drain)
        assert b"".join(got) == b"onetwothree" and got[0] == b"one" and drains == 0
        (host,) = client._hosts.values()
        assert len(host.idle) == 1, "a piped answer read to its end leaves its connection pooled"

    run(case)


def test_pipe_pauses_the_engine_while_its_sink_drains_and_raises_a_failure(run):
    """A sink that returns True stops reading from the engine until drain() returns; what
    drain raises (the sink's own failure) comes out of pipe, and the connection is dropped."""
    async def case(make):
        piece = b"z" * 1000
        laid = asyncio.Event()    # the body starts once the pipe is laid: no chunk buffered before it

        async def many(req, reader, writer) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * 5))
            await writer.drain()
            await laid.wait()
            for _ in range(5):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
            return True

        server, url, client = await make(many)
        resp = await client.post(url + "/", b"")
        seen: list[bool] = []
        got = 0

        async def drain() -> None:
            if resp._sink is not None:
                seen.append(resp._conn is not None and resp._conn.paused)
            await asyncio.sleep(0.01)

        def sink(chunk: bytes) -> bool:
            nonlocal got
            got += len(chunk)
            return True        # slow reader: drain after every chunk

        laid.set()                # (pipe lays itself before its first await: the body comes after)
        await resp.pipe(sink, drain)
        assert got == len(piece) * 5 and seen and all(seen), seen

        resp = await client.post(url + "/", b"")

        async def fail() -> None:
            raise ConnectionResetError("the client closed the connection")

        with pytest.raises(ConnectionResetError):
            await resp.pipe(lambda chunk: True, fail)
        resp.close()
        assert resp._conn is None

    run(case)


def test_client_error_answer_body_is_read(run):
    async def case(make):
        server, url, client = await make(replies(answer(b'{"error": {"message": "no such model"}}',
                                                        status="404 Not Found")))
        resp = await client.post(url + "/", b"")
        assert (resp.status, resp.reason) == (404, "Not Found")
        assert await resp.read() == b'{"error": {"message": "no such model"}}'
        resp.release()
        await (await client.post(url + "/", b"")).read()
        assert server.connections == 1

    run(case)


def test_connect_error(run):
    async def case(make):
        client = EngineClient(connect_timeout_s=5)
        with refused_port() as port, pytest.raises(EngineConnectError):
            await client.post(f"http://127.0.0.1:{port}/", b"")
        client.close()

    run(case)


def test_pool_size_limits_connections_per_host(run):
    async def case(make):
        server, url, client = await make(sized, pool_size=1)
        first = await client.post(url + "/", b"1")
        second = asyncio.ensure_future(client.post(url + "/", b"22"))
        # It queues for the only connection (a pool waiter), not a second connection.
        await wait_until(lambda: any(h.waiters for h in client._hosts.values()), what="a pool waiter")
        assert not second.done() and len(server.requests) == 1
        assert await first.read() == b'{"echo": 1}'
        assert await (await second).read() == b'{"echo": 2}'
        assert server.connections == 1 and [(r.conn, r.nth) for r in server.requests] == [(0, 0), (0, 1)]

    run(case)


def test_close_closes_pooled_connections(run):
    async def case(make):
        server, url, client = await make(sized)
        await (await client.post(url + "/", b"")).read()
        client.close()
        await asyncio.wait_for(server.closed.wait(), 5)
        with pytest.raises(EngineClientError, match="closed"):
            await client.post(url + "/", b"")

    run(case)


def test_header_injection_is_refused(run):
    async def case(make):
        server, url, client = await make(sized)
        with pytest.raises(ValueError):
            await client.post(url + "/", b"", {"X-Request-Id": "a\r\nX-Evil: 1"})
        assert server.requests == []

    run(case)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_engine(run, tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "2", "-subj", "/CN=engine", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    async def case(make):
        server, url, client = await make(sized, server_tls=server_tls,
                                         tls=ssl.create_default_context(cafile=str(tmp_path / "cert.pem")))
        assert url.startswith("https://")
        for _ in range(2):
            assert await (await client.post(url + "/", b"abc")).read() == b'{"echo": 3}'
        assert server.connections == 1
        untrusted = EngineClient()   # the system's CAs do not know this engine's certificate
        with pytest.raises(EngineConnectError):
            await untrusted.post(url + "/", b"")
        untrusted.close()

    run(case)
