"""The /v1/completions and /v1/chat/completions handlers.

A handler validates, applies injected faults, settles the request's KV-transfer role,
then hands the sequence to the engine and relays its tokens. Whatever way the handler
ends (client gone, server stopping, bug), ``finally`` aborts the sequence in the engine,
so a disconnect frees its batch slot and KV blocks the way vLLM's ``with_cancellation`` does.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from simulator.context import SIM, SimContext
from simulator.engine import SimRequest
from simulator.kv_transfer import KvPlan, plan_kv, producer_params, pull_kv
from simulator.parsing import ParsedRequest, parse_request
from simulator.protocol import (SSE_DONE, ApiError, Kind, ResponseHead, StreamFormatter, error_body,
                                response_body, usage)
from simulator.tokens import VOCAB_JSON, detokenize, initial_state, stop_token_ids

log = logging.getLogger(__name__)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json",
                        headers=headers)


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=error_body(status, message, param), status=status,
                        content_type="application/json", headers=headers)


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    ctx = request.app[SIM]
    loop = asyncio.get_running_loop()
    arrival = loop.time()
    if not ctx.port:  # app served without serve(): learn our port for kv_transfer_params
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        ctx.port = sockname[1] if sockname else 0
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        body, bad_json = None, exc
    else:
        bad_json = None
    base_id = _base_request_id(request, body)
    headers = {"X-Request-Id": base_id}
    ctx.log.record(request.path, base_id, body)
    if bad_json is not None:
        return error_response(400, f"Invalid JSON body: {bad_json}", headers=headers)
    try:
        parsed = parse_request(kind, body, ctx.cfg)
    except ApiError as exc:
        return web.Response(body=exc.body(), status=exc.status, content_type="application/json",
                            headers=headers)

    delay = ctx.faults.take_delay()
    if delay:
        await asyncio.sleep(delay)
    fault = ctx.faults.take_error()
    if fault is not None:
        return error_response(fault[0], fault[1], headers=headers)

    response_id = f"cmpl-{base_id}" if kind == "completion" else f"chatcmpl-{base_id}"
    engine_id = f"{response_id}-0" if kind == "completion" else response_id  # vLLM's internal ids
    kv = plan_kv(ctx.cfg.role, parsed.kv_transfer_params, engine_id)
    if kv.produce and ctx.faults.take_omit_kv():
        kv = KvPlan()
        produce_omitted = True
    else:
        produce_omitted = False
    seed = ctx.cfg.seed if parsed.seed is None else parsed.seed
    req = SimRequest(
        request_id=engine_id,
        prompt_tokens=parsed.prompt_tokens,
        # A prefill node answers with the single token sampled at the end of prefill.
        max_tokens=1 if (kv.produce or produce_omitted) else parsed.max_tokens,
        rng=initial_state(seed, parsed.prompt_fingerprint),
        arrival=arrival,
        stop_ids=stop_token_ids(parsed.stop) if parsed.stop else frozenset(),
        hold_kv=ctx.leases.hold if kv.produce else None,
    )
    head = ResponseHead(kind=kind, id=response_id, created=int(time.time()), model=ctx.cfg.model)
    try:
        if kv.pull is not None:
            req.external_tokens = await _receive_kv(ctx, kv, parsed, engine_id)
        ctx.engine.submit(req)
        if parsed.stream:
            return await _stream(request, ctx, req, parsed, head, kv, headers)
        await req.finished.wait()
        if req.finish_reason == "abort":
            return error_response(503, "The request was aborted: the engine is shutting down.",
                                  headers=headers)
        return json_response(_final_body(ctx, req, parsed, head, kv), headers=headers)
    finally:
        if not req.done:
            ctx.engine.abort(req)


def _base_request_id(request: web.Request, body: Any) -> str:
    """vLLM's order: the X-Request-Id header, else the body's request_id, else a fresh uuid."""
    header = request.headers.get("X-Request-Id")
    if header:
        return header
    if isinstance(body, dict) and isinstance(body.get("request_id"), str) and body["request_id"]:
        return body["request_id"]
    return uuid.uuid4().hex


async def _receive_kv(ctx: SimContext, kv: KvPlan, parsed: ParsedRequest, request_id: str) -> int:
    """Pull the prompt's KV from the prefill node and pay the transfer time; 0 = recompute."""
    assert kv.pull is not None and ctx.http is not None
    with ctx.engine.remote_kv_wait():
        held = await pull_kv(ctx.http, kv.pull, request_id)
        if held is None:
            ctx.pulls.failed += 1
            return 0
        ctx.pulls.ok += 1
        tokens = min(held, parsed.prompt_tokens)
        transfer_s = ctx.cfg.kv_transfer_ms_per_token * tokens / 1000.0
        if transfer_s > 0:
            await asyncio.sleep(transfer_s)
        return tokens


def _text_tokens(req: SimRequest) -> list[int]:
    """Output tokens whose text is returned: a matched stop word is not, as in vLLM."""
    return req.output[:-1] if req.finish_reason == "stop" else req.output


def _kv_params(ctx: SimContext, req: SimRequest, kv: KvPlan) -> dict[str, Any] | None:
    if not kv.produce:
        return None
    lease = ctx.leases.get(req.request_id)
    return producer_params(ctx.cfg, ctx.port, lease) if lease is not None else None


def _final_body(ctx: SimContext, req: SimRequest, parsed: ParsedRequest, head: ResponseHead,
                kv: KvPlan) -> dict[str, Any]:
    return response_body(head, detokenize(_text_tokens(req)), req.finish_reason, req.stop_reason,
                         usage(parsed.prompt_tokens, len(req.output)), _kv_params(ctx, req, kv))


async def _stream(request: web.Request, ctx: SimContext, req: SimRequest, parsed: ParsedRequest,
                  head: ResponseHead, kv: KvPlan, headers: dict[str, str]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    fmt = StreamFormatter(head)
    sent = 0
    while True:
        done = req.done
        out = req.output
        n = len(out)
        if done and req.finish_reason == "abort":  # engine shutting down: cut the stream
            return resp
        if n > sent:
            parts = [fmt.opening()] if sent == 0 else []
            if done:
                parts.extend(fmt.token(VOCAB_JSON[t]) for t in out[sent:n - 1])
                last = "" if req.finish_reason == "stop" else detokenize(out[n - 1:])
                parts.append(fmt.final(last, req.finish_reason or "length", req.stop_reason,
                                       _kv_params(ctx, req, kv)))
                if parsed.include_usage:
                    parts.append(fmt.usage(usage(parsed.prompt_tokens, n)))
                parts.append(SSE_DONE)
            else:
                parts.extend(fmt.token(VOCAB_JSON[t]) for t in out[sent:n])
            # Everything generated so far goes out now, in one write if the client lagged.
            await resp.write(b"".join(parts))
            sent = n
        if done:
            return resp
        if len(req.output) == sent:
            req.progress.clear()
            await req.progress.wait()
