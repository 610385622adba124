"""The data plane's HTTP/1.1 server: an asyncio Protocol over httptools' request parser.

Why not aiohttp's server: on this path it cost ~35 us of CPU per request (request and
response objects, a StreamReader per body, a per-connection task, header validation in
Python) where a Protocol feeding ``httptools.HttpRequestParser`` (llhttp) costs ~6 us;
it was ~30% of the data plane's CPU per request. aiohttp stays for the control plane's
HTTP site and as the tests' client. The engine client (``engine_api.client``) is built
the same way on httptools' response parser.

What a connection does:

* Keep-alive, pipelining (requests are answered in order, one handler at a time; past
  ``MAX_PIPELINED`` queued requests reading pauses), HTTP/1.0 (no keep-alive unless
  asked; a streamed answer is ended by closing), ``Connection: close``, chunked request
  bodies (llhttp decodes them), ``Expect: 100-continue`` (answered when the handler
  reads the body), HEAD for GET routes.
* Connections are capped (``ClientLimits.max_connections``, by default half of the
  process's open-file limit, the rest left for engine legs; optionally per client
  address): at the cap a new connection first sheds the connection idle the longest
  (no request in flight: kept alive, or opened and silent), and only when none is
  idle is refused with a 503. Idle sockets held open can then no longer lock every
  new client out until the head timeout; when the cap bites it says so in the log
  (at most once per ``CAP_LOG_EVERY_S``).
* Slow clients are cut off: from a connection's start, or from the first byte of a
  request after an idle keep-alive period, the whole head must arrive within
  ``header_timeout_s`` however slowly it trickles (a partial head gets a 408, a
  connection that sent nothing is closed silently); idle keep-alive connections close
  after ``keepalive_timeout_s``. The body's deadline is enforced where it is read
  (``dataplane.intake``). One timer per connection serves all three: moving a deadline
  later is a float assignment, the timer re-arms itself when it fires early.
* Malformed HTTP (a bad request line, an oversized or an extra header) is answered as an
  OpenAI-style JSON error naming what was wrong but never repeating what the client sent.
* A client that goes away cancels its request's handler task: the flows rely on
  ``CancelledError`` to close their engine legs (the engines abort) and report it.
* A client that half-closes after complete requests (``nc -N``, some L4 balancers) is
  still answered, in order, then the connection closes. TCP cannot tell that from a
  client that closed for good, so an answer still pending after ``PROBE_AFTER_S`` is
  preceded by an interim ``100 Continue`` (which RFC 9110 clients must skip): a gone
  client's kernel answers it with a reset, which we then see and cancel the handler.
* A malformed request after pipelined ones is answered (400) after their answers.
* ``Transfer-Encoding`` other than a single ``chunked`` is refused (400): llhttp takes
  ``identity, chunked`` as chunked, which a proxy in front may read otherwise.
* A response's head and body leave in one write; a stream's head leaves with its first
  chunk. Closing after an answer while the client may still be sending shuts our side
  down first and lingers briefly, so the client reads the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import resource
import select
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict

from dataplane.errors import error_body, error_response
from dataplane.messages import Handler, PayloadError, Request, Response, StreamResponse

log = logging.getLogger(__name__)

MAX_PIPELINED = 16          # requests queued behind the one being handled before reading pauses
LINGER_S = 5.0              # after our FIN, how long a closing connection may still send
SHUTDOWN_TIMEOUT_S = 60.0   # in-flight requests get this long to finish when the server stops
_BIG_BODY = 64 * 1024       # bodies up to this are copied after the head, for one write
PROBE_AFTER_S = 1.0         # a half-closed client still waiting this long is probed (see above)
_PROBE_EVERY_S = 0.5        # ... and its socket checked for a reset this often
_GONE = select.POLLHUP | select.POLLERR


CAP_LOG_EVERY_S = 10.0      # at most one log line per this long while the connection cap bites


@dataclass
class ClientLimits:
    header_timeout_s: float = 30.0      # request line + headers, from the first byte (0 = off)
    body_timeout_s: float = 60.0        # the whole body, from the end of the headers (0 = off)
    keepalive_timeout_s: float = 75.0   # an idle keep-alive connection is closed after this
    max_header_bytes: int = 8190        # longest request line, and longest header field
    max_headers: int = 100
    max_connections: int = 0            # client connections at once (0 = half the open-file limit)
    max_connections_per_client: int = 0   # from one address (0 = no limit: a balancer is one address)

    def validate(self) -> None:
        """Raises ValueError naming the flag of a value that cannot work."""
        if self.max_connections < 0:
            raise ValueError("--max-connections must be 0 (half the open-file limit) or a positive count")
        if self.max_connections_per_client < 0:
            raise ValueError("--max-connections-per-client must be 0 (no limit) or a positive count")
        limit = open_file_limit()
        if self.max_connections > limit - 16:
            raise ValueError(f"--max-connections {self.max_connections} leaves no descriptors for engines: "
                             f"this process may open {limit} files (ulimit -n); raise that or lower the flag")

    def connection_cap(self) -> int:
        """The cap in force: the flag's, else half of what the process may open (the other
        half is for engine connections, Redis, files)."""
        return self.max_connections or max(open_file_limit() // 2, 16)


def open_file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


Middleware = Callable[[Request, Handler], Awaitable[Response | StreamResponse]]


def _chained(mw: Middleware, inner: Handler) -> Handler:
    """``inner`` behind the middleware ``mw`` (a function of its own, so each link keeps its own pair)."""
    return lambda request: mw(request, inner)


class App:
    """Routes, middlewares around every handler, startup and cleanup hooks.

    A route's path is exact, or ends in one ``{name}`` that stands for the rest of the path
    (``/v1/models/{model}``: model ids may hold slashes); the handler reads it as
    ``request.path[len(prefix):]``. Exact paths win; templates are tried only after them."""

    def __init__(self, *, limits: ClientLimits, max_body_bytes: int, middlewares: Sequence[Middleware] = ()) -> None:
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.middlewares = list(middlewares)
        self.on_startup: list[Callable[[], Awaitable[None]]] = []
        self.on_cleanup: list[Callable[[], Awaitable[None]]] = []
        self._handlers: dict[str, dict[str, Handler]] = {}
        self._chains: dict[str, dict[str, Handler]] | None = None
        self._prefixes: list[tuple[str, str]] = []     # (prefix, template) of ``{name}`` routes
        self._not_found: Handler | None = None

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self._handlers.setdefault(path, {})[method] = handler
        if path.endswith("}") and "{" in path and (path.rpartition("{")[0], path) not in self._prefixes:
            self._prefixes.append((path.rpartition("{")[0], path))
        if method == "GET":
            self._handlers[path].setdefault("HEAD", handler)

    def routes(self) -> list[tuple[str, str]]:
        """(method, path) of every route, HEAD included."""
        return [(m, p) for p, methods in self._handlers.items() for m in methods]

    def _wrap(self, handler: Handler) -> Handler:
        for mw in reversed(self.middlewares):
            handler = _chained(mw, handler)
        return handler

    def _freeze(self) -> dict[str, dict[str, Handler]]:
        chains = self._chains = {p: {m: self._wrap(h) for m, h in methods.items()}
                                 for p, methods in self._handlers.items()}

        async def not_found(request: Request) -> Response:
            return error_response(404, "404: Not Found")

        self._not_found = self._wrap(not_found)
        return chains

    def resolve(self, method: str, path: str) -> Handler:
        """The handler, middlewares included; 404 and 405 also pass through the middlewares."""
        chains = self._chains
        if chains is None:
            chains = self._freeze()
        methods = chains.get(path)
        if methods is None:
            for prefix, template in self._prefixes:
                if path.startswith(prefix) and len(path) > len(prefix):
                    methods = chains[template]
                    break
            else:
                assert self._not_found is not None   # made with the chains
                return self._not_found
        handler = methods.get(method)
        if handler is None:
            allow = ",".join(sorted(methods))

            async def not_allowed(request: Request) -> Response:
                return error_response(405, "405: Method Not Allowed", headers={"Allow": allow})

            return self._wrap(not_allowed)
        return handler

    async def startup(self) -> None:
        for hook in self.on_startup:
            await hook()

    async def cleanup(self) -> None:
        for hook in self.on_cleanup:
            await hook()


# ---------------------------------------------------------------- writing heads

_STATUS_LINES: dict[int, str] = {}


def _status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n"
    return line


_DATE: list = [-1, ""]     # (second, its Date line)


def _date() -> str:
    """``Date:``, formatted once a second."""
    second = int(time.time())
    if second != _DATE[0]:
        _DATE[:] = second, f"Date: {email.utils.formatdate(second, usegmt=True)}\r\n"
    return _DATE[1]


def _head(status: int, headers: dict[str, str], framing: str) -> bytes:
    """Status line, the handler's headers, Date, then ``framing`` (length / chunked / Connection)."""
    lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        raise ValueError("a response header contains a line break")
    return (_status_line(status) + lines + _date() + framing + "\r\n").encode("utf-8")


# ---------------------------------------------------------------- parsing requests

class _Refuse(Exception):
    """Malformed or oversized input: answered with this status and fixed message, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_LINE_TOO_LONG = (431, "a request line or header field is over the size limit")
_TOO_MANY = (431, "too many request header fields")
_BAD_TE = (400, "unsupported Transfer-Encoding: only a single 'chunked' is accepted")
_FULL = error_body(503, "too many connections to this node; retry shortly")
_FULL_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(_FULL), _FULL))
_METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# What the connection's one timer is waiting for.
_NONE, _START, _HEAD, _IDLE, _LINGER = range(5)


def _parse_error(exc: httptools.HttpParserError) -> tuple[int, str]:
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        return 400, "malformed HTTP method"
    if isinstance(exc, httptools.HttpParserInvalidURLError):
        return 400, "malformed HTTP request line"
    text = str(exc).lower()
    if "header" in text or "content-length" in text or "transfer-encoding" in text:
        return 400, "malformed HTTP header"
    return 400, "malformed HTTP request"


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers in order, writes answers."""

    __slots__ = ("site", "app", "limits", "loop", "transport", "remote", "lost", "write_paused", "_parser",
                 "_url", "_raw_headers", "_head_bytes", "_in_head", "_request", "_current", "_task", "_queue",
                 "_input_closed", "_reading_paused", "_drain_waiter", "_deadline", "_deadline_kind", "_timer",
                 "_timer_at", "_responded", "closing", "_te_seen", "_probe")

    def __init__(self, site: Site) -> None:
        self.site = site
        self.app = site.app
        self.limits = site.app.limits
        self.loop = site.loop
        # None until asyncio calls connection_made, its first call on a protocol: typed as
        # set, since nothing else runs before it.
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.remote = ""
        self.lost = False
        self.write_paused = False
        self.closing = False                       # the server is stopping: no keep-alive
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = False                      # a request head has begun and not ended
        self._request: Request | None = None       # the request whose body is arriving
        self._current: Request | None = None       # the request being handled
        self._task: asyncio.Task | None = None
        self._queue: deque[Request | _Refuse] = deque()
        self._input_closed = False                 # no more requests are read on this connection
        self._reading_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self._deadline = 0.0
        self._deadline_kind = _NONE
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._responded = False                    # the current request's answer is complete
        self._te_seen = False                      # this head had a Transfer-Encoding field
        self._probe: asyncio.TimerHandle | None = None   # half-closed: is the client still there?

    # ---- asyncio.Protocol

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, base)   # a stream server's
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) and peer else ""
        if not self.site.admit(self):
            self.lost = True          # refused: never served, never counted
            transport.write(_FULL_ANSWER)
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        limits = self.limits
        self._set_deadline(_START, limits.header_timeout_s or limits.keepalive_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._input_closed or self.lost:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._input_closed = True     # no protocol switch here: the request is answered, then close
        except httptools.HttpParserError as exc:
            cause = exc.__context__       # what one of our callbacks raised
            if isinstance(cause, _Refuse):
                self._refuse(cause)
                return
            req = self._request
            if req is not None:           # the head was fine; the body's framing is not
                self._input_closed = True
                req.fail(PayloadError("malformed request body framing"))
            else:
                self._refuse(_Refuse(*_parse_error(exc)), type(exc).__name__)
            return
        if self._in_head:
            self._head_bytes += len(data)
            limits = self.limits
            if self._head_bytes > limits.max_header_bytes * (limits.max_headers + 2):
                self._refuse(_Refuse(*_LINE_TOO_LONG))
                return
            if self._current is None and self._deadline_kind != _HEAD:
                if self._deadline_kind == _START:
                    self._deadline_kind = _HEAD     # a new connection's head: timed from its start
                elif limits.header_timeout_s > 0:
                    self._set_deadline(_HEAD, limits.header_timeout_s)

    def eof_received(self) -> bool | None:
        """The client sent all it will: answer its complete requests, then close."""
        req = self._request                        # a request whose body is still arriving
        if self._current is None or req is self._current:
            return None     # nothing complete to answer, or its body never ends: close (cancels)
        if req is not None:                        # queued, its body cut short: dropped
            self._request = None
            self._queue.remove(req)
            req.fail(PayloadError("the client closed its side before the body ended"))
        self._input_closed = True
        self._in_head = False
        self._probe = self.loop.call_later(PROBE_AFTER_S, self._check_peer, True)
        return True         # keep our side open for the answers

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.site.forget(self)
        self._deadline_kind = _NONE
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        task = self._task
        if task is not None and not task.done() and not self._responded:
            task.cancel()         # the handler's legs close on CancelledError
        for req in (self._request, self._current):
            if req is not None and not req.complete:
                req.fail(PayloadError("the client closed the connection"))
        self._queue.clear()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        if self.write_paused:
            self._drain_waiter = waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self._drain_waiter = None

    # ---- httptools callbacks

    def on_message_begin(self) -> None:
        self.site.idle.pop(self, None)
        self._in_head = True
        self._url = b""
        self._raw_headers = []
        self._head_bytes = 0
        self._te_seen = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_header_bytes:
            raise _Refuse(*_LINE_TOO_LONG)

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._raw_headers
        if len(name) + len(value) > self.limits.max_header_bytes:
            raise _Refuse(*_LINE_TOO_LONG)
        if len(headers) >= self.limits.max_headers:
            raise _Refuse(*_TOO_MANY)
        if len(name) == 17 and name.lower() == b"transfer-encoding":
            if self._te_seen or value.strip().lower() != b"chunked":
                raise _Refuse(*_BAD_TE)
            self._te_seen = True
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        raw = parser.get_method()
        method = _METHODS.get(raw) or raw.decode("ascii", "replace")
        url = self._url
        if url[:1] == b"/":
            path, _, query = url.partition(b"?")
        else:                      # absolute form ("http://host/path"), or "*"
            try:
                parsed = httptools.parse_url(url)
                path, query = parsed.path or b"", parsed.query or b""
            except httptools.HttpParserInvalidURLError:
                path, query = url, b""
        text = path.decode("utf-8", "surrogateescape")
        if "%" in text:
            text = unquote(text)
        headers = CIMultiDict([(k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                               for k, v in self._raw_headers])
        req = Request(self, method, text, query.decode("utf-8", "surrogateescape"), headers,
                      parser.get_http_version(), parser.should_keep_alive(), self.app.max_body_bytes)
        self._request = req
        if self._current is None:
            self._start(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= MAX_PIPELINED and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        req = self._request
        assert req is not None   # httptools calls it between on_headers_complete and on_message_complete
        req.feed(body)

    def on_message_complete(self) -> None:
        req = self._request
        assert req is not None
        self._request = None
        req.end()

    # ---- running requests

    def _start(self, req: Request) -> None:
        self._current = req
        self._responded = False
        self._deadline_kind = _NONE        # busy: the body deadline is the handler's
        self._task = self.loop.create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        try:
            resp = await self.app.resolve(req.method, req.path)(req)
        except asyncio.CancelledError:
            return                 # the client left (or the server stops): nothing to answer
        except Exception:
            log.exception("error handling %s %s from %s", req.method, req.path, req.remote)
            resp = error_response(500, "internal error in the data plane; see its log")
        try:
            self._finish(req, resp)
        except Exception:          # e.g. a header value that cannot be sent: drop the connection
            log.exception("writing the answer to %s %s failed", req.method, req.path)
            if not self.lost:
                self.transport.abort()

    def _finish(self, req: Request, resp: Response | StreamResponse) -> None:
        self._responded = True
        if self.lost or self.transport.is_closing():
            return         # connection_lost follows
        started = req.started
        if started is None and isinstance(resp, StreamResponse):   # returned unprepared: an empty stream
            self.start_stream(req, resp)
            started = resp
        if started is not None:
            if resp is not started:
                log.error("%s %s: an answer was returned after a streamed one had started", req.method, req.path)
                self._close(linger=True)
                return
            if not started.eof:
                self.end_stream(started)
            close = started.closes or not started.chunked
        else:
            close = not req.keep_alive or resp.closes or not req.complete or self._last_answer()
            assert isinstance(resp, Response)   # not started, and no StreamResponse (above)
            self._write_response(req, resp, close)
        self._next(req, close)

    def _write_response(self, req: Request, resp: Response, close: bool) -> None:
        body = resp.body
        headers = resp.headers
        # _head's lines, inline (once per answer)
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError("a response header contains a line break")
        second = int(time.time())
        date = _DATE[1] if second == _DATE[0] else _date()
        connection = "Connection: close\r\n" if close else (
            "Connection: keep-alive\r\n" if req.version == "1.0" else "")
        head = (f"{_STATUS_LINES.get(resp.status) or _status_line(resp.status)}{lines}{date}"
                f"Content-Length: {len(body)}\r\n{connection}\r\n").encode()
        if req.method == "HEAD" or not body:
            self.transport.write(head)
        elif len(body) <= _BIG_BODY:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    def _last_answer(self) -> bool:
        """No request follows the current one: the server stops, or the input has ended
        (a malformed request, the client's EOF) and nothing is queued behind it."""
        return self.closing or (self._input_closed and not self._queue)

    def _check_peer(self, first: bool = False) -> None:
        """A half-closed client still waits for an answer: gone for good, or only done sending?

        The first call writes an interim ``100 Continue`` (HTTP/1.1 clients skip it; once a
        stream has started its chunks do the same); a client that closed answers it with
        a reset, seen here as POLLHUP/POLLERR on our socket: abort, which cancels the handler."""
        self._probe = None
        req = self._current
        if self.lost or req is None:
            return
        if first and req.started is None and req.version == "1.1" and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT)
            if any(ev & _GONE for _, ev in poller.poll(0)):
                log.info("%s closed its connection before its answer", self.remote or "a client")
                self.transport.abort()
                return
        self._probe = self.loop.call_later(_PROBE_EVERY_S, self._check_peer)

    def _next(self, req: Request, close: bool) -> None:
        self._current = None
        self._task = None
        if close or self.lost:
            if not self.lost:
                self._close(linger=not req.complete or self._in_head or bool(self._queue))
            return
        queue = self._queue
        while queue:
            nxt = queue.popleft()
            if self._reading_paused and len(queue) < MAX_PIPELINED // 2:
                self._reading_paused = False
                self.transport.resume_reading()
            if isinstance(nxt, _Refuse):
                self._write_refusal(nxt)
                return
            self._start(nxt)
            return
        if self._in_head and self.limits.header_timeout_s > 0:
            self._set_deadline(_HEAD, self.limits.header_timeout_s)
        else:
            if not self._in_head:
                self.site.idle[self] = None     # the newest idle: shed last
            self._set_deadline(_IDLE, self.limits.keepalive_timeout_s)

    # ---- streamed answers (``dataplane.messages.StreamResponse``)

    def start_stream(self, req: Request, resp: StreamResponse) -> None:
        req.started = resp
        close = resp.closes or not req.keep_alive or self._last_answer()
        if req.version == "1.1":
            framing = "Transfer-Encoding: chunked\r\n"
        else:                      # HTTP/1.0: no chunked encoding; the end of the stream is our close
            framing = ""
            resp.chunked = False
            close = True
        if close:
            resp.closes = True
            framing += "Connection: close\r\n"
        resp.head = _head(resp.status, resp.headers, framing)

    def write_chunk(self, resp: StreamResponse, data: bytes) -> None:
        if self.lost or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if not data:
            return
        frame = b"%x\r\n%b\r\n" % (len(data), data) if resp.chunked else data
        if resp.head:
            frame = resp.head + frame
            resp.head = b""
        self.transport.write(frame)

    def end_stream(self, resp: StreamResponse) -> None:
        if self.lost or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        resp.eof = True
        tail = b"0\r\n\r\n" if resp.chunked else b""
        if resp.head:
            tail = resp.head + tail
            resp.head = b""
        if tail:
            self.transport.write(tail)

    def continue_body(self) -> None:
        if not self.lost:
            self.transport.write(_CONTINUE)

    # ---- refusing malformed input, closing

    def _refuse(self, exc: _Refuse, kind: str = "") -> None:
        log.info("malformed HTTP from %s: %s", self.remote or "unknown", kind or exc.message)
        self._input_closed = True
        self._in_head = False
        if self._current is None:
            self._write_refusal(exc)
        else:                      # answered in order, after the requests before it
            self._queue.append(exc)

    def _write_refusal(self, exc: _Refuse) -> None:
        body = error_body(exc.status, exc.message)
        # An id of its own, like every answer: the client can quote it, the log line names the peer.
        head = _head(exc.status, {"Content-Type": "application/json", "X-Request-Id": uuid.uuid4().hex},
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        self.transport.write(head + body)
        self._close(linger=True)

    def _close(self, *, linger: bool) -> None:
        """Close after what is written; lingering, the client may still send (we drop it)."""
        self._input_closed = True
        self.site.idle.pop(self, None)
        transport = self.transport
        if not linger or not transport.can_write_eof():
            transport.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        transport.write_eof()
        self._set_deadline(_LINGER, LINGER_S)

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else after the answer in progress."""
        self.closing = True
        if self._current is None and not self.lost:
            self._close(linger=self._in_head)

    # ---- the one timer

    def _set_deadline(self, kind: int, delay: float) -> None:
        if delay <= 0:
            self._deadline_kind = _NONE
            return
        when = self.loop.time() + delay
        self._deadline = when
        self._deadline_kind = kind
        timer = self._timer
        if timer is None or self._timer_at > when:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(when, self._on_timer)
            self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        kind = self._deadline_kind
        if kind == _NONE or self.lost:
            return
        if self.loop.time() + 0.001 < self._deadline:      # moved later since armed
            self._timer = self.loop.call_at(self._deadline, self._on_timer)
            self._timer_at = self._deadline
            return
        self._deadline_kind = _NONE
        if kind == _HEAD:   # part of a head arrived: say why we give up on it
            log.info("request head from %s not complete within %gs", self.remote or "unknown",
                     self.limits.header_timeout_s)
            self._in_head = False
            self._input_closed = True
            self._write_refusal(_Refuse(408, "the request head did not arrive within "
                                             f"{self.limits.header_timeout_s:g}s"))
        elif kind == _LINGER:
            self.transport.abort()
        else:               # a new connection that sent nothing, or an idle keep-alive one
            self.transport.close()


class Site:
    """A listening socket serving an ``App``; ``cleanup()`` stops it and runs the app's cleanup."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        # Connections with no request in flight, oldest idle first (dicts keep insertion order).
        self.idle: dict[HttpConnection, None] = {}
        self.per_client: dict[str, int] = {}
        self.cap = app.limits.connection_cap()
        self.cap_per_client = app.limits.max_connections_per_client
        self.shed = 0           # idle connections closed to make room (since start)
        self.refused = 0        # new connections refused: at the cap, none idle
        self._logged = (0, 0)   # (shed, refused) at the last log line
        self._log_at = 0.0
        self.server: asyncio.base_events.Server | None = None

    def admit(self, conn: HttpConnection) -> bool:
        """Count a new connection in, shedding the longest-idle one at a cap; False: refuse it."""
        remote = conn.remote
        if self.cap_per_client and self.per_client.get(remote, 0) >= self.cap_per_client:
            victim = next((c for c in self.idle if c.remote == remote), None)
            if not self._shed(victim, f"{remote} has {self.cap_per_client} connections "
                                      "(--max-connections-per-client)"):
                return False
        if len(self.connections) >= self.cap:
            victim = next(iter(self.idle), None)
            if not self._shed(victim, f"{len(self.connections)} connections open (--max-connections {self.cap})"):
                return False
        self.connections.add(conn)
        self.per_client[remote] = self.per_client.get(remote, 0) + 1
        self.idle[conn] = None
        return True

    def forget(self, conn: HttpConnection) -> None:
        """The connection is closed or closing for good: it no longer counts."""
        if conn in self.connections:
            self.connections.discard(conn)
            left = self.per_client[conn.remote] - 1
            if left:
                self.per_client[conn.remote] = left
            else:
                del self.per_client[conn.remote]
        self.idle.pop(conn, None)

    def _shed(self, victim: HttpConnection | None, why: str) -> bool:
        if victim is None:
            self.refused += 1
        else:
            self.shed += 1
            self.forget(victim)
            victim._close(linger=False)
        now = self.loop.time()
        if now >= self._log_at:     # one line per CAP_LOG_EVERY_S, with the counts since the last
            self._log_at = now + CAP_LOG_EVERY_S
            shed, refused = self.shed - self._logged[0], self.refused - self._logged[1]
            self._logged = (self.shed, self.refused)
            log.warning("connection cap: %s; closed %d idle connection(s), refused %d new one(s) with 503 "
                        "since the last such line", why, shed, refused)
        return victim is not None

    async def cleanup(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = self.loop.time() + SHUTDOWN_TIMEOUT_S
        while any(c._current is not None for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None and not conn.lost:
                conn.transport.abort()
        await self.app.cleanup()


async def serve(app: App, host: str, port: int, *, reuse_port: bool = False) -> tuple[Site, int]:
    """Run the app's startup hooks and listen on host:port; the site and the bound port.

    ``reuse_port`` (SO_REUSEPORT) lets several processes listen on one port, the kernel
    spreading new connections over them."""
    site = Site(app)
    await app.startup()
    try:
        site.server = await site.loop.create_server(lambda: HttpConnection(site), host, port, reuse_address=True,
                                                    reuse_port=reuse_port or None, backlog=1024)
    except BaseException:
        await app.cleanup()   # a failed bind leaves nothing behind (client sessions...)
        raise
    sockets = site.server.sockets
    return site, (sockets[0].getsockname()[1] if sockets else port)
