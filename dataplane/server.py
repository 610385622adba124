"""The data plane's HTTP connections: slow clients cut off, protocol errors as OpenAI JSON.

aiohttp keeps a connection whose request head never finishes open for its keep-alive
default (3,630 s): ~20,000 half-sent requests exhausted the data plane's descriptors.
aiohttp has no header timeout of its own, so ``GuardedRequestHandler`` adds one: from
a connection's start, or from the first byte of a request after an idle keep-alive
period, the whole head must arrive within ``header_timeout_s``, however slowly it
trickles. The body has its own deadline, enforced where it is read
(``dataplane.intake``); idle keep-alive connections close after ``keepalive_timeout_s``.

Malformed HTTP (a bad request line, a header over the size limit) is answered by aiohttp
itself, before any route runs, as ``text/plain`` with the offending input in the text.
The handler answers it as an OpenAI-style error instead, naming what was wrong but never
repeating what the client sent.

The handler class is installed on the app (``guard``), not on a runner, so every way of
starting a data plane (``omni-proxy dataplane``, ``omni-proxy up``, tests) gets it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from dataplane.errors import error_body

log = logging.getLogger(__name__)


@dataclass
class ClientLimits:
    header_timeout_s: float = 30.0      # request line + headers, from the first byte (0 = off)
    body_timeout_s: float = 60.0        # the whole body, from the end of the headers (0 = off)
    keepalive_timeout_s: float = 75.0   # an idle keep-alive connection is closed after this
    max_header_bytes: int = 8190        # longest request line, and longest header field
    max_headers: int = 100

    def handler_args(self) -> dict[str, Any]:
        """aiohttp RequestHandler settings; decompression is ours (``dataplane.intake``)."""
        args: dict[str, Any] = {"keepalive_timeout": self.keepalive_timeout_s,
                                "max_line_size": self.max_header_bytes,
                                "max_field_size": self.max_header_bytes,
                                "auto_decompress": False}
        if "max_headers" in inspect.signature(RequestHandler.__init__).parameters:
            args["max_headers"] = self.max_headers
        return args


_PROTOCOL_MESSAGES = {
    http_exceptions.LineTooLong: (431, "a request line or header field is over the size limit"),
    http_exceptions.BadStatusLine: (400, "malformed HTTP request line"),
    http_exceptions.InvalidHeader: (400, "malformed HTTP header"),
    http_exceptions.BadHttpMethod: (400, "malformed HTTP method"),
}


def protocol_error(status: int, exc: BaseException | None) -> tuple[int, str]:
    """The status and a fixed message for an error aiohttp raised before routing."""
    if status >= 500:
        return status, "internal error in the data plane; see its log"
    for kind, answer in _PROTOCOL_MESSAGES.items():
        if isinstance(exc, kind):
            return answer
    if isinstance(exc, http_exceptions.HttpProcessingError) and "header" in str(exc).lower() \
            and "too many" in str(exc).lower():
        return 431, "too many request header fields"
    return status, "malformed HTTP request"


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler, with a request-head deadline and JSON protocol errors."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_started = False      # some bytes of the awaited head have arrived

    def _awaiting_head(self) -> bool:
        """No request is being handled and no complete request head is parsed yet.

        (Not judged by the handler loop's waiter: the first bytes of a connection can
        arrive before that loop has started and set it.)
        """
        return not self._messages and not self._request_in_progress

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None and self._header_timeout_s > 0:
            self._head_deadline = self._loop.call_later(self._header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()       # a connection that never sends a whole head

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Body bytes arrive while a handler runs (no waiter): only the head is timed here.
        if self._awaiting_head():
            self._head_started = True
            self._arm_head_deadline()
        else:
            self._head_started = False
            self._disarm_head_deadline()

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        waiter = self._waiter
        if self._messages or self._request_in_progress or (waiter is not None and waiter.done()):
            return      # a whole head arrived: the request is the body deadline's business
        transport = self.transport
        # A client that sent part of a head hears why; one that sent nothing (an idle
        # pre-opened connection) is closed silently, as it has no request to answer.
        if self._head_started and transport is not None and not transport.is_closing():
            body = error_body(408, f"the request head did not arrive within {self._header_timeout_s:g}s")
            transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        self.force_close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:   # malformed input from one client: one line, no traceback, no client bytes
            log.info("malformed HTTP from %s: %s", request.remote, type(exc).__name__ if exc else status)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        status, text = protocol_error(status, exc)
        resp = web.Response(status=status, body=error_body(status, text), content_type="application/json")
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's Server, making ``GuardedRequestHandler`` connections."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s, **self._kwargs)


def guard(app: web.Application, limits: ClientLimits) -> None:
    """Make ``app``'s server use guarded connections, whatever runner starts it.

    aiohttp builds a connection's handler in ``Server.__call__`` and the Server in the
    app's ``_make_handler``; there is no public way to choose the handler class, so the
    app's factory is wrapped here (once, before any runner sets the app up).
    """
    make_plain = app._make_handler

    def make_guarded(*, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> web.Server:
        plain = make_plain(loop=loop, **kwargs)
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                             header_timeout_s=limits.header_timeout_s, **plain._kwargs)

    app._make_handler = make_guarded  # type: ignore[method-assign]
