"""Aggregated flow: one worker runs the whole request; the body passes through untouched."""

from __future__ import annotations

from aiohttp import web

from dataplane.flows.context import FlowContext
from dataplane.flows.relay import relay
from dataplane.tracking import LEG_WHOLE
from protos import omni_proxy_pb2 as pb


async def run(ctx: FlowContext, placement: pb.Placement) -> web.StreamResponse:
    worker = placement.decode
    resp = await ctx.upstream.open(worker.worker_id, worker.url + ctx.req.path, ctx.req.raw, ctx.req.request_id,
                                   trace=ctx.tracker.leg(LEG_WHOLE, worker.worker_id))
    return await relay(ctx, resp, worker.worker_id)
