"""The simulated engine's HTTP app: vLLM's OpenAI routes (and its dev route
``/reset_prefix_cache``) plus /sim/* test and ops routes."""

from __future__ import annotations

import dataclasses
import logging
import time

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from simulator import generate, pooling
from simulator.bootstrap import room_key
from simulator.config import SimConfig
from simulator.context import SIM, SimContext
from simulator.generate import error_response, json_response

log = logging.getLogger(__name__)

SIM_VERSION = "0.11.0+sim"  # what GET /version reports; shaped like a vLLM version
_STARTED = int(time.time())


def build_app(cfg: SimConfig) -> web.Application:
    """An app that owns one engine; the engine loop runs while the app is started."""
    ctx = SimContext.create(cfg)
    app = web.Application(client_max_size=256 * 1024 * 1024,
                          middlewares=[_require_api_key(cfg.api_key)] if cfg.api_key else [])
    app[SIM] = ctx
    app.router.add_post("/v1/completions", generate.completions)
    app.router.add_post("/v1/chat/completions", generate.chat_completions)
    pooling.add_routes(app)      # /v1/embeddings, /v1/rerank, /v1/responses: minimal answers
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/sim/requests", get_requests)
    app.router.add_delete("/sim/requests", clear_requests)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_get("/sim/state", state)
    app.router.add_post("/sim/kv/pull", kv_pull)
    app.router.add_post("/sim/kv/push", kv_push)
    app.router.add_post("/sim/bootstrap/pull", bootstrap_pull)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app


def _require_api_key(key: str):
    """vLLM's --api-key: /v1/* needs the Bearer token; /health, /metrics and the rest do not."""
    expected = f"Bearer {key}"

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1/") and request.headers.get("Authorization", "") != expected:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


async def _on_startup(app: web.Application) -> None:
    ctx = app[SIM]
    ctx.start_kv_events()
    ctx.start_engines()
    ctx.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))


async def _on_shutdown(app: web.Application) -> None:
    # Ends open streams and KV-transfer waits now instead of letting shutdown wait them out.
    for engine in app[SIM].engines:
        engine.abort_all()
    app[SIM].cancel_kv_waits()


async def _on_cleanup(app: web.Application) -> None:
    ctx = app[SIM]
    ctx.leases.clear()
    await ctx.stop_engines()
    await ctx.stop_kv_events()
    if ctx.http is not None:
        await ctx.http.close()


async def serve(cfg: SimConfig, ready_file: str | None) -> None:
    """Run one sim until SIGINT/SIGTERM; announce the bound port through the ready file."""
    from omni_runtime import start_http_site, wait_for_stop_signal, write_ready_file

    app = build_app(cfg)
    runner, port = await start_http_site(app, cfg.host, cfg.port)
    ctx = app[SIM]
    ctx.port = port
    if cfg.bootstrap_port and cfg.bootstrap_port != port:
        # A separate bootstrap port serves the same app (a proxy only calls /sim/bootstrap/pull there).
        await web.TCPSite(runner, cfg.host, cfg.bootstrap_port, reuse_address=True).start()
    log.info("sim %s (role=%s, engine_id=%s) serving %s on %s:%d (bootstrap port %d)", cfg.model, cfg.role,
             cfg.engine_id, cfg.model, cfg.host, port, ctx.bootstrap_port)
    write_ready_file(ready_file, port=port, bootstrap_port=ctx.bootstrap_port, model=cfg.model, role=cfg.role,
                     engine_id=cfg.engine_id, **kv_events_info(ctx))
    try:
        await wait_for_stop_signal()
    finally:
        for engine in ctx.engines:
            engine.abort_all()
        ctx.cancel_kv_waits()
        await runner.cleanup()


# ---- vLLM info routes ----------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    ctx = request.app[SIM]
    if not ctx.faults.healthy or any(e.dead for e in ctx.engines):
        return web.Response(status=503)
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    cfg = request.app[SIM].cfg
    # vLLM's list: the base model, then each LoRA adapter with its base as parent and its path as root.
    return json_response({"object": "list", "data": [{
        "id": cfg.model, "object": "model", "created": _STARTED, "owned_by": "vllm", "root": cfg.model,
        "parent": None, "max_model_len": cfg.max_model_len}] + [{
        "id": name, "object": "model", "created": _STARTED, "owned_by": "vllm", "root": path,
        "parent": cfg.model, "max_model_len": cfg.max_model_len} for name, path in cfg.lora_modules]})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": SIM_VERSION})


async def load(request: web.Request) -> web.Response:
    engines = request.app[SIM].engines
    return json_response({"server_load": sum(e.num_running + e.num_waiting for e in engines)})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[SIM].metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's (dev-mode) route: ``{"success": false}`` while blocks are in use, unless
    ``?reset_running_requests=true`` preempts the running requests first."""
    flag = request.query.get("reset_running_requests", "false").lower() in ("1", "true", "yes")
    ok = all([e.reset_prefix_cache(reset_running_requests=flag) for e in request.app[SIM].engines])
    return json_response({"success": ok})


# ---- /sim/* ----------------------------------------------------------------------------

async def get_requests(request: web.Request) -> web.Response:
    return json_response({"requests": request.app[SIM].log.snapshot()})


async def clear_requests(request: web.Request) -> web.Response:
    request.app[SIM].log.clear()
    return json_response({"requests": []})


async def get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[SIM].faults.snapshot())


async def set_faults(request: web.Request) -> web.Response:
    faults = request.app[SIM].faults
    try:
        faults.apply(orjson.loads(await request.read()))
    except (orjson.JSONDecodeError, ValueError) as exc:
        return error_response(400, f"bad fault spec: {exc}")
    for engine in request.app[SIM].engines:
        engine.slowdown = faults.slowdown
    return json_response(faults.snapshot())


async def state(request: web.Request) -> web.Response:
    return json_response(state_snapshot(request.app[SIM]))


def kv_events_info(ctx: SimContext) -> dict:
    """Where the KV event publisher is (resolved ports when ``tcp://*:0`` was asked for)."""
    pub = ctx.kv_events
    if pub is None:
        return {"kv_events_endpoint": None, "kv_events_port": None, "kv_replay_endpoint": None,
                "kv_replay_port": None}
    return {"kv_events_endpoint": pub.endpoint, "kv_events_port": pub.port,
            "kv_replay_endpoint": pub.replay_endpoint, "kv_replay_port": pub.replay_port}


def state_snapshot(ctx: SimContext) -> dict:
    """Flat counters tests and capacity planning read; totals only ever grow."""
    e, t = ctx.engine, ctx.engine.totals
    rooms, lw = ctx.rooms, ctx.pushes.counters
    pool = e.pool.counters
    return {
        "engine_id": ctx.cfg.engine_id,
        "role": ctx.cfg.role,
        "model": ctx.cfg.model,
        "port": ctx.port,
        "running": e.num_running,
        "waiting": e.num_waiting,
        "waiting_for_remote_kv": e.num_waiting_for_remote_kv,
        "kv_cache_usage": e.kv_cache_usage,
        "used_blocks": e.used_blocks,
        "num_gpu_blocks": ctx.cfg.num_gpu_blocks,
        "kv_leases": len(ctx.leases),
        "kv_lease_ids": ctx.leases.ids(),
        "kv_leased_blocks": e.held_blocks,
        "kv_leases_created": ctx.leases.counters.created,
        "kv_leases_pulled": ctx.leases.counters.pulled,
        "kv_leases_expired": ctx.leases.counters.expired,
        "kv_pulls_ok": ctx.pulls.ok,
        "kv_pulls_failed": ctx.pulls.failed,
        # Parallel / bootstrap flow (SGLang rooms, vLLM MooncakeConnector).
        "bootstrap_port": ctx.bootstrap_port,
        "bootstrap_rooms_waiting": rooms.holds_waiting,
        "bootstrap_room_ids": rooms.offered(),
        "bootstrap_pulls_waiting": rooms.pulls_waiting,
        "bootstrap_transfers": rooms.counters.transfers,
        "bootstrap_timeouts": rooms.counters.timeouts,
        "bootstrap_pull_timeouts": rooms.counters.pull_timeouts,
        "bootstrap_fetches_ok": rooms.counters.pulls_ok,
        "bootstrap_fetches_failed": rooms.counters.pulls_failed,
        # Layerwise push flow (vllm-ascend MooncakeLayerwiseConnector).
        "kv_push_waits": len(ctx.pushes),
        "metaserver_calls_ok": lw.metaserver_calls_ok,
        "metaserver_calls_failed": lw.metaserver_calls_failed,
        "kv_pushes_received": lw.pushes_received,
        "kv_pushes_rejected": lw.pushes_rejected,
        "kv_pushes_sent": lw.pushes_sent,
        "kv_pushes_failed": lw.pushes_failed,
        "requests_total": t.requests,
        "finished": dict(t.finished),
        "prompt_tokens_total": t.prompt_tokens,
        "prompt_tokens_local": t.prompt_tokens_local,
        "prompt_tokens_cached": t.prompt_tokens_cached,
        "prompt_tokens_external": t.prompt_tokens_external,
        # Prefix cache (vLLM's counters, in tokens) and the block pool.
        "prefix_cache_queries_tokens": t.prefix_cache_queries,
        "prefix_cache_hits_tokens": t.prefix_cache_hits,
        "cached_blocks": e.pool.num_cached,
        "free_blocks": e.pool.num_free,
        "stored_blocks": pool.stored_blocks,
        "evicted_blocks": pool.evicted_blocks,
        "prefix_cache_resets": pool.resets,
        # KV events publisher.
        **kv_events_info(ctx),
        "kv_events_batches": ctx.kv_events.batches_published if ctx.kv_events else 0,
        "kv_events_published": ctx.kv_events.events_published if ctx.kv_events else 0,
        "kv_events_replays": ctx.kv_events.replays_served if ctx.kv_events else 0,
        # API-server tokenization cost model (text prompts only).
        "tokenize_busy_s": round(ctx.tokenizer.busy_s, 9),
        "tokenized_chars": ctx.tokenizer.chars,
        "tokenized_prompts": ctx.tokenizer.prompts,
        "generation_tokens_total": t.generation_tokens,
        "preemptions_total": t.preemptions,
        "steps_total": t.steps,
        "busy_s": round(t.busy_s, 6),
        "faults": ctx.faults.snapshot(),
        "config": dataclasses.asdict(ctx.cfg),
        # Data parallelism: the top-level engine figures above are rank 0's; each rank's here.
        "dp_ranks": [{"rank": r, "running": e.num_running, "waiting": e.num_waiting,
                      "requests_total": e.totals.requests, "used_blocks": e.used_blocks,
                      "prefix_cache_hits_tokens": e.totals.prefix_cache_hits,
                      "kv_events_port": (ctx.kv_events.port if r == 0 else ctx.rank_publishers[r - 1].port)
                      if ctx.kv_events and r <= len(ctx.rank_publishers) else None}
                     for r, e in enumerate(ctx.engines)],
        # The DP barrier's cost (None without one): steps, mixed steps, rank-seconds held.
        "dp_barrier": ctx.group.stats.snapshot() if ctx.group is not None else None,
    }


async def kv_pull(request: web.Request) -> web.Response:
    """A decode node takes the KV this prefill node leased for one request."""
    ctx = request.app[SIM]
    try:
        body = orjson.loads(await request.read())
        rid, engine_id = body["remote_request_id"], body["remote_engine_id"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return error_response(400, f"bad pull request: {exc!r}")
    if engine_id != ctx.cfg.engine_id:
        return error_response(404, f"engine {engine_id!r} is not this engine ({ctx.cfg.engine_id!r})")
    lease = ctx.leases.take(rid)
    if lease is None:
        return error_response(404, f"no KV held for {rid!r} (never leased, already pulled or expired)")
    return json_response({"remote_request_id": rid, "num_tokens": lease.num_tokens,
                          "num_blocks": len(lease.block_ids)})



async def kv_push(request: web.Request) -> web.Response:
    """Layerwise flow: a prefill node pushes a prompt's KV into this decode node."""
    ctx = request.app[SIM]
    try:
        body = orjson.loads(await request.read())
        rid, engine_id, num_tokens = body["request_id"], body["remote_engine_id"], body["num_tokens"]
        if not isinstance(rid, str) or type(num_tokens) is not int or num_tokens < 0:
            raise TypeError("request_id must be a string and num_tokens a non-negative int")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return error_response(400, f"bad push request: {exc!r}")
    if engine_id != ctx.cfg.engine_id:
        ctx.pushes.counters.pushes_rejected += 1
        return error_response(404, f"engine {engine_id!r} is not this engine ({ctx.cfg.engine_id!r})")
    status, message = ctx.pushes.deliver(rid, num_tokens)
    if status != 200:
        return error_response(status, message)
    return json_response({"request_id": rid, "num_tokens": num_tokens})


async def bootstrap_pull(request: web.Request) -> web.Response:
    """Bootstrap flow: a decode node long-polls for a room's KV (taking it frees the blocks here).

    Body ``{"room": R, "timeout_s"?: float}``; waits at most min(timeout_s, --bootstrap-timeout-s)
    for the room to be offered, then answers 404.
    """
    ctx = request.app[SIM]
    try:
        body = orjson.loads(await request.read())
        room = body["room"]
        timeout = body.get("timeout_s", ctx.cfg.bootstrap_timeout_s)
        if room is None or isinstance(room, (bool, dict, list)):
            raise TypeError("room must be an int or a string")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise TypeError("timeout_s must be a non-negative number")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        return error_response(400, f"bad bootstrap pull request: {exc!r}")
    timeout = min(float(timeout), ctx.cfg.bootstrap_timeout_s)
    with ctx.kv_wait():
        offer = await ctx.rooms.take(room_key(room), timeout)
    if offer is None:
        return error_response(404, f"no KV offered for bootstrap room {room!r} within {timeout:g}s")
    return json_response({"room": room, "engine_id": ctx.cfg.engine_id, "num_tokens": offer.num_tokens,
                          "num_blocks": len(offer.block_ids)})
