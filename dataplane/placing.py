"""Ask the control plane for a placement; turn a refusal into the HTTP error it means."""

from __future__ import annotations

from dataplane.errors import APIError
from dataplane.placement_client import ControlPlaneUnavailable, PlacementClient
from dataplane.requests import ClientRequest
from protos import omni_proxy_pb2 as pb

_STATUS = {pb.UNKNOWN_MODEL: 404, pb.NO_HEALTHY_WORKER: 503, pb.INVALID_REQUEST: 400, pb.OVERLOADED: 429}


async def place(placements: PlacementClient, req: ClientRequest, leg: pb.Leg,
                exclude: list[str] | None = None, trace: dict[str, str] | None = None) -> pb.Placement:
    out = message(placements, req, leg, exclude, trace)
    placement = placements.place_here(out)   # (round_robin: placed here, no round trip)
    if placement is not None:
        return placement
    return await ask(placements, out)


def message(placements: PlacementClient, req: ClientRequest, leg: pb.Leg,
            exclude: list[str] | None = None, trace: dict[str, str] | None = None) -> pb.DataPlaneMessage:
    """The session message asking for ``req``'s ``leg``: ``place`` in steps, for the entry
    leg's caller, which awaits ``ask`` only when ``PlacementClient.place_here`` cannot place
    it (no coroutine per request for a local placement)."""
    # Built in place inside the session message that carries it (no copy), and fields left
    # at their defaults are not set at all: the same bytes on the wire, at less cost.
    out = pb.DataPlaneMessage()
    msg = out.place
    msg.request_id = req.placement_id
    msg.model = req.model
    msg.leg = leg
    msg.prompt_tokens = req.prompt_tokens
    msg.max_tokens = req.max_tokens
    if exclude:
        msg.exclude_workers.extend(exclude)
    if req.block_hashes:
        msg.block_hashes.extend(req.block_hashes)
    if req.ttft_slo_ms:
        msg.ttft_slo_ms = req.ttft_slo_ms
    if req.tpot_slo_ms:
        msg.tpot_slo_ms = req.tpot_slo_ms
    if trace:
        # The request's trace context: the control plane's placement span (with otel_endpoint)
        # joins it, and in layerwise the prefill leg it sends itself carries it.
        msg.trace_headers.update(trace)
    if leg == pb.LEG_ENTRY and placements.info.pd_flow == pb.FLOW_LAYERWISE:
        # The control plane sends this deployment's prefill legs itself (metaserver): the ids
        # it expects D to report. The request follows over HTTP (flows/layerwise.py), not here.
        msg.path = req.path
        msg.engine_request_id, msg.num_prompts = req.request_id, req.num_prompts
    return out


async def ask(placements: PlacementClient, out: pb.DataPlaneMessage) -> pb.Placement:
    """The control plane's placement for ``out`` (``message``); its refusal as the HTTP error."""
    try:
        placement = await placements.place(out)
    except ControlPlaneUnavailable as exc:
        raise APIError(503, f"no placement: {exc}") from None
    if placement.error:
        retry = {"Retry-After": str(max(1, round(placement.retry_after_s)))} if placement.retry_after_s else None
        raise APIError(_STATUS.get(placement.error, 503), placement.error_message,
                       param="model" if placement.error == pb.UNKNOWN_MODEL else None, headers=retry)
    return placement
