"""The data plane's HTTP request and response objects (served by ``dataplane.server``).

Deliberately small: what the routes, middlewares and flows use and nothing else. A
``Request`` is built once its head is parsed; its body keeps arriving into it while the
handler runs, and ``read()`` waits for the rest. A handler returns a ``Response`` (status,
headers, body bytes: written with its head in one write) or a ``StreamResponse`` it has
already written to (chunked transfer encoding; the head leaves with the first chunk).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from multidict import CIMultiDict

if TYPE_CHECKING:
    from dataplane.server import HttpConnection


class BodyTooLarge(Exception):
    """The request body is over the server's limit (answered 413 by ``dataplane.intake``)."""


class PayloadError(Exception):
    """The request body's framing is broken, or the client left before sending it all."""


class Request:
    """One client request: method, path, headers, remote address, body, per-request state."""

    __slots__ = ("method", "path", "query_string", "headers", "version", "keep_alive", "remote", "_conn",
                 "_chunks", "_size", "_max_size", "complete", "_error", "_waiter", "_state", "_expect",
                 "started")

    def __init__(self, conn: HttpConnection, method: str, path: str, query_string: str,
                 headers: CIMultiDict[str], version: str, keep_alive: bool, max_size: int) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.remote = conn.remote
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._max_size = max_size
        self.complete = False                    # the whole body has arrived
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._state: dict[str, Any] | None = None
        self._expect = version == "1.1" and headers.get("Expect", "").lower() == "100-continue"
        self.started: StreamResponse | None = None   # a streamed answer already under way
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_size:
            self._error = BodyTooLarge()

    # ---- per-request state, for middlewares (e.g. ``http["request_id"]``)

    def get(self, key: str, default: Any = None) -> Any:
        state = self._state
        return default if state is None else state.get(key, default)

    def __getitem__(self, key: str) -> Any:
        if self._state is None:
            raise KeyError(key)
        return self._state[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if self._state is None:
            self._state = {}
        self._state[key] = value

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client connection's transport; None once the client is gone."""
        conn = self._conn
        return None if conn.lost else conn.transport

    # ---- the body

    async def read(self) -> bytes:
        """The whole body as sent (no decoding of Content-Encoding: ``dataplane.intake`` does it).

        Raises ``BodyTooLarge`` past the limit and ``PayloadError`` on broken framing or
        a client that left."""
        while not self.complete:
            if self._error is not None:
                raise self._error
            if self._expect:      # the client waits for our go-ahead before it sends the body
                self._expect = False
                self._conn.continue_body()
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        return self._joined()

    def body_at_hand(self) -> bytes | None:
        """The whole body when it has all arrived intact (the common case: it came with the
        head), without an await; None when ``read()`` has to wait or raise."""
        if not self.complete or self._error is not None:
            return None
        return self._joined()

    def _joined(self) -> bytes:
        """The chunks as one bytes object (joined once, then kept joined)."""
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        data = b"".join(chunks)
        self._chunks = [data]
        return data

    def feed(self, data: bytes) -> None:
        if self._error is not None:
            return                # over the limit: the rest is read and dropped
        self._size += len(data)
        if self._size > self._max_size:
            self._chunks.clear()
            self.fail(BodyTooLarge())
            return
        self._chunks.append(data)

    def end(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Response:
    """A whole answer: status, headers and body, written in one go once the handler returns."""

    __slots__ = ("status", "body", "headers", "closes")

    def __init__(self, *, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None,
                 content_type: str | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.closes = False

    @classmethod
    def owning(cls, status: int, body: bytes, headers: dict[str, str]) -> Response:
        """A response that takes ``headers`` as its own (no copy: the caller made them for it)."""
        resp = cls.__new__(cls)
        resp.status = status
        resp.body = body
        resp.headers = headers
        resp.closes = False
        return resp

    def force_close(self) -> None:
        """Close the connection after this answer (no keep-alive)."""
        self.closes = True


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status=status, body=orjson.dumps(data), headers=headers, content_type="application/json")


class StreamResponse:
    """An answer written piece by piece: ``prepare``, ``write``..., ``write_eof``.

    The head is held back until the first ``write`` (or ``write_eof``) so that it and the
    first chunk leave in one packet. ``write`` raises ``ConnectionResetError`` once the
    client is gone, and waits while the client reads slower than we write.
    """

    __slots__ = ("status", "headers", "closes", "_conn", "head", "chunked", "eof")

    def __init__(self, *, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers) if headers else {}
        self.closes = False
        self._conn: HttpConnection | None = None
        self.head = b""           # the head, until it is written with the first chunk
        self.chunked = True
        self.eof = False

    def force_close(self) -> None:
        self.closes = True

    async def prepare(self, request: Request) -> None:
        if self._conn is None:
            self._conn = request._conn
            self._conn.start_stream(request, self)

    async def write(self, data: bytes) -> None:
        if self.write_nowait(data):
            await self.drain()

    def write_nowait(self, data: bytes) -> bool:
        """``write`` without its coroutine, for the per-chunk path (a coroutine per chunk was
        ~0.35 us of each of a streamed answer's chunks): True when the client reads slower
        than we write, and the caller must ``await drain()`` before the next chunk."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("StreamResponse.write() before prepare()")
        conn.write_chunk(self, data)
        return conn.write_paused

    async def drain(self) -> None:
        """Until the client has read enough of what was written (at once when it has)."""
        conn = self._conn
        if conn is not None and conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        if not self.eof and self._conn is not None:
            self._conn.end_stream(self)


Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]
