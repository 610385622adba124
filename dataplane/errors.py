"""OpenAI-style error bodies, so every client library shows the message it was given.

``{"error": {"message", "type", "param", "code"}}`` with one vocabulary of ``type``,
OpenAI's: ``invalid_request_error`` (any other 4xx: a bad body, header or method, a body
too large or too late), ``authentication_error`` (401), ``permission_error`` (403),
``not_found_error`` (404), ``rate_limit_error`` (429), and ``server_error`` for every 5xx
(the engines failed, none is up, no control plane answers). ``code`` is the HTTP status,
as vLLM sends it.
"""

from __future__ import annotations

import orjson

from dataplane.messages import Response

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}
ERROR_TYPES = frozenset((INVALID_REQUEST, SERVER_ERROR, *_TYPES.values()))


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status."""
    return _TYPES.get(status) or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)


class APIError(Exception):
    """Raised anywhere in request handling; the middleware turns it into a response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str | None = None, upstream_status: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or error_type(status)
        self.upstream_status = upstream_status
        self.headers = headers      # e.g. an engine's Retry-After, passed on to the client

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, type_=self.type,
                          upstream_status=self.upstream_status)


def error_body(status: int, message: str, *, param: str | None = None, type_: str | None = None,
               upstream_status: int | None = None) -> bytes:
    error = {"message": message, "type": type_ or error_type(status), "param": param,
             "code": status}
    if upstream_status is not None:
        error["upstream_status"] = upstream_status
    return orjson.dumps({"error": error})


def error_response(status: int, message: str, *, headers: dict[str, str] | None = None,
                   **kw) -> Response:
    return Response(status=status, body=error_body(status, message, **kw),
                    content_type="application/json", headers=headers)


def sse_error_event(status: int, message: str) -> bytes:
    """What a stream carries when it breaks after the first byte (vLLM does the same)."""
    return b"data: " + error_body(status, message) + b"\n\n"
