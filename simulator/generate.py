"""The /v1/completions and /v1/chat/completions handlers.

A handler validates, applies injected faults, settles the request's KV-transfer role,
then hands the sequence to the engine and relays its tokens. Whatever way the handler
ends (client gone, server stopping, bug), ``finally`` aborts the sequence in the engine,
so a disconnect frees its batch slot and KV blocks the way vLLM's ``with_cancellation`` does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from simulator.bootstrap import BootstrapSource, RoomHold, fetch_room
from simulator.context import SIM, SimContext
from simulator.engine import HeldKv, SimRequest
from simulator.kv_transfer import KvPlan, plan_kv, producer_params, pull_kv
from simulator.layerwise import PushTarget, call_metaserver, push_kv
from simulator.parsing import ParsedRequest, parse_request
from simulator.protocol import (SSE_DONE, ApiError, Kind, KvTransferError, ResponseHead, StreamFormatter,
                                error_body, response_body, usage)
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
    bad_json: orjson.JSONDecodeError | None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        body, bad_json = None, exc
    else:
        bad_json = None
    base_id = _base_request_id(request, body)
    headers = {"X-Request-Id": base_id}
    try:
        rank = ctx.pick_rank(request.headers, body)
    except ValueError as exc:
        rank, bad_rank = 0, str(exc)
    else:
        bad_rank = ""
    ctx.log.record(request.path, base_id, body, request.headers, dp_rank=rank)
    if bad_json is not None:
        return error_response(400, f"Invalid JSON body: {bad_json}", headers=headers)
    if bad_rank:
        return error_response(400, bad_rank, headers=headers)
    ctx = ctx.for_rank(rank)
    try:
        parsed = parse_request(kind, body, ctx.cfg)
    except ApiError as exc:
        return web.Response(body=exc.body(), status=exc.status, content_type="application/json",
                            headers=headers)
    if parsed.text_chars:
        # The API server tokenizes text prompts before the engine sees them (token ids skip it).
        await ctx.tokenizer.tokenize(parsed.text_chars)

    delay = ctx.faults.take_delay()
    if delay:
        await asyncio.sleep(delay)
    fault = ctx.faults.take_error()
    if fault is not None:
        return error_response(fault[0], fault[1], headers={**headers, **fault[2]})

    response_id = f"cmpl-{base_id}" if kind == "completion" else f"chatcmpl-{base_id}"
    engine_id = f"{response_id}-0" if kind == "completion" else response_id  # vLLM's internal ids
    try:
        kv = plan_kv(ctx.cfg.role, parsed.kv_transfer_params, engine_id, body, base_id)
    except ApiError as exc:
        return web.Response(body=exc.body(), status=exc.status, content_type="application/json",
                            headers=headers)
    if kv.produce and ctx.faults.take_omit_kv():
        kv = KvPlan()
        produce_omitted = True
    else:
        produce_omitted = False
    room_hold: RoomHold | None = None
    hold_kv: Callable[[SimRequest, HeldKv], None] | None = None
    if kv.produce:
        hold_kv = functools.partial(ctx.leases.hold, room=kv.lease_room)
    elif kv.bootstrap_room is not None:
        if not ctx.rooms.claim(kv.bootstrap_room):
            return error_response(409, f"bootstrap_room {kv.bootstrap_room} is already in use on this "
                                       "prefill node", "bootstrap_room", headers=headers)
        room_hold = hold_kv = RoomHold(ctx.engine, ctx.rooms, kv.bootstrap_room)
    seed = ctx.cfg.seed if parsed.seed is None else parsed.seed
    req = SimRequest(
        request_id=engine_id,
        prompt_tokens=parsed.prompt_tokens,
        # A prefill node answers with the single token sampled at the end of prefill.
        max_tokens=1 if (kv.prefill_only or produce_omitted) else parsed.max_tokens,
        rng=initial_state(seed, parsed.prompt_fingerprint),
        arrival=arrival,
        stop_ids=stop_token_ids(parsed.stop) if parsed.stop else frozenset(),
        token_ids=parsed.token_ids,
        cache_salt=parsed.cache_salt,
        lora=parsed.lora,
        hold_kv=hold_kv,
    )
    head = ResponseHead(kind=kind, id=response_id, created=int(time.time()),
                        model=parsed.lora[0] if parsed.lora else ctx.cfg.model)
    try:
        if kv.pull is not None:
            req.external_tokens = await _receive_kv(ctx, kv, req, engine_id)
        elif kv.fetch is not None:
            with ctx.kv_wait():
                req.external_tokens = await _fetch_kv(ctx, kv.fetch, req)
        elif kv.metaserver is not None:
            with ctx.kv_wait():
                req.external_tokens = await _receive_pushed_kv(ctx, kv.metaserver, parsed, engine_id)
        ctx.engine.submit(req)
        if room_hold is not None or kv.push:
            # These prefill nodes hand the KV over before answering their own client.
            await req.finished.wait()
            if req.finish_reason == "abort":
                return error_response(503, "The request was aborted: the engine is shutting down.",
                                      headers=headers)
            if room_hold is not None:
                with ctx.kv_wait():
                    came = await room_hold.wait_for_peer(ctx.cfg.bootstrap_timeout_s)
                if not came:
                    return error_response(500, f"bootstrap peer never came: no decode node fetched "
                                               f"bootstrap_room {room_hold.room} within "
                                               f"{ctx.cfg.bootstrap_timeout_s:g}s", headers=headers)
            if kv.push:
                await _push_kv(ctx, kv.push, req)
        if parsed.stream:
            return await _stream(request, ctx, req, parsed, head, kv, headers)
        await req.finished.wait()
        if req.finish_reason == "abort":
            return error_response(503, "The request was aborted: the engine is shutting down.",
                                  headers=headers)
        resp = json_response(_final_body(ctx, req, parsed, head, kv), headers=headers)
        if ctx.faults.take_compress():
            resp.enable_compression()   # like an engine behind a compressing proxy: per Accept-Encoding
        return resp
    except KvTransferError as exc:
        log.warning("request %s failed: %s", engine_id, exc)
        return error_response(500, str(exc), headers=headers)
    finally:
        if not req.done:
            ctx.engine.abort(req)
        if room_hold is not None:
            room_hold.close()


def _base_request_id(request: web.Request, body: Any) -> str:
    """vLLM's order: the X-Request-Id header, else the body's request_id, else a fresh uuid."""
    header = request.headers.get("X-Request-Id")
    if header:
        return header
    if isinstance(body, dict) and isinstance(body.get("request_id"), str) and body["request_id"]:
        return body["request_id"]
    return uuid.uuid4().hex


async def _receive_kv(ctx: SimContext, kv: KvPlan, req: SimRequest, request_id: str) -> int:
    """Pull the prompt's KV from the prefill node and pay the transfer time; 0 = recompute."""
    assert kv.pull is not None and ctx.http is not None
    with ctx.engine.remote_kv_wait():
        held = await pull_kv(ctx.http, kv.pull, request_id)
        if held is None:
            ctx.pulls.failed += 1
            return 0
        ctx.pulls.ok += 1
        tokens = min(held, req.prompt_tokens)
        await _pay_transfer(ctx, req, tokens)
        return tokens


async def _pay_transfer(ctx: SimContext, req: SimRequest, tokens: int) -> None:
    """Transfer time for the received tokens this node's prefix cache does not already hold
    (vLLM's decode side asks the connector only for what its local lookup missed)."""
    tokens -= min(tokens, ctx.engine.cached_prefix_tokens(req))
    transfer_s = ctx.cfg.kv_transfer_ms_per_token * tokens / 1000.0
    if transfer_s > 0:
        await asyncio.sleep(transfer_s)


async def _fetch_kv(ctx: SimContext, src: BootstrapSource, req: SimRequest) -> int:
    """Bootstrap flow, decode side: long-poll P for the room's KV; KvTransferError if it fails."""
    assert ctx.http is not None
    with ctx.engine.remote_kv_wait():
        try:
            held = await fetch_room(ctx.http, src, ctx.cfg.bootstrap_timeout_s)
        except KvTransferError:
            ctx.rooms.counters.pulls_failed += 1
            raise
        ctx.rooms.counters.pulls_ok += 1
        tokens = min(held, req.prompt_tokens)
        await _pay_transfer(ctx, req, tokens)
        return tokens


async def _receive_pushed_kv(ctx: SimContext, url: str, parsed: ParsedRequest, request_id: str) -> int:
    """Layerwise flow, decode side: post our receive ticket to the metaserver, then wait until
    the metaserver answered ok and P's push arrived. KvTransferError otherwise, never a hang."""
    assert ctx.http is not None
    cfg = ctx.cfg
    wait = ctx.pushes.expect(request_id)
    if wait is None:
        raise KvTransferError(f"a request with id {request_id!r} is already waiting for pushed KV here")
    ticket = {
        "token_ids": [],
        "request_id": request_id,
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": ctx.engine.block_ids(math.ceil(parsed.prompt_tokens / cfg.block_size)),
        "remote_block_size": cfg.block_size,
        "remote_engine_id": cfg.engine_id,
        "remote_host": cfg.advertised_host,
        "remote_port": ctx.port,
        "remote_tp_size": 1,
        "remote_pcp_size": 1,
        "remote_dcp_size": 1,
        "remote_cached_tokens": 0,
    }
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.metaserver_timeout_s
    try:
        with ctx.engine.remote_kv_wait():
            try:
                await call_metaserver(ctx.http, url, ticket, cfg.metaserver_timeout_s)
            except KvTransferError:
                ctx.pushes.counters.metaserver_calls_failed += 1
                raise
            ctx.pushes.counters.metaserver_calls_ok += 1
            if wait.num_tokens is None:
                try:
                    await asyncio.wait_for(wait.arrived.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise KvTransferError(f"metaserver {url} answered ok but no KV was pushed for "
                                          f"{request_id!r}") from None
            assert wait.num_tokens is not None
            return min(wait.num_tokens, parsed.prompt_tokens)
    finally:
        ctx.pushes.forget(wait)


async def _push_kv(ctx: SimContext, targets: tuple[PushTarget, ...], req: SimRequest) -> None:
    """Layerwise flow, prefill side: push the prompt's KV into each decode ticket."""
    assert ctx.http is not None
    for target in targets:
        try:
            await push_kv(ctx.http, target, req.prompt_tokens)
        except KvTransferError:
            ctx.pushes.counters.pushes_failed += 1
            raise
        ctx.pushes.counters.pushes_sent += 1


def _text_tokens(req: SimRequest) -> list[int]:
    """Output tokens whose text is returned: a matched stop word is not, as in vLLM."""
    return req.output[:-1] if req.finish_reason == "stop" else req.output


def _kv_params(ctx: SimContext, req: SimRequest, kv: KvPlan) -> dict[str, Any] | None:
    if not kv.produce:
        return None
    lease = ctx.leases.get(req.request_id)
    return producer_params(ctx.cfg, ctx.port, lease) if lease is not None else None


def _usage(ctx: SimContext, req: SimRequest, parsed: ParsedRequest, completion_tokens: int) -> dict[str, Any]:
    """OpenAI usage; prompt_tokens_details.cached_tokens is vLLM's num_cached_tokens (local
    prefix-cache hits plus received KV), or on a decode node the prefill node's hits when its
    ticket carries remote_prefill_cached_tokens, as vLLM reports them."""
    cached = None
    if ctx.cfg.enable_prompt_tokens_details:
        cached = req.cached_tokens
        params = parsed.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            remote = params.get("remote_prefill_cached_tokens")
            if type(remote) is int:
                cached = remote
    return usage(parsed.prompt_tokens, completion_tokens, cached)


def _final_body(ctx: SimContext, req: SimRequest, parsed: ParsedRequest, head: ResponseHead,
                kv: KvPlan) -> dict[str, Any]:
    return response_body(head, detokenize(_text_tokens(req)), req.finish_reason, req.stop_reason,
                         _usage(ctx, req, parsed, len(req.output)), _kv_params(ctx, req, kv))


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
                    parts.append(fmt.usage(_usage(ctx, req, parsed, n)))
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
