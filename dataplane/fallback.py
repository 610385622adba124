"""Placement without a control plane: round robin over the last workers it said were usable.

When no control plane has answered for a short while (all replicas down, a partition),
the data plane keeps serving instead of failing every request after its placement
timeout. It knows no load, no cache contents and no other data plane's traffic, so this
is a bridge, not a policy: the control plane's snapshot of routable workers (sent at
session start and on every change), cycled per (model, role). Layerwise PD needs the
metaserver, which lives in the control plane, so those deployments answer 503.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from protos import omni_proxy_pb2 as pb


class FallbackPlacer:
    def __init__(self) -> None:
        self._workers: list[pb.KnownWorker] = []
        self._cycles: dict[tuple[str, int], Iterator[pb.KnownWorker]] = {}
        self._loras: dict[str, str] = {}
        self.placed = 0

    def update(self, snapshot: pb.FleetSnapshot) -> None:
        self._workers = list(snapshot.workers)
        self._cycles = {}
        self._loras = {a.name: a.path for w in self._workers for a in w.loras}

    def lora_path(self, model: str) -> str | None:
        """The path of the LoRA adapter served as ``model`` (what its block hashes carry), or
        None when ``model`` is no adapter any routable worker serves."""
        return self._loras.get(model)

    @property
    def known(self) -> int:
        return len(self._workers)

    def models(self) -> list[str]:
        return sorted({w.model for w in self._workers if w.model})

    def _next(self, model: str, role: int, exclude) -> pb.Endpoint | None:
        key = (model, role)
        pool = [w for w in self._workers if w.endpoint.role == role and
                (not model or w.model == model or any(a.name == model for a in w.loras))]
        if not pool:
            return None
        cycle = self._cycles.get(key)
        if cycle is None:
            cycle = self._cycles[key] = itertools.cycle(pool)
        for _ in range(len(pool)):
            w = next(cycle)
            if w.endpoint.worker_id not in exclude:
                return w.endpoint
        return None

    def place(self, req: pb.PlaceRequest, pd_flow: pb.Flow) -> pb.Placement:
        out = pb.Placement(seq=req.seq, request_id=req.request_id)
        exclude = set(req.exclude_workers)
        if req.leg in (pb.LEG_PREFILL, pb.LEG_DECODE):
            role = pb.ROLE_PREFILL if req.leg == pb.LEG_PREFILL else pb.ROLE_DECODE
            ep = self._next(req.model, role, exclude)
            if ep is None:
                return self._none(out, req.model)
            (out.prefill if req.leg == pb.LEG_PREFILL else out.decode).CopyFrom(ep)
            out.flow = pd_flow
            return self._ok(out)
        agg = self._next(req.model, pb.ROLE_BOTH, exclude)
        if agg is not None:
            out.flow = pb.FLOW_AGGREGATED
            out.decode.CopyFrom(agg)
            return self._ok(out)
        if pd_flow in (pb.FLOW_SEQUENTIAL, pb.FLOW_PARALLEL):
            p = self._next(req.model, pb.ROLE_PREFILL, exclude)
            d = self._next(req.model, pb.ROLE_DECODE, exclude) if pd_flow == pb.FLOW_PARALLEL else None
            if p is not None and (d is not None or pd_flow == pb.FLOW_SEQUENTIAL):
                out.flow = pd_flow
                out.prefill.CopyFrom(p)
                if d is not None:
                    out.decode.CopyFrom(d)
                return self._ok(out)
        return self._none(out, req.model)

    def _ok(self, out: pb.Placement) -> pb.Placement:
        self.placed += 1
        out.explanation = "fallback: no control plane reachable (round robin over the last known workers)"
        return out

    @staticmethod
    def _none(out: pb.Placement, model: str) -> pb.Placement:
        out.error = pb.NO_HEALTHY_WORKER
        out.error_message = (f"no control plane reachable, and no last known worker can serve model {model!r} "
                             "without one")
        return out
