"""Sequential PD flow (vLLM NIXL / Mooncake "pull"): P first, then D pulls the KV.

P gets a copy capped at one token with ``do_remote_decode``; it answers with the
``kv_transfer_params`` that tell D where the KV blocks are. D is chosen only after P is
done, so the choice uses D's load at that moment. P's load is released when D's first
chunk arrives, because P holds the blocks until D has read them.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from dataplane.body import PULL_PREFILL_KV_PARAMS, prefill_body, with_fields
from dataplane.flows.context import FlowContext
from dataplane.flows.relay import relay
from dataplane.placing import place
from dataplane.upstream import UpstreamError, read_body
from protos import omni_proxy_pb2 as pb


async def run(ctx: FlowContext, placement: pb.Placement) -> web.StreamResponse:
    req = ctx.req
    prefill = placement.prefill
    resp = await ctx.upstream.open(prefill.worker_id, prefill.url + req.path,
                                   prefill_body(req, PULL_PREFILL_KV_PARAMS), req.request_id)
    data = await read_body(prefill.worker_id, resp)
    try:
        kv_params = orjson.loads(data).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        kv_params = None
    if not isinstance(kv_params, dict) or not kv_params:
        # Sending D on without them would leave it waiting for KV that never comes.
        raise UpstreamError(prefill.worker_id, f"prefill worker {prefill.worker_id} returned no "
                            "kv_transfer_params (is it running with a kv_producer connector?)", 200)

    decode_placement = await place(ctx.placements, req, pb.LEG_DECODE)
    decode = decode_placement.decode
    resp = await ctx.upstream.open(decode.worker_id, decode.url + req.path,
                                   with_fields(req, {"kv_transfer_params": kv_params}), req.request_id)
    return await relay(ctx, resp, decode.worker_id, on_first_chunk=ctx.tracker.prefill_done)
