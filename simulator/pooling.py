"""Minimal ``/v1/embeddings``, ``/v1/rerank`` (``/rerank``, ``/v2/rerank``) and ``/v1/responses``.

Enough of vLLM's shapes for a router's tests to be real: the request is checked (model,
the input fields), logged in ``/sim/requests`` like a generation, and answered at once with
deterministic numbers (an embedding is a function of its text). No batching, no KV cache.
``/v1/responses`` answers non-streamed only (``stream`` true is a 400).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from simulator.context import SIM
from simulator.protocol import error_body

EMBEDDING_DIM = 8


def _error(status: int, message: str, param: str | None = None, headers=None) -> web.Response:
    return web.Response(body=error_body(status, message, param), status=status, content_type="application/json",
                        headers=headers)


def _json(body: Any, headers: dict[str, str]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def _read(request: web.Request) -> tuple[dict, web.Response | None, dict[str, str]]:
    """(body, None, headers), or ({}, the error to answer, headers)."""
    ctx = request.app[SIM]
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return {}, _error(400, f"Invalid JSON body: {exc}", headers=headers), headers
    ctx.log.record(request.path, request_id, body, request.headers)
    if not isinstance(body, dict):
        return {}, _error(400, "request body must be a JSON object", headers=headers), headers
    model = body.get("model")
    if model is not None and model != ctx.cfg.model:
        return {}, _error(404, f"The model `{model}` does not exist.", "model", headers), headers
    return body, None, headers


def _vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return [round(b / 255.0, 6) for b in digest[:EMBEDDING_DIM]]


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


async def embeddings(request: web.Request) -> web.Response:
    body, err, headers = await _read(request)
    if err is not None:
        return err
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        return _error(400, "'input' must be a string or a non-empty list of strings", "input", headers)
    tokens = sum(_tokens(i) for i in inputs)
    return _json({"id": f"embd-{headers['X-Request-Id']}", "object": "list", "created": int(time.time()),
                  "model": request.app[SIM].cfg.model,
                  "data": [{"index": i, "object": "embedding", "embedding": _vector(text)}
                           for i, text in enumerate(inputs)],
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}, headers)


async def rerank(request: web.Request) -> web.Response:
    body, err, headers = await _read(request)
    if err is not None:
        return err
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        return _error(400, "'query' must be a string", "query", headers)
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        return _error(400, "'documents' must be a list of strings", "documents", headers)
    q = _vector(query)
    scored = sorted(((sum(a * b for a, b in zip(q, _vector(d), strict=False)) / EMBEDDING_DIM, i, d)
                     for i, d in enumerate(documents)), reverse=True)
    top_n = body.get("top_n") or len(documents)
    tokens = _tokens(query) + sum(_tokens(d) for d in documents)
    return _json({"id": f"rerank-{headers['X-Request-Id']}", "model": request.app[SIM].cfg.model,
                  "usage": {"total_tokens": tokens},
                  "results": [{"index": i, "document": {"text": d}, "relevance_score": round(s, 6)}
                              for s, i, d in scored[:top_n]]}, headers)


async def responses(request: web.Request) -> web.Response:
    body, err, headers = await _read(request)
    if err is not None:
        return err
    if body.get("stream"):
        return _error(400, "the simulator answers /v1/responses without streaming", "stream", headers)
    prompt = body.get("input")
    if not isinstance(prompt, (str, list)) or not prompt:
        return _error(400, "'input' must be a string or a non-empty list", "input", headers)
    text = "ok"
    in_tokens = _tokens(prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode())
    return _json({"id": f"resp_{headers['X-Request-Id']}", "object": "response", "created_at": int(time.time()),
                  "status": "completed", "model": request.app[SIM].cfg.model,
                  "output": [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                              "role": "assistant",
                              "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                  "usage": {"input_tokens": in_tokens, "output_tokens": 1, "total_tokens": in_tokens + 1}},
                 headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_post("/v1/responses", responses)
