"""Aggregated flow: one worker runs the whole request; the body passes through untouched.

An engine that fails before the first byte (unreachable, 5xx, 429/503, timed out) is
replaced by another worker (``dataplane.retry``); after that, the relay ends the stream
with an error event.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from dataplane.errors import APIError
from dataplane.flows.context import FlowContext
from dataplane.flows.relay import relay
from dataplane.placing import place
from dataplane.retry import retry_after_s
from dataplane.upstream import UpstreamError, dp_rank
from dataplane.tracking import LEG_WHOLE
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)


async def run(ctx: FlowContext, placement: pb.Placement) -> web.StreamResponse:
    worker = placement.decode
    tried: list[str] = []
    while True:
        try:
            resp = await ctx.upstream.open(worker.worker_id, worker.url + ctx.req.path, ctx.req.raw,
                                           ctx.req.request_id, trace=ctx.tracker.leg(LEG_WHOLE, worker.worker_id),
                                           dp_rank=dp_rank(worker))
            break
        except UpstreamError as exc:
            # Nothing has reached the client yet: another worker may still serve it.
            tried.append(worker.worker_id)
            if not ctx.retry.retryable(exc, len(tried) - 1):
                raise
            worker = await _another(ctx, exc, tried)
    return await relay(ctx, resp, worker.worker_id)


async def _another(ctx: FlowContext, exc: UpstreamError, tried: list[str]) -> pb.Endpoint:
    failed = tried[-1]
    log.warning("worker %s failed before the first byte (%s %s); trying another worker",
                failed, exc.upstream_status, exc.message)
    ctx.tracker.leg_failed(failed, exc.message, exc.upstream_status or 0, retry_after_s(exc))
    ctx.metrics.upstream_errors.labels(failed, str(exc.upstream_status)).inc()
    try:
        again = await place(ctx.placements, ctx.req, pb.LEG_ENTRY, exclude=tried)
    except APIError:
        raise exc from None   # no other worker: the client hears the real failure
    if again.flow != pb.FLOW_AGGREGATED:
        raise exc             # only PD workers left; this request was started as aggregated
    await asyncio.sleep(ctx.retry.delay(len(tried)))
    return again.decode
