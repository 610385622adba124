"""The control-plane process: state, placement, health checks, gRPC API and HTTP endpoints."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from controlplane import compose, metrics
from controlplane.admin_state import spec_from_json
from controlplane.auth import AuthInterceptor, server_credentials, server_ssl_context
from controlplane.config import ControlPlaneConfig
from controlplane.discovery import DiscoveryFile
from controlplane.grpc_guard import MalformedMessageGuard
from controlplane.registry import worker_id_for
from controlplane.session_socket import SessionSocketServer
from controlplane.state import ClosableStore, ReportsAvailability, SharedStore, StateStore
from omni_runtime import start_http_site
from metaserver.server import Metaserver
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from protos.options import server_options

if TYPE_CHECKING:
    from controlplane.kvcache.persist import KVSnapshots   # imported when snapshots are on

log = logging.getLogger(__name__)


def _tracing(config: ControlPlaneConfig):
    """Spans on (``otel_endpoint``): the SDK is imported only here."""
    from omni_runtime import StartupError

    try:
        from controlplane.otel import Tracing
    except ImportError as exc:
        raise StartupError(f"otel_endpoint needs OpenTelemetry ({exc.name} is missing): "
                           "pip install 'omni-proxy[otel]'") from None
    return Tracing(config.otel_endpoint, service_name=config.otel_service_name)


class ControlPlane:
    """One control-plane replica: the components ``controlplane/compose.py`` builds, started
    and stopped in order, behind a gRPC server, the session socket and an HTTP site."""

    def __init__(self, config: ControlPlaneConfig, store: StateStore | None = None) -> None:
        self.config = config
        self.tracing = _tracing(config) if config.otel_endpoint else None
        parts = compose.build(config, store, tracing=self.tracing)
        self.parts = parts
        self.store = parts.store
        self.fleet = parts.fleet
        self.admin_state = parts.admin_state
        self.registry = parts.registry
        self.predictor = parts.predictor
        self.placer = parts.placer
        self.lifecycle = parts.lifecycle
        self.health = parts.health
        self.kv = parts.kv
        self.metaserver = parts.metaserver
        self._sync = parts.sync
        self.grpc_port = 0
        self.session_port = 0            # the session socket's; 0 while there is none
        self.session_socket: SessionSocketServer | None = None
        self.http_port = 0
        self._server: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task | None = None
        self.discovery: DiscoveryFile | None = None
        self._tasks: list[asyncio.Task] = []
        self.kv_snapshots: KVSnapshots | None = None   # with the Redis store (kvcache/persist.py)

    async def start(self) -> None:
        store = self.store
        if isinstance(store, SharedStore) and self._sync is not None:   # another replica may share it (Redis)
            # Be a live replica before touching the ledger (others sweep replicas that are
            # not), and start from the workers, weights and drain flags the store kept.
            await store.heartbeat()
            # The worker watch is off: the workers read here are health-checked together by
            # health.start() below (a check now would come before there is an HTTP session).
            await self._sync.refresh()
        admin = self.registry.admin
        for spec in self.config.workers:
            wid = spec.id or worker_id_for(spec.url, spec.role)
            if wid in admin.removed or wid in admin.added:
                # an operator removed it, or replaced it (omni-ctl add --replace): theirs wins
                log.info("config worker %s: %s by an operator (state file %s): not added from the config",
                         wid, "removed" if wid in admin.removed else "replaced", admin.path)
                continue
            # an operator's weight (and drain) outlive a restart: weight None keeps them (the
            # shared store's copy, else the state file's), else the config's
            await self.registry.add(url=spec.url, role=spec.role, model=spec.model, weight=None,
                                    default_weight=spec.weight, worker_id=spec.id, labels=spec.labels,
                                    bootstrap_port=spec.bootstrap_port, kv_events=spec.kv_events,
                                    kv_replay=spec.kv_replay, dp_size=spec.dp_size)
        for wid, data in admin.added.items():      # workers operators added (state file)
            if self.fleet.get(wid) is None:
                s = spec_from_json(wid, data)
                await self.registry.add(url=s.url, role=s.role, model=s.model, weight=s.weight, worker_id=wid,
                                        labels=dict(s.labels), bootstrap_port=s.bootstrap_port, source="admin",
                                        kv_events=s.kv_events, kv_replay=s.kv_replay, dp_size=s.dp_size)
        if self._sync is not None and self.config.kv_cache.snapshot_interval_s > 0:
            # KV index snapshots (kvcache/persist.py): warm from the newest before serving
            from controlplane.kvcache.persist import KVSnapshots
            self.kv_snapshots = KVSnapshots(self.kv, self.store, self.config.kv_cache.snapshot_interval_s)
            await self.kv_snapshots.load_newest(self.fleet.specs())
        await self.health.start()
        for worker in self.fleet.specs():
            await self.kv.watch(worker)
        self.parts.watch.start()      # from now on a worker that joins is checked and watched at once
        if self.config.discovery.file:
            self.discovery = DiscoveryFile(self.config.discovery.file, self.registry,
                                           interval_s=self.config.discovery.interval_s)
            await self.discovery.start()

        tokens = self.config.auth.resolved()
        auth = AuthInterceptor(tokens) if tokens.enabled else None
        self._server = grpc.aio.server(options=server_options(),   # malformed messages: INVALID_ARGUMENT
                                       interceptors=[*([auth] if auth is not None else []),
                                                     MalformedMessageGuard()])
        if tokens.enabled:
            log.info("gRPC API tokens: %s", tokens.describe())
        scheduler = self.parts.scheduler
        pb_grpc.add_SchedulerServicer_to_server(scheduler, self._server)
        pb_grpc.add_RegistryServicer_to_server(self.parts.registry_service, self._server)
        pb_grpc.add_AdminServicer_to_server(self.parts.admin_service, self._server)
        creds = server_credentials(self.config.auth)      # [auth] tls_*: TLS or mutual TLS
        self.grpc_port = (self._server.add_secure_port(self.config.listen, creds) if creds is not None
                          else self._server.add_insecure_port(self.config.listen))
        if not self.grpc_port:
            raise OSError(f"cannot listen on {self.config.listen}")
        await self._server.start()
        if self.config.session_listen != "off":
            tls = server_ssl_context(self.config.auth)
            self.session_socket = SessionSocketServer(scheduler, auth, tls)
            listen = self.config.session_listen
            if listen == "auto":
                listen = f"{self.config.listen.rpartition(':')[0]}:0"
            self.session_port = await self.session_socket.start(listen)
            scheduler.endpoint = pb.SessionEndpoint(port=self.session_port, tls=tls is not None)

        await self.metaserver.start()
        self._runner, self.http_port = await start_http_site(
            self._http_app(), self.config.http_host, self.config.http_port)
        advertise = self.config.metaserver_host or self.config.http_host
        try:
            self.placer.metaserver_url = Metaserver.url_for(advertise, self.http_port)
        except ValueError:
            if self.config.pd_flow == "layerwise":
                raise
        self._sweeper = asyncio.create_task(self._sweep_loop())
        self._tasks.append(asyncio.create_task(self._orphan_loop()))
        if isinstance(store, SharedStore) and self._sync is not None:
            self._tasks += [asyncio.create_task(store.maintain(orphan=True)),
                            asyncio.create_task(self._sync.run())]
            if self.kv_snapshots is not None:
                self.kv_snapshots.start()      # stopped by kv_snapshots.close() in stop()
        admin = self.registry.admin
        if self._sync is None and not admin.persistent:
            log.warning("operators' changes (omni-ctl drain, undrain, weight, add, remove) are kept in memory "
                        "only and are lost when this control plane restarts: set [state] file "
                        "(--state-file) to keep them")
        elif admin.persistent:
            log.info("operators' changes are kept in %s (%d weights or drains, %d added, %d removed workers)",
                     admin.path, len(admin.overrides), len(admin.added), len(admin.removed))
        log.info("control plane: gRPC on port %d, session socket on port %d, HTTP on %s:%d, policy %s, %d workers",
                 self.grpc_port, self.session_port, self.config.http_host, self.http_port, self.config.policy,
                 len(self.config.workers))

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kv_snapshots is not None:
            await self.kv_snapshots.close()   # its writer, then a last snapshot before the index is dropped
        if self.session_socket is not None:
            await self.session_socket.close()
        if self._server:
            await self._server.stop(grace=1.0)
        if self._runner:
            await self._runner.cleanup()
        await self.metaserver.stop()
        await self.kv.stop()
        await self.health.stop()
        await self.registry.stop()
        if self.placer.queue is not None:
            await self.placer.queue.stop()
        if isinstance(self.store, ClosableStore):
            await self.store.close()
        if self.tracing is not None:     # flush the last spans, off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.config.max_request_age_s / 4))
            n = await self.lifecycle.sweep_stale()
            if n:
                log.warning("released %d stale request records (no lifecycle report arrived)", n)

    async def _orphan_loop(self) -> None:
        """Release orphaned requests whose grace has passed, whoever orphaned them. A session
        that ends here schedules its own release (services.py), but the requests of a replica
        that died are orphaned by another replica's store sweep (state/redis.py), where no
        session ends for them: without this they stayed charged until max_request_age_s."""
        period = min(max(self.config.session_grace_s / 2, 0.5), 30.0)
        while True:
            await asyncio.sleep(period)
            try:
                released = await self.lifecycle.release_orphans()
            except Exception as exc:  # noqa: BLE001 - the store is away: try again next period
                log.warning("releasing orphaned requests failed: %s: %s", type(exc).__name__, exc)
                continue
            if released:
                log.warning("released %d orphaned requests whose data plane did not come back", released)

    def _http_app(self) -> web.Application:
        app = web.Application()

        async def health(_: web.Request) -> web.Response:
            # Degraded still serves: placement goes on from memory while the store is away.
            store_ok = (not isinstance(self.store, ReportsAvailability) or self.store.available) and \
                (self._sync is None or self._sync.connected)
            return web.json_response({"status": "ok" if store_ok else "degraded", "state_store": store_ok})

        async def prom(_: web.Request) -> web.Response:
            specs = self.fleet.specs()
            loads = await self.store.loads([s.id for s in specs])
            body = metrics.render([self.fleet.view(s, loads[s.id]) for s in specs], self.placer.stats, self.kv,
                                  self.predictor, self.placer.queue, self.metaserver.calls)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app.router.add_get("/health", health)
        app.router.add_get("/metrics", prom)
        self.metaserver.add_routes(app)
        return app
