"""vLLM OpenAI-server wire shapes: response bodies, SSE chunks and error bodies.

Everything a client of the sim sees is built here, so the shapes can be checked against
vLLM's in one place. Streaming chunks are rendered from templates built with the same
dict builders as the slow path: a token costs one bytes concatenation, which is what lets
one process feed hundreds of streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

Kind = Literal["completion", "chat"]

SSE_DONE = b"data: [DONE]\n\n"

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error answered to the client in vLLM's JSON error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


class KvTransferError(Exception):
    """A KV transfer a request depends on failed (fetch, push or metaserver); answered as a 500."""


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    err_type = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}})


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """Fields every body and chunk of one response repeats."""

    kind: Kind
    id: str
    created: int
    model: str


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """``prompt_tokens_details`` only when some prompt tokens were cached (None otherwise)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
    }


def response_body(head: ResponseHead, text: str, finish_reason: str | None, stop_reason: str | None,
                  usage_info: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """A non-streaming completion or chat completion."""
    if head.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason, "prompt_logprobs": None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
        obj = "chat.completion"
    body: dict[str, Any] = {"id": head.id, "object": obj, "created": head.created, "model": head.model,
                            "choices": [choice], "usage": usage_info}
    if head.kind == "chat":
        body["prompt_logprobs"] = None
    body["kv_transfer_params"] = kv_transfer_params
    return body


def chunk_body(head: ResponseHead, text: str, finish_reason: str | None, stop_reason: str | None,
               *, role: bool = False) -> dict[str, Any]:
    """One streaming chunk carrying one token's text (or the chat role announcement)."""
    if head.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        obj = "chat.completion.chunk"
    return {"id": head.id, "object": obj, "created": head.created, "model": head.model,
            "choices": [choice]}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_MARK = "\x00sim-token\x00"
_MARK_JSON = orjson.dumps(_MARK)


class StreamFormatter:
    """Renders one response's SSE events; the per-token path is a prebuilt prefix/suffix."""

    __slots__ = ("head", "_prefix", "_suffix")

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        template = sse(chunk_body(head, _MARK, None, None))
        self._prefix, self._suffix = template.split(_MARK_JSON)

    def opening(self) -> bytes:
        """Chat streams announce the assistant role before the first token."""
        if self.head.kind == "chat":
            return sse(chunk_body(self.head, "", None, None, role=True))
        return b""

    def token(self, text_json: bytes) -> bytes:
        """An event for one token whose text is already JSON-encoded."""
        return self._prefix + text_json + self._suffix

    def final(self, text: str, finish_reason: str, stop_reason: str | None,
              kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        body = chunk_body(self.head, text, finish_reason, stop_reason)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return sse(body)

    def usage(self, usage_info: dict[str, Any]) -> bytes:
        h = self.head
        obj = "text_completion" if h.kind == "completion" else "chat.completion.chunk"
        return sse({"id": h.id, "object": obj, "created": h.created, "model": h.model,
                    "choices": [], "usage": usage_info})
