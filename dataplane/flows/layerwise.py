"""Layerwise PD flow (vLLM-Ascend MooncakeLayerwiseConnector): D first, P pushes.

D gets the request with the metaserver's address. D allocates its KV blocks, calls the
metaserver (hosted by the control plane), and the control plane sends the prefill to a P
of its choosing with D's block addresses; P pushes the KV layer by layer. The data plane
hands the request over to the metaserver first (it is not sent on the placement session,
where a large prompt would hold up every placement behind it), then drives D: the prefill
leg and its load are the control plane's to manage, which is why any data-plane replica
can serve a layerwise request.
"""

from __future__ import annotations

from dataplane.body import with_fields
from dataplane.flows.context import FlowContext
from dataplane.flows.relay import relay
from dataplane.messages import Response, StreamResponse
from dataplane.tracking import LEG_WHOLE
from dataplane.upstream import dp_rank
from engine_api.metaserver import body_url
from protos import omni_proxy_pb2 as pb


async def run(ctx: FlowContext, placement: pb.Placement) -> Response | StreamResponse:
    req = ctx.req
    decode = placement.decode
    # Before D has the request: D's call to the metaserver then finds it there.
    await ctx.upstream.hand_over(body_url(placement.metaserver_url, req.placement_id), req.raw, req.request_id)
    kv = {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": placement.metaserver_url}
    resp = await ctx.upstream.open(decode.worker_id, decode.url + req.path,
                                   with_fields(req, {"kv_transfer_params": kv}), req.request_id,
                                   trace=ctx.tracker.leg(LEG_WHOLE, decode.worker_id), dp_rank=dp_rank(decode))
    return await relay(ctx, resp, decode.worker_id)

