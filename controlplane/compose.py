"""The control plane's composition root: every component built once, with its collaborators.

Read this file to see what the control plane is made of and who tells whom about what.
Each component gets what it uses through its constructor; events that several components
care about are hooks (``controlplane/hooks.py``) that the emitting component owns and this
file subscribes the others to:

- a worker added or removed (registry, spec sync): health-check it and follow its KV
  events; forget its predictor model and its KV subscription (:class:`WorkerWatch`);
- a layerwise request placed (placer): the metaserver waits for its decode engine's call;
- a request ended (lifecycle): the metaserver drops its pending prefill.

The metaserver places its prefill legs through the scheduler service, the path every data
plane's placement takes (queue stage, latency statistics, tracing): it sees the control
plane only as a :class:`metaserver.ports.ControlPlanePort`.

What needs the event loop or a port (listening, the first health checks, the background
loops) is started by :class:`controlplane.server.ControlPlane`.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.admin_state import AdminState
from controlplane.config import ControlPlaneConfig
from controlplane.fleet import Fleet
from controlplane.health import HealthChecker
from controlplane.kvcache.manager import KVCache
from controlplane.lifecycle import BreakerConfig, Lifecycle
from controlplane.placement import PlacementStats, Placer
from controlplane.prediction import Predictor
from controlplane.registry import WorkerRegistry
from controlplane.scheduling import build_profile
from controlplane.services import AdminService, RegistryService, SchedulerService
from controlplane.state import SharedStore, StateStore, make_store
from controlplane.state.sync import SpecSync
from controlplane.workers import WorkerSpec
from metaserver.server import Metaserver
from protos import omni_proxy_pb2 as pb


class WorkerWatch:
    """What a worker joining or leaving this replica's fleet sets off.

    Joining: a health check at once (not next round), then its KV events followed. Off until
    :meth:`start`: the workers known at start-up (config, state file, the shared store) are
    checked together by ``HealthChecker.start`` and their KV events followed after a KV
    snapshot is loaded (whose sequence numbers a subscription resumes from).
    """

    def __init__(self, health: HealthChecker, kv: KVCache, predictor: Predictor) -> None:
        self.health = health
        self.kv = kv
        self.predictor = predictor
        self.active = False

    def start(self) -> None:
        self.active = True

    async def added(self, spec: WorkerSpec) -> None:
        if self.active:
            await self.health.check(spec)
            await self.kv.watch(spec)

    async def removed(self, worker_id: str) -> None:
        self.predictor.forget(worker_id)
        await self.kv.unwatch(worker_id)


@dataclass(frozen=True)
class Components:
    """The control plane's parts, wired together (see the module docstring)."""

    config: ControlPlaneConfig
    store: StateStore
    fleet: Fleet
    admin_state: AdminState
    registry: WorkerRegistry
    sync: SpecSync | None            # with a store other replicas share (Redis) only
    predictor: Predictor
    kv: KVCache
    placer: Placer
    lifecycle: Lifecycle
    health: HealthChecker
    watch: WorkerWatch
    scheduler: SchedulerService
    registry_service: RegistryService
    admin_service: AdminService
    metaserver: Metaserver
    session_info: pb.SessionInfo


def session_info(config: ControlPlaneConfig, placer: Placer) -> pb.SessionInfo:
    """What every data-plane session is told first: the PD flow, and how to hash prompts."""
    kvc = config.kv_cache
    return pb.SessionInfo(
        pd_flow=placer.pd_flow, parallel_protocol=config.parallel_protocol,
        kv_hash=pb.KVHashConfig(enabled=placer.profile.uses_prefix_cache, block_size=kvc.block_size,
                                algo=kvc.hash_algo, seed=kvc.hash_seed or "", seed_set=kvc.hash_seed is not None,
                                lora_key_format=kvc.lora_key_format))


def build(config: ControlPlaneConfig, store: StateStore | None = None, *, tracing=None) -> Components:
    """Every component of one control-plane replica; nothing is started."""
    store = store or make_store(config)   # [state] backend: memory (default) or redis
    fleet = Fleet()
    # Operators' changes: in the state file with the memory store ([state] file), else in
    # memory (Redis keeps the specs itself; the removal fence is then per replica).
    admin_state = AdminState.load(config.state.file) if config.state.backend == "memory" else AdminState()
    registry = WorkerRegistry(store, fleet, heartbeat_interval_s=config.heartbeat_interval_s,
                              heartbeat_ttl_s=config.heartbeat_ttl_s, admin=admin_state)
    sync = SpecSync(store, fleet, events=registry.events) if isinstance(store, SharedStore) else None
    predictor = Predictor()
    kv = KVCache(config.kv_cache)
    stats = PlacementStats.new()
    placer = Placer(store, fleet, build_profile(config.policy, config.profiles), pd_flow=config.pd_flow,
                    stats=stats, predictor=predictor, block_size=config.kv_cache.block_size, kv=kv,
                    metrics_max_age_s=max(3 * config.health.metrics_interval_s, 2.0),
                    ttft_slo_s=config.slo.ttft_ms / 1000, tpot_slo_s=config.slo.tpot_ms / 1000)
    lifecycle = Lifecycle(store, fleet, stats, max_request_age_s=config.max_request_age_s,
                          session_grace_s=config.session_grace_s, predictor=predictor, queue=placer.queue,
                          breaker=BreakerConfig(config.health.eject_after, config.health.eject_base_s,
                                                config.health.eject_max_s))
    health = HealthChecker(fleet, registry, config.health, engine_api_key=config.engine_api_key)
    watch = WorkerWatch(health, kv, predictor)
    registry.events.added.subscribe(watch.added)
    registry.events.removed.subscribe(watch.removed)

    info = session_info(config, placer)
    scheduler = SchedulerService(placer, lifecycle, registry, info, tracing=tracing)
    metaserver = Metaserver(scheduler, prefill_retries=config.prefill_retries,
                            timeout_s=config.layerwise_timeout_s, engine_api_key=config.engine_api_key)
    placer.layerwise_placed.subscribe(metaserver.register)
    lifecycle.request_ended.subscribe(metaserver.drop)
    return Components(
        config=config, store=store, fleet=fleet, admin_state=admin_state, registry=registry, sync=sync,
        predictor=predictor, kv=kv, placer=placer, lifecycle=lifecycle, health=health, watch=watch,
        scheduler=scheduler, registry_service=RegistryService(registry, info.kv_hash),
        admin_service=AdminService(registry, placer, health=health, info=info), metaserver=metaserver,
        session_info=info)
