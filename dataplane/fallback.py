"""Placement in the data plane: round robin over the workers the control plane said were usable.

Two uses of one list, the control plane's snapshot of routable workers (sent at session
start and on every change), cycled per (model, role) by smooth weighted round robin (the
control plane's ``round_robin`` picker, nginx's rule):

- **Local placement** (``place_local``): when the control plane's policy needs no shared
  state (``SessionInfo.local_placement``: ``round_robin``, no queue stage), an aggregated
  entry leg is placed here, as a compiled router places in process, and the control plane is
  told afterwards (``PlaceRequest.placed_on``, batched with the lifecycle reports) instead of
  asked: no round trip, no answer to build and parse. Drains, cordons, weights and health
  reach this list through the snapshot; an engine's ``Retry-After`` that this node saw keeps
  that engine out here at once (``rest``), not only once the next snapshot says so. Anything
  else (PD roles, data-parallel workers, a model no listed worker serves) is asked of the
  control plane as before.
- **Fallback** (``place``): when no control plane has answered for a short while (all
  replicas down, a partition), the data plane keeps serving instead of failing every request
  after its placement timeout. It knows no load, no cache contents and no other data plane's
  traffic, so this is a bridge, not a policy. Layerwise PD needs the metaserver, which lives
  in the control plane, so those deployments answer 503.
"""

from __future__ import annotations

import time

from protos import omni_proxy_pb2 as pb

LOCAL_EXPLANATION = "placed by the data plane: round robin over the control plane's routable workers"
MAX_REST_S = 300.0   # the longest an engine's Retry-After keeps it out here (the control plane's default cap)


class _Pool:
    """One (model, role)'s workers and their smooth weighted round robin (equal weights: a
    plain cycle, the common case, without the arithmetic)."""

    __slots__ = ("current", "endpoints", "equal", "ids", "local", "next", "total", "weights")

    def __init__(self, workers: list[pb.KnownWorker]) -> None:
        self.endpoints = [w.endpoint for w in workers]
        # Their ids, read once per snapshot (each read of a protobuf field builds its value):
        # what exclusions are checked against and a local placement's ``placed_on``.
        self.ids = [ep.worker_id for ep in self.endpoints]
        # Local placement's answer on each worker, built once per snapshot (on demand) and
        # shared by every request placed there: read-only for its readers (the flows read
        # its flow and endpoints; nothing reads a request id in it).
        self.local: list[pb.Placement | None] = [None] * len(workers)
        self.weights = [w.weight if w.weight > 0 else 1.0 for w in workers]
        self.equal = len(set(self.weights)) <= 1
        self.total = sum(self.weights)
        self.current = [0.0] * len(workers)
        self.next = 0

    def pick(self, exclude: set[str] | frozenset[str]) -> pb.Endpoint | None:
        i = self.pick_index(exclude)
        return self.endpoints[i] if i >= 0 else None

    def placed_local(self, i: int) -> pb.Placement:
        """Worker ``i``'s (shared) aggregated placement."""
        out = self.local[i]
        if out is None:
            out = self.local[i] = pb.Placement(flow=pb.FLOW_AGGREGATED, explanation=LOCAL_EXPLANATION)
            out.decode.CopyFrom(self.endpoints[i])
        return out

    def pick_index(self, exclude: set[str] | frozenset[str]) -> int:
        """The next worker's index in the cycle (-1: every one is excluded)."""
        n = len(self.endpoints)
        if self.equal:
            for _ in range(n):
                i = self.next
                self.next = i + 1 if i + 1 < n else 0
                if not exclude or self.ids[i] not in exclude:
                    return i
            return -1
        best = -1
        total = 0.0
        current, weights, ids = self.current, self.weights, self.ids
        for i in range(n):
            if exclude and ids[i] in exclude:
                continue
            current[i] += weights[i]
            total += weights[i]
            if best < 0 or current[i] > current[best]:
                best = i
        if best >= 0:
            current[best] -= total
        return best


_NO_EXCLUDE: frozenset[str] = frozenset()


class FallbackPlacer:
    def __init__(self) -> None:
        self._workers: list[pb.KnownWorker] = []
        self._pools: dict[tuple[str, int], _Pool | None] = {}
        self._local: dict[str, _Pool | None] = {}   # model -> what place_local cycles
        self._loras: dict[str, str] = {}
        self.placed = 0          # placed while no control plane answered
        self.placed_local = 0    # placed here by the control plane's leave (local placement)
        self._resting: dict[str, float] = {}   # worker id -> monotonic time its Retry-After ends

    def update(self, snapshot: pb.FleetSnapshot) -> None:
        self._workers = list(snapshot.workers)
        self._pools = {}
        self._local = {}
        self._loras = {a.name: a.path for w in self._workers for a in w.loras}

    def rest(self, worker_id: str, seconds: float) -> None:
        """An engine answered with ``Retry-After``: leave it out here at once, for that long
        (at most MAX_REST_S). The control plane ejects it for as long, but its next worker list
        comes a few milliseconds after our report reaches it, and a round robin here would
        send that engine more requests meanwhile."""
        self._resting[worker_id] = time.monotonic() + min(seconds, MAX_REST_S)

    def _excluding(self, exclude: set[str] | frozenset[str]) -> set[str] | frozenset[str]:
        """``exclude`` and the workers still resting (those whose time is up are forgotten)."""
        now = time.monotonic()
        resting = self._resting
        for wid in [w for w, until in resting.items() if until <= now]:
            del resting[wid]
        return exclude | resting.keys() if resting else exclude

    def lora_path(self, model: str) -> str | None:
        """The path of the LoRA adapter served as ``model`` (what its block hashes carry), or
        None when ``model`` is no adapter any routable worker serves."""
        return self._loras.get(model)

    @property
    def known(self) -> int:
        return len(self._workers)

    def models(self) -> list[str]:
        return sorted({w.model for w in self._workers if w.model})

    def _pool(self, model: str, role: int) -> _Pool | None:
        """The pool of (model, role), built once per snapshot; None when no worker serves it."""
        key = (model, role)
        try:
            return self._pools[key]
        except KeyError:
            pass
        members = [w for w in self._workers if w.endpoint.role == role and
                   (not model or w.model == model or any(a.name == model for a in w.loras))]
        pool = self._pools[key] = _Pool(members) if members else None
        return pool

    def _next(self, model: str, role: int, exclude) -> pb.Endpoint | None:
        pool = self._pool(model, role)
        if self._resting:
            exclude = self._excluding(exclude)
        return pool.pick(exclude) if pool is not None else None

    def _local_pool(self, model: str) -> _Pool | None:
        """The pool local placement cycles for ``model``: its aggregated workers, when the
        control plane's choice would be among exactly those (no prefill worker beside them,
        no data-parallel one, whose rank the control plane chooses); else None."""
        pool = self._pool(model, pb.ROLE_BOTH)
        if pool is None or self._pool(model, pb.ROLE_PREFILL) is not None:
            return None
        return pool if all(ep.dp_size <= 1 for ep in pool.endpoints) else None

    def place_local(self, req: pb.PlaceRequest) -> pb.Placement | None:
        """An aggregated entry leg placed here (see the module's docstring), ``req`` marked
        with its worker (``placed_on``), or None: ask the control plane (``_local_pool``: none
        listed for the model, or not only aggregated ones; or every one excluded)."""
        model = req.model
        try:
            pool = self._local[model]
        except KeyError:
            pool = self._local[model] = self._local_pool(model)
        if pool is None:
            return None
        exclude = frozenset(req.exclude_workers) if req.exclude_workers else _NO_EXCLUDE
        i = pool.pick_index(self._excluding(exclude) if self._resting else exclude)
        if i < 0:
            return None
        self.placed_local += 1
        req.placed_on = pool.ids[i]    # (what the control plane is told: PlacementClient.place_here)
        return pool.placed_local(i)

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
