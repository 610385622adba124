"""The simulated engine's HTTP app: vLLM's OpenAI routes plus /sim/* test and ops routes."""

from __future__ import annotations

import dataclasses
import logging
import time

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from simulator import generate
from simulator.config import SimConfig
from simulator.context import SIM, SimContext
from simulator.generate import error_response, json_response

log = logging.getLogger(__name__)

SIM_VERSION = "0.11.0+sim"  # what GET /version reports; shaped like a vLLM version
_STARTED = int(time.time())


def build_app(cfg: SimConfig) -> web.Application:
    """An app that owns one engine; the engine loop runs while the app is started."""
    ctx = SimContext.create(cfg)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM] = ctx
    app.router.add_post("/v1/completions", generate.completions)
    app.router.add_post("/v1/chat/completions", generate.chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/requests", get_requests)
    app.router.add_delete("/sim/requests", clear_requests)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_get("/sim/state", state)
    app.router.add_post("/sim/kv/pull", kv_pull)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app


async def _on_startup(app: web.Application) -> None:
    ctx = app[SIM]
    ctx.engine.start()
    ctx.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))


async def _on_shutdown(app: web.Application) -> None:
    # Ends open streams now instead of letting shutdown wait them out.
    app[SIM].engine.abort_all()


async def _on_cleanup(app: web.Application) -> None:
    ctx = app[SIM]
    ctx.leases.clear()
    await ctx.engine.stop()
    if ctx.http is not None:
        await ctx.http.close()


async def serve(cfg: SimConfig, ready_file: str | None) -> None:
    """Run one sim until SIGINT/SIGTERM; announce the bound port through the ready file."""
    from omni_proxy.runtime import start_http_site, wait_for_stop_signal, write_ready_file

    app = build_app(cfg)
    runner, port = await start_http_site(app, cfg.host, cfg.port)
    ctx = app[SIM]
    ctx.port = port
    log.info("sim %s (role=%s, engine_id=%s) serving %s on %s:%d", cfg.model, cfg.role, cfg.engine_id,
             cfg.model, cfg.host, port)
    write_ready_file(ready_file, port=port, model=cfg.model, role=cfg.role, engine_id=cfg.engine_id)
    try:
        await wait_for_stop_signal()
    finally:
        ctx.engine.abort_all()
        await runner.cleanup()


# ---- vLLM info routes ----------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    ctx = request.app[SIM]
    if not ctx.faults.healthy or ctx.engine.dead:
        return web.Response(status=503)
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    cfg = request.app[SIM].cfg
    return json_response({"object": "list", "data": [{
        "id": cfg.model, "object": "model", "created": _STARTED, "owned_by": "vllm", "root": cfg.model,
        "parent": None, "max_model_len": cfg.max_model_len}]})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": SIM_VERSION})


async def load(request: web.Request) -> web.Response:
    engine = request.app[SIM].engine
    return json_response({"server_load": engine.num_running + engine.num_waiting})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[SIM].metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


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
    return json_response(faults.snapshot())


async def state(request: web.Request) -> web.Response:
    return json_response(state_snapshot(request.app[SIM]))


def state_snapshot(ctx: SimContext) -> dict:
    """Flat counters tests and capacity planning read; totals only ever grow."""
    e, t = ctx.engine, ctx.engine.totals
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
        "requests_total": t.requests,
        "finished": dict(t.finished),
        "prompt_tokens_total": t.prompt_tokens,
        "prompt_tokens_local": t.prompt_tokens_local,
        "prompt_tokens_external": t.prompt_tokens_external,
        "generation_tokens_total": t.generation_tokens,
        "preemptions_total": t.preemptions,
        "steps_total": t.steps,
        "busy_s": round(t.busy_s, 6),
        "faults": ctx.faults.snapshot(),
        "config": dataclasses.asdict(ctx.cfg),
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

