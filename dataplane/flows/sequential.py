"""Sequential PD flow (vLLM NIXL / Mooncake "pull"): P first, then D pulls the KV.

P gets a copy capped at one token with ``do_remote_decode``; it answers with the
``kv_transfer_params`` that tell D where the KV blocks are. D is chosen only after P is
done, so the choice uses D's load at that moment. P's load is released when D's first
chunk arrives, because P holds the blocks until D has read them. A P that fails is
replaced by another (``dataplane.retry.prefill_retry``: not for a 4xx, which would fail on
every P; yes for an answer without ``kv_transfer_params``, a P without a producer connector).
"""

from __future__ import annotations

from typing import Any

import orjson

from dataplane.body import with_fields
from dataplane.errors import APIError
from dataplane.flows.context import FlowContext
from dataplane.flows.legs import open_leg
from dataplane.flows.relay import relay
from dataplane.messages import Response, StreamResponse
from dataplane.placing import place
from dataplane.retry import retry_after_s
from dataplane.tracking import LEG_DECODE, LEG_PREFILL
from dataplane.upstream import UpstreamError, dp_rank, read_body
from engine_api.bodies import PULL_PREFILL_KV_PARAMS, prefill_body
from protos import omni_proxy_pb2 as pb


async def _prefill(ctx: FlowContext, prefill: pb.Endpoint, body: bytes) -> dict[str, Any]:
    resp = await ctx.upstream.open(prefill.worker_id, prefill.url + ctx.req.path, body, ctx.req.request_id,
                                   total_timeout_s=ctx.upstream.prefill_timeout(),
                                   trace=ctx.tracker.leg(LEG_PREFILL, prefill.worker_id), dp_rank=dp_rank(prefill))
    data = await read_body(prefill.worker_id, resp)
    try:
        kv_params = orjson.loads(data).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        kv_params = None
    if not isinstance(kv_params, dict) or not kv_params:
        # Sending D on without them would leave it waiting for KV that never comes.
        raise UpstreamError(prefill.worker_id, f"prefill worker {prefill.worker_id} returned no "
                            "kv_transfer_params (is it running with a kv_producer connector?)", 200)
    ctx.tracker.prefill_answer()
    return kv_params


async def run(ctx: FlowContext, placement: pb.Placement) -> Response | StreamResponse:
    req = ctx.req
    prefill = placement.prefill
    body = prefill_body(req.body, PULL_PREFILL_KV_PARAMS)
    tried: list[str] = []
    while True:
        try:
            kv_params = await _prefill(ctx, prefill, body)
            break
        except UpstreamError as exc:
            tried.append(prefill.worker_id)
            pause = ctx.prefill_retry.next_delay(exc, len(tried))
            if pause is None:
                raise
            # (the policy's on_retry hook logged it and counted it for the worker)
            ctx.tracker.leg_failed(prefill.worker_id, exc.message, exc.upstream_status or 0, retry_after_s(exc))
            try:
                prefill = (await place(ctx.placements, req, pb.LEG_PREFILL, exclude=tried)).prefill
            except APIError:
                raise exc from None  # no other prefill worker: the client hears the real failure
            await ctx.prefill_retry.sleep(pause)

    decode = (await place(ctx.placements, req, pb.LEG_DECODE)).decode
    body = with_fields(req, {"kv_transfer_params": kv_params})

    async def another_decode(tried: list[str], exc: UpstreamError) -> pb.Endpoint:
        # P still holds the KV until a D reads it: another D can pull it as well.
        try:
            return (await place(ctx.placements, req, pb.LEG_DECODE, exclude=tried)).decode
        except APIError:
            raise exc from None

    resp, wid = await open_leg(ctx, decode, body, LEG_DECODE, another_decode)
    return await relay(ctx, resp, wid, on_first_chunk=ctx.tracker.prefill_done)
