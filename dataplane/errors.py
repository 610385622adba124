"""OpenAI-style error bodies, so every client library shows the message it was given."""

from __future__ import annotations

import orjson

from dataplane.messages import Response

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
          415: "UnsupportedMediaTypeError", 429: "RateLimitError", 431: "RequestHeaderFieldsTooLargeError",
          500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
          504: "GatewayTimeoutError"}


class APIError(Exception):
    """Raised anywhere in request handling; the middleware turns it into a response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str | None = None, upstream_status: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "APIError")
        self.upstream_status = upstream_status
        self.headers = headers      # e.g. an engine's Retry-After, passed on to the client

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, type_=self.type,
                          upstream_status=self.upstream_status)


def error_body(status: int, message: str, *, param: str | None = None, type_: str | None = None,
               upstream_status: int | None = None) -> bytes:
    error = {"message": message, "type": type_ or _TYPES.get(status, "APIError"), "param": param,
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
