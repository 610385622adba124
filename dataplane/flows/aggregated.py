"""Aggregated flow: one worker runs the whole request; the body passes through untouched.

An engine that fails before the first byte (unreachable, 5xx, 429/503, timed out) is
replaced by another worker (``dataplane.retry``); after that, the relay ends the stream
with an error event.
"""

from __future__ import annotations

from functools import partial

from dataplane.errors import APIError
from dataplane.flows.context import FlowContext
from dataplane.flows.legs import open_leg
from dataplane.flows.relay import relay_json, relay_stream
from dataplane.messages import Response, StreamResponse
from dataplane.placing import place
from dataplane.upstream import UpstreamError
from dataplane.tracking import LEG_WHOLE
from protos import omni_proxy_pb2 as pb


async def run(ctx: FlowContext, placement: pb.Placement) -> Response | StreamResponse:
    resp, wid = await open_leg(ctx, placement.decode, ctx.req.raw, LEG_WHOLE, partial(_another, ctx))
    if ctx.req.stream:
        return await relay_stream(ctx, resp, wid)
    return await relay_json(ctx, resp, wid)   # (relay() without its coroutine)


async def _another(ctx: FlowContext, tried: list[str], exc: UpstreamError) -> pb.Endpoint:
    try:
        again = await place(ctx.placements, ctx.req, pb.LEG_ENTRY, exclude=tried)
    except APIError:
        raise exc from None   # no other worker: the client hears the real failure
    if again.flow != pb.FLOW_AGGREGATED:
        raise exc             # only PD workers left; this request was started as aggregated
    return again.decode
