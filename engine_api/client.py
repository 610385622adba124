"""A lean pooled HTTP/1.1 client for engine legs: POST a body, stream the answer back.

Why not aiohttp's ClientSession: on the data plane's hot path it cost 60-90 us of CPU per
request (request/response objects, connector bookkeeping, header handling, StreamReader).
Engine legs need far less: one POST per leg to a few known hosts, a keep-alive pool, and
the answer's bytes as they arrive. Here a request is one ``bytes`` join and one write; an
asyncio Protocol feeds ``httptools.HttpResponseParser`` (llhttp, which also decodes
chunked bodies) and the decoded body goes into a small buffer the consumer drains.

What the callers rely on:

* ``close()`` on a response that is not finished drops its connection: an engine sees a
  cancelled client as a disconnect and aborts the request (frees its KV and its slot).
* A slow consumer never makes us buffer an engine's whole answer: reading from the
  engine's socket pauses past ``BUFFER_HIGH`` unread bytes and resumes as they are read.
* Timeouts raise ``asyncio.TimeoutError``: ``connect_timeout_s`` to get a connection,
  ``read_timeout_s`` for the longest silence of an engine we are waiting for (paused
  reading is our doing, not the engine's, and does not count), and an optional
  ``total_timeout_s`` for a whole leg, answer read included.
* A POST is sent again (once, on a new connection) only where the engine cannot have
  read it, never merely because no answer came: a generation the engine ran and then
  dropped would run twice. As httpcore and urllib3 do, a pooled connection is checked
  before reuse (readable while idle = the engine closed it, or sent what it should not:
  it is dropped); and a reused connection the engine *reset* before any answer byte
  still had our request unread in its socket (a close with unread data is a reset;
  a close after reading the request is a plain FIN). Any other end before the answer
  fails the request (``EngineDisconnected``): the caller's retry policy decides, with
  the client's deadline. Pooled connections are also let go before an engine's usual
  idle timeout (``keepalive_s``), so the engine rarely closes one under us at all.
* Interim answers (``100 Continue``, ``103 Early Hints``) are skipped (RFC 9110 15.2).
  An answer head over ``MAX_HEAD_BYTES``, a header field over ``MAX_FIELD_BYTES``, more
  than ``MAX_HEADERS`` fields, a status outside 200-599 (or 101) is malformed:
  ``EngineProtocolError``, like any answer llhttp cannot parse.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import cast, overload
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

BUFFER_HIGH = 256 * 1024    # unread body bytes past which we stop reading the engine's socket
_URL_CACHE_MAX = 4096       # distinct URLs remembered (workers x paths); cleared past this
_NO_BODY = (204, 304)
MAX_HEAD_BYTES = 64 * 1024  # a whole answer head (status line and fields)
MAX_FIELD_BYTES = 8190      # one header field, name and value (aiohttp's limit)
MAX_HEADERS = 100           # header fields in one answer head
_RESETS = (ConnectionResetError, BrokenPipeError)


class EngineClientError(Exception):
    """Base of this client's failures (timeouts are asyncio.TimeoutError)."""


class EngineConnectError(EngineClientError):
    """No connection to the engine could be made."""


class EngineDisconnected(EngineClientError):
    """The connection broke (or was closed by us) before the answer was complete."""


class EngineProtocolError(EngineClientError):
    """The engine's answer is not valid HTTP/1.1."""


class _Host:
    """One engine address: its idle keep-alive connections, LIFO (the freshest is reused)."""

    __slots__ = ("host", "port", "ssl", "idle", "open", "waiters")

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.host = host
        self.port = port
        self.ssl = tls
        self.idle: list[_Connection] = []
        self.open = 0                                   # connections made and not yet lost
        self.waiters: deque[asyncio.Future] = deque()   # requests waiting for a slot (pool_size)


class _Target:
    """A URL parsed once: its host's pool and the request head up to the per-request headers."""

    __slots__ = ("url", "host", "head")

    def __init__(self, url: str, host: _Host, head: bytes) -> None:
        self.url = url
        self.host = host
        self.head = head


class EngineResponse:
    """An engine's answer, from the moment its status line and headers arrived.

    Read it with ``read()`` or ``async for chunk in resp`` (decoded body chunks, each all
    that arrived since the last one). Fully read, its connection goes back to the pool by
    itself; ``release()`` does so when it can and drops it otherwise; ``close()`` drops it.
    """

    __slots__ = ("status", "reason", "url", "_raw_headers", "_headers", "_conn", "_chunks", "_buffered",
                 "_eof", "_exc", "_waiter", "_sink", "_sink_full")

    def __init__(self, url: str) -> None:
        self.status = 0
        self.reason = ""
        self.url = url
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDict[str] | None = None
        self._conn: _Connection | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[bytes], bool] | None = None   # pipe()'s: takes each chunk as it arrives
        self._sink_full = False      # the sink asked for a pause (pipe() drains, then reads on)

    @property
    def headers(self) -> CIMultiDict[str]:
        if self._headers is None:   # built on first use: most legs look at two headers or none
            self._headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in self._raw_headers)
        return self._headers

    @overload
    def header(self, name: str) -> str | None: ...
    @overload
    def header(self, name: str, default: str) -> str: ...

    def header(self, name: str, default: str | None = None) -> str | None:
        """One header's first value (any case), without building ``headers``: a leg reads
        two at most (Content-Type, Content-Encoding), and the multidict of every field
        cost more than the scan of a few raw ones."""
        if self._headers is not None:
            return self._headers.get(name, default)
        key = name.lower().encode("latin-1")
        size = len(key)
        for k, v in self._raw_headers:
            if len(k) == size and k.lower() == key:
                return v.decode("latin-1")
        return default

    def content_headers(self) -> tuple[str | None, str | None]:
        """(Content-Type, Content-Encoding): the two a relay passes on, in one scan (first
        values, any case; None when absent)."""
        if self._headers is not None:
            return self._headers.get("Content-Type"), self._headers.get("Content-Encoding")
        content = encoding = None
        for k, v in self._raw_headers:
            if len(k) == 12:
                if content is None and k.lower() == b"content-type":
                    content = v.decode("latin-1")
            elif len(k) == 16 and encoding is None and k.lower() == b"content-encoding":
                encoding = v.decode("latin-1")
        return content, encoding

    async def read(self) -> bytes:
        """The whole body; raises if the answer breaks off (the connection is then dropped)."""
        if self._eof:   # the common case: the body came with the head
            return self._take()
        return b"".join([chunk async for chunk in self])

    def body_at_hand(self) -> bytes | None:
        """The whole body when all of it has arrived (a small answer comes with its head),
        without a coroutine, its connection back in the pool; None: ``read()`` it."""
        return self._take() if self._eof else None

    def __aiter__(self) -> EngineResponse:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                return self._take()
            if self._exc is not None:
                raise self._exc
            if self._eof:
                self.release()
                raise StopAsyncIteration
            waiter = self._wait_for_more()
            try:
                await waiter
            finally:
                self._waiter = None

    def _wait_for_more(self) -> asyncio.Future[None]:
        """The future the connection's callback sets when more of the body, its end or a
        failure arrives (a plain call, not a coroutine: it runs once per wait for a chunk)."""
        if self._conn is None:
            raise EngineDisconnected("the response was released before it was read")
        self._waiter = waiter = self._conn.loop.create_future()
        return waiter

    async def pipe(self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to ``sink`` chunk by chunk, each as it arrives (what ``async for``
        yields, in order), from the connection's own callback: no future, no task wake-up
        and no coroutine step per chunk. Returns at the body's end, the connection back in
        the pool as after a full read; raises what iterating would.

        ``sink`` must not raise (it runs inside the connection's parser): it returns True to
        stop reading from the engine until ``drain()`` (awaited here) has returned, e.g.
        when the reader of what it writes is slower, or to hand over a failure of its own
        that ``drain()`` then raises."""
        while self._chunks:          # arrived before the pipe was laid: first, in order
            if sink(self._take()):
                await drain()
        self._sink = sink
        try:
            while True:
                if self._sink_full:
                    self._sink_full = False
                    await drain()
                    conn = self._conn
                    if conn is not None and conn.paused:
                        conn.resume()
                    continue
                if self._exc is not None:
                    raise self._exc
                if self._eof:
                    self.release()
                    return
                waiter = self._wait_for_more()
                try:
                    await waiter
                finally:
                    self._waiter = None
        finally:
            self._sink = None
            self._sink_full = False

    def release(self) -> None:
        """Back to the pool if fully read and the engine keeps the connection; else drop it."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if self._eof and not self._chunks and conn.keep_alive:
            conn.client._put(conn)
        else:
            conn.drop()

    def close(self) -> None:
        """Drop the connection unless the answer is complete (the engine sees a disconnect)."""
        conn = self._conn
        if conn is None:
            return
        if self._eof and not self._chunks:
            self.release()
            return
        self._conn = None
        self._chunks.clear()
        self._fail(EngineDisconnected("the response was closed before its end"))
        conn.drop()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None:
            if conn.paused:
                conn.resume()
            if self._eof:
                self.release()
        return data

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:          # pipe(): straight on, unbuffered
            if sink(data) and not self._sink_full:
                self._sink_full = True
                conn = self._conn
                if conn is not None:
                    conn.pause()
                if self._waiter is not None:
                    self._wake()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        conn = self._conn
        if self._buffered > BUFFER_HIGH and conn is not None:   # (set while the answer arrives)
            conn.pause()
        if self._waiter is not None:   # (_wake, inline: once per body chunk)
            self._wake()

    def _end(self) -> None:
        self._eof = True
        if self._waiter is not None:
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._eof and self._exc is None:
            self._exc = exc
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _reads_until_eof(self) -> bool:
        """No length and not chunked: the body is all the engine sends before it closes."""
        headers = self.headers
        return (self.status not in _NO_BODY and "Content-Length" not in headers
                and "chunked" not in headers.get("Transfer-Encoding", "").lower())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time (no pipelining)."""

    __slots__ = ("client", "host", "loop", "transport", "fd", "poller", "_parser", "_resp", "_head", "_reason",
                 "_read_timer", "_total_timer", "_last_rx", "_head_bytes", "_interim", "got_bytes", "complete",
                 "keep_alive", "lost", "paused", "reused", "reset_unread", "idle_since")

    def __init__(self, client: EngineClient, host: _Host) -> None:
        self.client = client
        self.host = host
        self.loop = client._loop
        # None until asyncio calls connection_made, its first call on a protocol: typed as
        # set, since nothing else runs before it (``is None`` still tells a failed connect).
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.fd = -1
        self.poller: select.poll | None = None   # its socket's readability, checked before each reuse
        self._parser = httptools.HttpResponseParser(self)
        self._resp: EngineResponse | None = None
        self._head: asyncio.Future | None = None
        self._reason = b""
        self._read_timer: asyncio.TimerHandle | None = None
        self._total_timer: asyncio.TimerHandle | None = None
        self._last_rx = 0.0
        self._head_bytes = 0      # bytes received before the final head ended (interim heads included)
        self._interim = False     # the answer being parsed is a 1xx interim one
        self.got_bytes = False    # any byte of the current answer arrived
        self.complete = False     # the current answer was parsed to its end
        self.keep_alive = False
        self.lost = False
        self.paused = False
        self.reused = False
        self.reset_unread = False   # the engine reset the connection with no answer byte sent
        self.idle_since = 0.0

    # ---- asyncio.Protocol

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, base)   # a stream connection's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.fd = sock.fileno()
            self.poller = select.poll()     # made once: a poll object per check was half its cost
            self.poller.register(self.fd, select.POLLIN)
        self.client._conns.add(self)

    def data_received(self, data: bytes) -> None:
        self._last_rx = self.loop.time()
        if self._resp is None:   # an idle connection has nothing to say: treat it as broken
            self.drop()
            return
        resp = self._resp
        in_head = resp.status == 0   # no final head yet (interim ones count against the limit too)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__       # what one of our callbacks raised
            if isinstance(cause, EngineProtocolError):
                self._fail(cause)
            else:
                self._fail(EngineProtocolError(f"malformed answer from {resp.url}: {exc}"))
            return
        if in_head:
            self._head_bytes += len(data)
            if resp.status == 0 and self._head_bytes > MAX_HEAD_BYTES:
                self._fail(EngineProtocolError(f"malformed answer from {resp.url}: "
                                               f"its head is over {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_timers()
        self.client._lost(self)
        resp = self._resp
        if resp is None or self.complete:
            return
        if resp.status and resp._reads_until_eof():
            self.on_message_complete()
            return
        self.reset_unread = not self.got_bytes and isinstance(exc, _RESETS)
        reason = f": {exc}" if exc else ""
        self._fail(EngineDisconnected(f"{resp.url} closed the connection before the answer was complete{reason}"))

    # ---- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            raise EngineProtocolError("data after the end of the answer")
        self.got_bytes = True

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    # The parser's callbacks run only from data_received and connection_lost, with an answer
    # awaited (``_resp`` set).

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self._resp
        assert resp is not None
        headers = resp._raw_headers
        if len(name) + len(value) > MAX_FIELD_BYTES:
            raise EngineProtocolError(f"malformed answer from {resp.url}: "
                                      f"a header field is over {MAX_FIELD_BYTES} bytes")
        if len(headers) >= MAX_HEADERS:
            raise EngineProtocolError(f"malformed answer from {resp.url}: "
                                      f"more than {MAX_HEADERS} header fields")
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self._resp
        assert resp is not None
        status = self._parser.get_status_code()
        reason, self._reason = self._reason, b""
        if status < 200 or status > 599:
            if 100 <= status < 200 and status != 101:   # interim: the real answer follows
                self._interim = True
                resp._raw_headers.clear()
                return
            raise EngineProtocolError(f"malformed answer from {resp.url}: status {status}")
        resp.status = status
        resp.reason = reason.decode("latin-1")
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self._resp
        assert resp is not None
        resp._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.keep_alive = not self.lost and self._parser.should_keep_alive()
        if self._total_timer is not None:
            self._total_timer.cancel()
            self._total_timer = None
        resp = self._resp
        assert resp is not None
        resp._end()

    # ---- driving a request

    async def request(self, resp: EngineResponse, data: bytes, total_timeout_s: float | None) -> None:
        """Send ``data`` and return once the answer's head arrived."""
        head = self.send(resp, data, total_timeout_s)
        try:
            await head
        except BaseException:
            self.drop()
            raise
        finally:
            self._head = None

    def send(self, resp: EngineResponse, data: bytes, total_timeout_s: float | None) -> asyncio.Future:
        """Send ``data``; the future of the answer's head (``request`` without its coroutine:
        on failure the caller drops the connection, and clears ``_head`` in any case)."""
        self._resp = resp
        resp._conn = self
        self.got_bytes = self.complete = self._interim = False
        self._head_bytes = 0
        self._head = head = self.loop.create_future()
        self._last_rx = self.loop.time()
        if self._read_timer is None:   # kept armed across the connection's requests (one per read timeout)
            self._read_timer = self.loop.call_later(self.client.read_timeout_s, self._on_read_timer)
        if total_timeout_s is not None:
            self._total_timer = self.loop.call_later(max(total_timeout_s, 0.0), self._on_total_timer)
        self.transport.write(data)
        return head

    def pause(self) -> None:
        if not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        self.paused = False
        self._last_rx = self.loop.time()   # the silence while paused was ours
        if not self.lost and not self.transport.is_closing():
            self.transport.resume_reading()

    def drop(self) -> None:
        """Close the connection; its response (if any) is no longer ours to finish."""
        self._cancel_timers()
        self._resp = None
        self.keep_alive = False
        if self.transport is not None and not self.lost:
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        self._cancel_timers()
        self.keep_alive = False
        head = self._head
        if head is not None and not head.done():
            head.set_exception(exc)
        if self._resp is not None:
            self._resp._fail(exc)
        if not self.lost:
            self.transport.close()

    def _on_read_timer(self) -> None:
        self._read_timer = None
        if self._resp is None or self.complete:   # nothing to wait for: the next request re-arms it
            return
        timeout = self.client.read_timeout_s
        silent = self.loop.time() - self._last_rx
        if self.paused:
            silent = 0.0
        if silent >= timeout:
            self._fail(TimeoutError(f"{self._resp.url} sent nothing for {timeout:g} s"))
        else:
            self._read_timer = self.loop.call_later(timeout - silent, self._on_read_timer)

    def _on_total_timer(self) -> None:
        self._total_timer = None
        if self._resp is not None and not self.complete:
            self._fail(TimeoutError(f"{self._resp.url} did not answer in time"))

    def _cancel_timers(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._total_timer is not None:
            self._total_timer.cancel()
            self._total_timer = None


def _encode_headers(headers: Mapping[str, str] | list[tuple[str, str]] | tuple[tuple[str, str], ...] | bytes) -> bytes:
    """Header lines; ``bytes`` are lines the caller encoded (and checked) itself."""
    if not headers:
        return b""
    if type(headers) is bytes:
        return headers
    assert not isinstance(headers, bytes)
    items = headers.items() if isinstance(headers, Mapping) else headers
    text = "".join([f"{name}: {value}\r\n" for name, value in items])
    lines = text.count("\n")
    if lines != len(items) or text.count("\r") != lines:   # a CR or LF would inject a header
        raise ValueError("an HTTP header name or value contains CR or LF")
    return text.encode("utf-8", "surrogateescape")


def _readable(poller: select.poll | None) -> bool:
    """An idle connection with something to read: the engine closed it (EOF) or broke the
    protocol; either way it cannot carry a request. The event loop would see it only at
    its next poll, after we had written a request into it. (``poller``: the connection's,
    on its socket; None without one.)"""
    return poller is not None and bool(poller.poll(0))


class EngineClient:
    """Pooled keep-alive HTTP/1.1 POSTs to engines (``pool_size`` 0: no limit per host)."""

    def __init__(self, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0, pool_size: int = 0,
                 keepalive_s: float = 60.0,
                 default_headers: Mapping[str, str] | list[tuple[str, str]] | tuple[tuple[str, str], ...] = (),
                 tls: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.pool_size = pool_size
        self.keepalive_s = keepalive_s
        self._default_headers = _encode_headers(default_headers)   # sent on every request
        self._targets: dict[str, _Target] = {}
        self._hosts: dict[tuple[str, int, bool], _Host] = {}
        self._conns: set[_Connection] = set()
        self._tls = tls   # for https URLs; made on first use (the system's CAs) when not given
        self._sweeper: asyncio.TimerHandle | None = None
        # The loop of the first post(), which sets it before any connection, timer or pool
        # wait is made (every other use follows): typed as set.
        self._loop: asyncio.AbstractEventLoop = cast(asyncio.AbstractEventLoop, None)
        self._closed = False

    async def post(self, url: str, body: bytes,
                   headers: Mapping[str, str] | list[tuple[str, str]] | tuple[tuple[str, str], ...] | bytes = (), *,
                   total_timeout_s: float | None = None) -> EngineResponse:
        """POST ``body``; returns once the answer's status line and headers arrived."""
        if self._closed:
            raise EngineClientError("the client is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        target = self._targets.get(url) or self._target(url)
        data = b"".join((target.head, _encode_headers(headers), b"Content-Length: %d\r\n\r\n" % len(body), body))
        deadline = None if total_timeout_s is None else self._loop.time() + total_timeout_s
        # A pooled connection is at hand (the common case): neither _acquire's coroutine nor
        # request()'s, whose lines are these.
        conn = self._idle(target.host) or await self._acquire(target.host, deadline, fresh=False)
        resp = EngineResponse(target.url)
        try:
            head = conn.send(resp, data, None if deadline is None else deadline - self._loop.time())
            try:
                await head
            except BaseException:
                conn.drop()
                raise
            finally:
                conn._head = None
            return resp
        except EngineDisconnected:
            if not (conn.reused and conn.reset_unread):
                raise   # the engine may have read it (and run it): not ours to send again
        # The engine closed this idle connection with our request unread in it: nothing ran.
        conn = await self._acquire(target.host, deadline, fresh=True)
        resp = EngineResponse(target.url)
        await conn.request(resp, data, None if deadline is None else deadline - self._loop.time())
        return resp

    def close(self) -> None:
        """Close every connection; answers still being read fail with EngineDisconnected."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._conns):
            if not conn.lost:
                conn.transport.close()

    def _target(self, url: str) -> _Target:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = scheme == "https"
        port = parts.port or (443 if tls else 80)
        key = (parts.hostname, port, tls)
        host = self._hosts.get(key)
        if host is None:
            if tls and self._tls is None:
                self._tls = ssl.create_default_context()
            host = self._hosts[key] = _Host(parts.hostname, port, self._tls if tls else None)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = parts.netloc.rpartition("@")[2]
        head = f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n".encode("ascii") + self._default_headers
        if len(self._targets) >= _URL_CACHE_MAX:
            self._targets.clear()
        target = self._targets[url] = _Target(url, host, head)
        return target

    async def _acquire(self, host: _Host, deadline: float | None, fresh: bool) -> _Connection:
        loop = self._loop
        if not fresh:
            conn = self._idle(host)
            if conn is not None:
                return conn
        timeout = self.connect_timeout_s if deadline is None else min(self.connect_timeout_s, deadline - loop.time())
        async with asyncio.timeout(timeout):   # waiting for a pool slot counts as connecting
            while self.pool_size and host.open >= self.pool_size:
                waiter = loop.create_future()
                host.waiters.append(waiter)
                try:
                    await waiter
                except BaseException:
                    if waiter in host.waiters:
                        host.waiters.remove(waiter)
                    elif waiter.done() and not waiter.cancelled():
                        self._wake(host)   # woken, then cancelled: the slot is the next waiter's
                    raise
                conn = None if fresh else self._idle(host)
                if conn is not None:
                    return conn
            return await self._connect(host)

    def _idle(self, host: _Host) -> _Connection | None:
        now = self._loop.time()
        while host.idle:
            conn = host.idle.pop()
            if (not conn.lost and not conn.transport.is_closing() and now - conn.idle_since < self.keepalive_s
                    and not _readable(conn.poller)):
                conn.reused = True
                return conn
            conn.drop()
        return None

    async def _connect(self, host: _Host) -> _Connection:
        made: list[_Connection] = []

        def factory() -> _Connection:
            made.append(_Connection(self, host))
            return made[-1]

        host.open += 1
        try:
            await self._loop.create_connection(factory, host.host, host.port, ssl=host.ssl,
                                               server_hostname=host.host if host.ssl else None)
        except BaseException as exc:
            if not made or made[0].transport is None:   # else connection_lost gives the slot back
                host.open -= 1
                self._wake(host)
            if isinstance(exc, OSError):
                raise EngineConnectError(f"cannot connect to {host.host}:{host.port}: {exc}") from exc
            raise
        return made[0]

    def _put(self, conn: _Connection) -> None:
        """A connection whose answer was read to its end: keep it for the next request."""
        conn._resp = None
        if self._closed or conn.lost or self.keepalive_s <= 0:
            conn.drop()
            return
        conn.idle_since = self._loop.time()
        conn.host.idle.append(conn)
        if conn.host.waiters:
            self._wake(conn.host)
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(max(self.keepalive_s / 2, 0.5), self._sweep)

    def _lost(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        host = conn.host
        host.open -= 1
        if conn in host.idle:
            host.idle.remove(conn)
        self._wake(host)

    def _wake(self, host: _Host) -> None:
        while host.waiters:
            waiter = host.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self) -> None:
        """Close connections idle for longer than ``keepalive_s``; runs only while any are idle."""
        self._sweeper = None
        now = self._loop.time()
        left = False
        for host in self._hosts.values():
            for conn in [c for c in host.idle if now - c.idle_since >= self.keepalive_s]:
                host.idle.remove(conn)
                conn.drop()
            left = left or bool(host.idle)
        if left:
            self._sweeper = self._loop.call_later(max(self.keepalive_s / 2, 0.5), self._sweep)
