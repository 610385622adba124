"""Parallel PD flow (bootstrap): P and D at once, paired by a rendezvous.

SGLang: the same body goes to P and D with ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room`` (a random 63-bit room per prompt); D pre-allocates its KV and P sends
into it. vLLM's MooncakeConnector variant pairs them by the shared X-Request-Id, with
``bootstrap_server_host``/``_port`` in D's ``kv_transfer_params``.

The client gets D's stream. P's answer is drained in the background and releases P's
load. If either leg fails before D's first byte, the other is cancelled: a D waiting for
KV that will never come must not hang the client.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from urllib.parse import urlsplit

from dataplane.body import with_fields
from dataplane.flows.context import FlowContext
from dataplane.flows.relay import relay
from dataplane.messages import Response, StreamResponse
from dataplane.tracking import LEG_DECODE, LEG_PREFILL
from dataplane.upstream import UpstreamError, dp_rank, read_body
from engine_api.bodies import prefill_body
from engine_api.client import EngineResponse
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998   # SGLang's disaggregation_bootstrap_port default


def new_room(dp_size: int = 1, dp_rank: int = 0) -> int:
    """A random 63-bit room; with a data-parallel P, one with ``room % dp_size == dp_rank``
    (SGLang sends the prompt to P rank ``bootstrap_room % dp_size``, and D expects it there)."""
    room = secrets.randbits(63)
    if dp_size > 1:
        room -= room % dp_size - dp_rank
        if room >= 1 << 63:
            room -= dp_size
    return room


def bodies(ctx: FlowContext, prefill: pb.Endpoint, protocol: str,
           decode: pb.Endpoint | None = None) -> tuple[bytes, bytes]:
    """The (P, D) bodies for this protocol. With data-parallel workers (SGLang), each side's
    body names its rank in ``routed_dp_rank`` and the room selects P's rank."""
    req = ctx.req
    host = urlsplit(prefill.url).hostname or ""
    port = prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    if protocol == "mooncake":
        p_body = prefill_body(req.body, {"do_remote_decode": True, "do_remote_prefill": False})
        d_body = with_fields(req, {"kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True,
            "bootstrap_server_host": host, "bootstrap_server_port": port}})
        return p_body, d_body
    n = req.num_prompts
    p_rank, d_rank = dp_rank(prefill), dp_rank(decode) if decode is not None else -1
    room_of = (lambda: new_room(prefill.dp_size, p_rank)) if p_rank >= 0 else new_room
    if n > 1:  # a batch: one room per prompt, fields as lists of that length
        fields = {"bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
                  "bootstrap_room": [room_of() for _ in range(n)]}
    else:
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room_of()}
    if p_rank < 0 and d_rank < 0:
        body = with_fields(req, fields)
        return body, body
    p_body = with_fields(req, {**fields, "routed_dp_rank": p_rank}) if p_rank >= 0 else with_fields(req, fields)
    d_body = with_fields(req, {**fields, "routed_dp_rank": d_rank}) if d_rank >= 0 else with_fields(req, fields)
    return p_body, d_body


async def run(ctx: FlowContext, placement: pb.Placement) -> Response | StreamResponse:
    req = ctx.req
    prefill, decode = placement.prefill, placement.decode
    p_body, d_body = bodies(ctx, prefill, ctx.placements.info.parallel_protocol or "sglang", decode)
    open_p = asyncio.ensure_future(ctx.upstream.open(prefill.worker_id, prefill.url + req.path, p_body,
                                                     req.request_id, total_timeout_s=ctx.upstream.prefill_timeout(),
                                                     trace=ctx.tracker.leg(LEG_PREFILL, prefill.worker_id),
                                                     dp_rank=dp_rank(prefill)))
    open_d = asyncio.ensure_future(ctx.upstream.open(decode.worker_id, decode.url + req.path, d_body,
                                                     req.request_id,
                                                     trace=ctx.tracker.leg(LEG_DECODE, decode.worker_id),
                                                     dp_rank=dp_rank(decode)))
    try:
        done, _ = await asyncio.wait({open_p, open_d}, return_when=asyncio.FIRST_COMPLETED)
        failed = open_p.exception() if open_p in done else None
        if failed is not None:
            raise failed
        d_resp = await open_d
    except BaseException:
        for task in (open_p, open_d):
            task.cancel()
        await asyncio.gather(open_p, open_d, return_exceptions=True)
        for task in (open_p, open_d):
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()
        raise

    drain = asyncio.ensure_future(_drain_prefill(ctx, open_p, prefill, d_resp))
    try:
        return await relay(ctx, d_resp, decode.worker_id)
    finally:
        if not drain.done():
            # D is finished (or gone): P's answer no longer matters to the client, but
            # it still holds P's load until it ends, so let it end on its own.
            drain.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _drain_prefill(ctx: FlowContext, open_p: asyncio.Future, prefill: pb.Endpoint,
                         d_resp: EngineResponse) -> None:
    """Read P's answer to the end; on failure before D's first byte, stop D too."""
    tracker = ctx.tracker
    try:
        p_resp = await open_p
        await read_body(prefill.worker_id, p_resp)
    except UpstreamError as exc:
        ctx.metrics.upstream_errors.labels(prefill.worker_id, str(exc.upstream_status)).inc()
        if not tracker.first_token_at and not tracker.ended:
            ctx.abort_reason = exc.message
            tracker.leg_failed(prefill.worker_id, exc.message, exc.upstream_status or 0)
            d_resp.close()   # D would wait for KV that never comes
        else:
            log.warning("prefill leg failed after decode started: %s", exc.message)
        tracker.prefill_done()
        return
    except asyncio.CancelledError:
        tracker.prefill_done()
        raise
    tracker.prefill_done()
