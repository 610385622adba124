"""gRPC servicers: translate between the wire API and the control plane's objects."""

from __future__ import annotations

import itertools
import logging
import time
import uuid

import grpc

from controlplane.placement import ROLE_TO_PB, Placer
from controlplane.registry import WorkerRegistry
from controlplane.workers import Health, Role, Worker
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_HEALTH_TO_PB = {Health.UNKNOWN: pb.STATUS_UNKNOWN, Health.HEALTHY: pb.STATUS_HEALTHY,
                 Health.UNHEALTHY: pb.STATUS_UNHEALTHY}
_PB_TO_ROLE = {pb.ROLE_BOTH: Role.BOTH, pb.ROLE_PREFILL: Role.PREFILL, pb.ROLE_DECODE: Role.DECODE}


def worker_info(w: Worker, cached_blocks: int = 0) -> pb.WorkerInfo:
    now = time.monotonic()
    return pb.WorkerInfo(
        kv_events=w.kv_events, cached_blocks=cached_blocks,
        id=w.id, url=w.url, role=ROLE_TO_PB[w.role], model=w.model, weight=w.weight,
        status=_HEALTH_TO_PB[w.health], draining=w.draining, source=w.source,
        placements_total=w.placements_total, failures_total=w.failures_total, last_error=w.last_error,
        labels=w.labels, bootstrap_port=w.bootstrap_port,
        load=pb.WorkerLoad(
            inflight_requests=w.inflight_requests, inflight_tokens=w.inflight_tokens,
            engine_running=w.engine.running, engine_waiting=w.engine.waiting,
            engine_kv_usage=w.engine.kv_usage,
            metrics_age_s=(now - w.engine.updated_at) if w.engine.updated_at else -1.0))


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(self, placer: Placer, registry: WorkerRegistry, info: pb.SessionInfo | None = None) -> None:
        self.placer = placer
        self.registry = registry
        self.info = info or pb.SessionInfo(pd_flow=placer.pd_flow)
        self._session_ids = itertools.count(1)

    async def Session(self, request_iterator, context):
        """Serve one data plane: placements are answered in order, reports need no answer.

        Handling each message inline keeps placements strictly ordered, so every one of
        them sees the load charged by the one before.
        """
        session = f"s{next(self._session_ids)}-{uuid.uuid4().hex[:6]}"
        node = "?"
        yield pb.ControlPlaneMessage(info=self.info)
        try:
            async for msg in request_iterator:
                body = msg.WhichOneof("body")
                if body == "place":
                    placement = await self.placer.place(msg.place, session)
                    yield pb.ControlPlaneMessage(placement=placement)
                elif body == "event":
                    await self.placer.report(msg.event)
                elif body == "open":
                    node = msg.open.node_id or node
                    log.info("data plane %s connected (session %s)", node, session)
        finally:
            released = await self.placer.release_session(session)
            log.info("data plane %s disconnected; released %d in-flight requests", node, released)

    async def Place(self, request, context):
        return await self.placer.place(request)

    async def Report(self, request, context):
        await self.placer.report(request)
        return pb.Ack()

    async def ListModels(self, request, context):
        models: dict[str, pb.ModelInfo] = {}
        for w in await self.registry.store.list_workers():
            if not w.model:
                continue
            info = models.setdefault(w.model, pb.ModelInfo(id=w.model))
            info.workers += 1
            if w.health is Health.HEALTHY and w.role is not Role.DECODE:
                info.healthy_workers += 1
        return pb.ListModelsResponse(models=sorted(models.values(), key=lambda m: m.id))


def _spec_from_register(req: pb.RegisterRequest) -> dict:
    if not req.url:
        raise ValueError("url is required")
    role = _PB_TO_ROLE.get(req.role)
    if role is None:
        raise ValueError("role must be BOTH, PREFILL or DECODE")
    if req.weight < 0:
        raise ValueError("weight must be >= 0")
    return dict(url=req.url, role=role, model=req.model, weight=req.weight or 1.0,
                worker_id=req.worker_id, labels=dict(req.labels), bootstrap_port=req.bootstrap_port,
                kv_events=req.kv_events, kv_replay=req.kv_replay, dp_size=req.dp_size or 1)


class RegistryService(pb_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def Register(self, request, context):
        try:
            spec = _spec_from_register(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        ttl = request.heartbeat_ttl_s or self.registry.heartbeat_ttl_s
        worker = await self.registry.add(**spec, source="registry", heartbeat_ttl_s=ttl)
        return pb.RegisterResponse(worker_id=worker.id, heartbeat_interval_s=self.registry.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        known = await self.registry.heartbeat(request.worker_id, request.running, request.waiting)
        return pb.HeartbeatResponse(known=known)

    async def Deregister(self, request, context):
        await self.registry.remove(request.worker_id)
        return pb.Ack()


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, registry: WorkerRegistry, placer: Placer) -> None:
        self.registry = registry
        self.placer = placer

    async def _get(self, worker_id: str, context) -> Worker:
        worker = await self.registry.store.get_worker(worker_id)
        if worker is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r}")
        return worker

    async def ListWorkers(self, request, context):
        workers = await self.registry.store.list_workers()
        if request.model:
            workers = [w for w in workers if w.model == request.model]
        cached = self.placer.kv.cached_blocks() if self.placer.kv else {}
        return pb.ListWorkersResponse(workers=[worker_info(w, cached.get(w.id, 0))
                                               for w in sorted(workers, key=lambda w: w.id)],
                                      policy=self.placer.profile.name)

    async def AddWorker(self, request, context):
        try:
            spec = _spec_from_register(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        worker = await self.registry.add(**spec, source="admin")
        return pb.WorkerResponse(worker=worker_info(worker))

    async def Drain(self, request, context):
        worker = await self._get(request.worker_id, context)
        worker.draining = True
        log.info("worker %s draining (%d in flight)", worker.id, worker.inflight_requests)
        return pb.WorkerResponse(worker=worker_info(worker))

    async def Undrain(self, request, context):
        worker = await self._get(request.worker_id, context)
        worker.draining = False
        return pb.WorkerResponse(worker=worker_info(worker))

    async def SetWeight(self, request, context):
        if request.weight < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "weight must be >= 0")
        worker = await self._get(request.worker_id, context)
        worker.weight = request.weight
        return pb.WorkerResponse(worker=worker_info(worker))

    async def RemoveWorker(self, request, context):
        if not await self.registry.remove(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r}")
        return pb.Ack()

    async def Explain(self, request, context):
        if request.leg == pb.LEG_UNSPECIFIED:
            request.leg = pb.LEG_ENTRY
        return await self.placer.place(request, dry_run=True)
