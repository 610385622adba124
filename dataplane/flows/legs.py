"""Opening a leg that may be moved to another worker while nothing has reached the client.

One loop for every flow that can retry a leg (aggregated, decode): the leg is opened on
its worker; a failure the retry policy allows (``dataplane.retry``, ``omni_runtime.retry``) is
reported for that worker, ``replace`` picks another one (raising the original error when there
is none), and after the policy's jittered pause the leg is opened there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from dataplane.flows.context import FlowContext
from dataplane.retry import retry_after_s
from dataplane.upstream import UpstreamError, dp_rank
from engine_api.client import EngineResponse
from protos import omni_proxy_pb2 as pb

Replace = Callable[[list[str], UpstreamError], Awaitable[pb.Endpoint]]


async def open_leg(ctx: FlowContext, endpoint: pb.Endpoint, body: bytes, leg: str,
                   replace: Replace) -> tuple[EngineResponse, str]:
    """The engine's response and the id of the worker that gave it (read once: each read of
    a protobuf field builds its value, and the relay names the worker again)."""
    tried: list[str] = []
    while True:
        wid = endpoint.worker_id
        try:
            resp = await ctx.upstream.open(wid, endpoint.url + ctx.req.path, body, ctx.req.request_id,
                                           trace=ctx.tracker.leg(leg, wid), dp_rank=dp_rank(endpoint))
            return resp, wid
        except UpstreamError as exc:
            failed = wid
            tried.append(failed)
            pause = ctx.retry.next_delay(exc, len(tried))
            if pause is None:
                raise
            # (the policy's on_retry hook logged it and counted it for the worker)
            ctx.tracker.leg_failed(failed, exc.message, exc.upstream_status or 0, retry_after_s(exc))
            endpoint = await replace(tried, exc)
            await ctx.retry.sleep(pause)
