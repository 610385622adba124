"""gRPC servicers: translate between the wire API and the control plane's objects."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Sequence

import aiohttp
import grpc

from controlplane import auth, ownership, validate
from controlplane.lifecycle import Lifecycle
from controlplane.placement import Placer
from controlplane.health import HealthChecker
from controlplane.registry import WorkerRegistry, worker_id_for
from controlplane.state import SharedStore
from controlplane.workers import PB_TO_ROLE, ROLE_TO_PB, Health, Role, WorkerSpec, WorkerView, normalize_url
from omni_runtime.eager import start_eagerly
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

FLEET_PUSH_INTERVAL_S = 1.0
FLEET_PUSH_DEBOUNCE_S = 0.01   # after a change, this long for the next ones before a snapshot
SESSION_MAX_BATCH = 256   # answers per stream write when several are queued

_HEALTH_TO_PB = {Health.UNKNOWN: pb.STATUS_UNKNOWN, Health.HEALTHY: pb.STATUS_HEALTHY,
                 Health.UNHEALTHY: pb.STATUS_UNHEALTHY}


def worker_info(view: WorkerView, placements_total: int = 0, cached_blocks: int = 0, *,
                predicted_hit_blocks: int = 0, query_blocks: int = 0) -> pb.WorkerInfo:
    now = time.monotonic()
    spec, state, eng = view.spec, view.state, view.engine
    return pb.WorkerInfo(
        prefill_tokens_pending=view.load.prefill_tokens, predicted_hit_blocks=predicted_hit_blocks,
        query_blocks=query_blocks, engine_prefix_hits=eng.prefix_hits, engine_prefix_queries=eng.prefix_queries,
        kv_events=spec.kv_events, cached_blocks=cached_blocks,
        id=spec.id, url=spec.url, role=ROLE_TO_PB[spec.role], model=spec.model, weight=spec.weight,
        status=_HEALTH_TO_PB[state.health], draining=spec.draining, source=spec.source,
        placements_total=placements_total, failures_total=state.failures_total, last_error=state.last_error,
        circuit=state.circuit(now), ejected_for_s=max(state.ejected_until - now, 0.0),
        labels=dict(spec.labels), bootstrap_port=spec.bootstrap_port, engine=engine_facts(spec.labels),
        load=pb.WorkerLoad(
            inflight_requests=view.load.requests, inflight_tokens=view.load.tokens,
            engine_running=eng.running, engine_waiting=eng.waiting, engine_kv_usage=eng.kv_usage,
            metrics_age_s=(now - eng.updated_at) if eng.updated_at else -1.0))


def _message(item: pb.ControlPlaneMessage | pb.Placement) -> pb.ControlPlaneMessage:
    """A session's answer queue holds placements bare (``_handle``) and other messages whole."""
    if type(item) is pb.Placement:
        msg = pb.ControlPlaneMessage()
        msg.placement.CopyFrom(item)
        return msg
    return item   # type: ignore[return-value]


def _add_to(batch, item: pb.ControlPlaneMessage | pb.Placement) -> None:
    """Append ``item`` to a batch's repeated messages: a placement is copied once, straight
    into its slot (wrapping it in a message of its own, then the batch copying that, was
    two copies: 3.5 % of the control plane's CPU per placement)."""
    if type(item) is pb.Placement:
        batch.add().placement.CopyFrom(item)
    else:
        batch.append(item)


class _Waiting:
    """A session's messages whose handling is waiting (see ``SchedulerService._dispatch``)."""

    __slots__ = ("by_request", "tasks")

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()
        self.by_request: dict[str, asyncio.Task] = {}   # request id -> its latest waiting message

    def add(self, rid: str, task: asyncio.Task) -> None:
        self.tasks.add(task)
        if rid:
            self.by_request[rid] = task
        task.add_done_callback(lambda t: self._done(rid, t))

    def _done(self, rid: str, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if rid and self.by_request.get(rid) is task:
            del self.by_request[rid]


async def _after(before: asyncio.Task, handling) -> None:
    """``handling`` once ``before`` (the same request's previous message) is done, however it ended."""
    try:
        await asyncio.wait([before])
    except BaseException:
        handling.close()    # never started: closed, not left un-awaited
        raise
    await handling


class SchedulerService(pb_grpc.SchedulerServicer):
    """The data planes' API, and the control plane's side of the metaserver's port
    (``metaserver.ports.ControlPlanePort``: :meth:`place`, :meth:`report`)."""

    def __init__(self, placer: Placer, lifecycle: Lifecycle, registry: WorkerRegistry,
                 info: pb.SessionInfo | None = None, *, tracing=None) -> None:
        self.placer = placer
        self.lifecycle = lifecycle
        self.registry = registry
        self.info = info or pb.SessionInfo(pd_flow=placer.pd_flow)
        self._session_ids = itertools.count(1)
        self._tasks: set[asyncio.Future] = set()
        self._nodes: dict[str, str] = {}
        # Data planes may place entry legs themselves (SessionInfo.local_placement): the
        # policy needs no shared state, and no placement span is expected (tracing off).
        self.local_placement = placer.places_anywhere and tracing is None
        # Where the session socket is (set by the server once it listens); port 0: none.
        self.endpoint = pb.SessionEndpoint()
        self.tracing = tracing     # controlplane.otel.Tracing when otel_endpoint is set

    async def Session(self, request_iterator, context):
        """Serve one data plane: placements are answered, reports need no answer.

        Messages are read and handled in arrival order, so every placement answered at
        once sees the load charged by the one before. A message whose handling has to wait
        (a networked store's round trip) goes on in a task of its own while the next ones are
        handled (``omni_runtime.eager``): no placement waits for another's, or for a report's,
        round trips, and the messages of one request still take effect in order. A placement
        the queue stage holds is answered later, from its own task, without holding up the
        ones behind it. An error while handling one message is contained to it: the session,
        and every other request on it, goes on.
        """
        session = f"s{next(self._session_ids)}-{uuid.uuid4().hex}"   # unique across replicas
        out: asyncio.Queue = asyncio.Queue()
        held: set[asyncio.Task] = set()
        reader_batches: list[bool] = [False]   # set by the node's SessionOpen
        reader = asyncio.ensure_future(self._read(request_iterator, session, out, held, reader_batches))
        # The session ends when its reader does (the node closed the stream, the connection
        # died, or this handler ended and cancelled it), in a task of its own: gRPC cancels
        # this handler when the node is gone, perhaps while its finally awaits, perhaps while
        # it is suspended at a yield (closed only when garbage-collected), and a session that
        # never ends keeps its requests charged until max_request_age_s.
        ending = asyncio.ensure_future(self._end_session(session, reader, held))
        self._tasks.add(ending)
        ending.add_done_callback(self._tasks.discard)
        info = pb.SessionInfo()
        info.CopyFrom(self.info)
        info.batches = True
        info.local_placement = self.local_placement
        info.folds_first_token = True   # Lifecycle.report learns from a folded FIRST_TOKEN
        info.folds_placement = True     # _record reads a local placement's folded end
        yield pb.ControlPlaneMessage(info=info)
        fleet_watch = asyncio.ensure_future(self._push_fleet(out))
        held.add(fleet_watch)
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    break
                if out.empty() or not reader_batches[0]:
                    yield _message(msg)
                    continue
                # Answers queued while the last write was in flight: one write for all,
                # each placement copied once, into the batch (no message of its own first).
                batched = pb.ControlPlaneMessage()
                into, end, n = batched.batch.messages, False, 1
                _add_to(into, msg)
                while n < SESSION_MAX_BATCH and not out.empty():
                    nxt = out.get_nowait()
                    if nxt is None:
                        end = True
                        break
                    _add_to(into, nxt)
                    n += 1
                yield batched if n > 1 else _message(msg)
                if end:
                    break
        finally:
            reader.cancel()
            for task in held:
                task.cancel()
            await asyncio.shield(ending)

    async def _end_session(self, session: str, reader: asyncio.Future, held: set) -> None:
        """Once the session's reader is done: stop its other tasks, orphan its requests."""
        await asyncio.wait([reader])
        try:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            node = self._nodes.pop(session, "?")
            orphaned = await self.lifecycle.orphan_session(session)
            log.info("data plane %s disconnected (session %s); %d in-flight requests kept for %.0fs "
                     "for it to reconnect", node, session, orphaned, self.lifecycle.session_grace_s)
            if orphaned:
                self._schedule_orphan_release()
        except Exception:
            log.exception("ending session %s failed", session)

    async def _read(self, request_iterator, session: str, out: asyncio.Queue, held: set,
                    batches: list[bool] | None = None) -> None:
        waiting = _Waiting()
        try:
            async for msg in request_iterator:
                body = msg.WhichOneof("body")
                if body == "batch":
                    for one in msg.batch.messages:
                        body = one.WhichOneof("body")
                        if body == "open":   # what follows may be about the requests it claims: claimed first
                            await self._handle(one, body, session, out, held, batches)
                        else:
                            self._dispatch(one, body, session, out, held, batches, waiting)
                elif body == "open":
                    await self._handle(msg, body, session, out, held, batches)
                else:
                    self._dispatch(msg, body, session, out, held, batches, waiting)
            if waiting.tasks:    # the node is gone: its last reports still take effect
                await asyncio.gather(*waiting.tasks, return_exceptions=True)
        finally:
            out.put_nowait(None)

    def _dispatch(self, msg: pb.DataPlaneMessage, body: str | None, session: str, out: asyncio.Queue,
                  held: set, batches: list[bool] | None, waiting: _Waiting) -> None:
        """Handle one message (not an ``open``: ``_read`` awaits those) now; if it has to wait,
        let it wait in a task while the next ones are handled. A message about a request
        whose previous message is still waiting goes after it (a report never overtakes its
        placement, an end its settle). Not a coroutine, and a local placement's notice (one
        per request with local placement) started without ``_handle``'s: two coroutines
        less per message."""
        if body == "place":
            place = msg.place
            rid = place.request_id
            handling = (self._record(place, session) if place.placed_on else
                        self._handle(msg, body, session, out, held, batches))
        else:
            rid = msg.event.request_id if body == "event" else ""
            handling = self._handle(msg, body, session, out, held, batches)
        before = waiting.by_request.get(rid) if rid else None
        task = start_eagerly(handling if before is None else _after(before, handling))
        if task is not None:
            waiting.add(rid, task)
            held.add(task)
            task.add_done_callback(held.discard)

    async def _handle(self, msg: pb.DataPlaneMessage, body: str | None, session: str, out: asyncio.Queue,
                      held: set, batches: list[bool] | None) -> None:
        if body == "place":
            if msg.place.placed_on:   # placed by the data plane itself: recorded, not answered
                await self._record(msg.place, session)
                return
            answer = await self._place(msg.place, session)
            if isinstance(answer, pb.Placement):
                out.put_nowait(answer)   # wrapped once it is written (Session)
            else:
                task = asyncio.ensure_future(self._answer_later(msg.place, answer, out))
                held.add(task)
                task.add_done_callback(held.discard)
        elif body == "event":
            await self._report(msg.event)
        elif body == "open":
            node = self._nodes[session] = msg.open.node_id or "?"
            if batches is not None:
                batches[0] = msg.open.batches
            claimed = await self.lifecycle.claim(session, msg.open.live_requests)
            log.info("data plane %s connected (session %s, %d live requests claimed of %d)",
                     node, session, claimed, len(msg.open.live_requests))

    async def _push_fleet(self, out: asyncio.Queue) -> None:
        """Keep the data plane's list of routable workers current (its fallback, and what it
        places from itself with local placement): at once, then soon after every change (a
        drain, a weight, health, an ejection and its end), looked at every
        FLEET_PUSH_INTERVAL_S at the latest."""
        fleet = self.registry.fleet
        sent = -1
        change = fleet.changed()
        while True:
            fleet.routable("", Role.BOTH)   # (an ejection that ended rebuilds the index: a new version)
            version = fleet.version
            if version != sent:
                snapshot = pb.FleetSnapshot(workers=[
                    pb.KnownWorker(endpoint=pb.Endpoint(worker_id=s.id, url=s.url, role=ROLE_TO_PB[s.role],
                                                        bootstrap_port=s.bootstrap_port,
                                                        dp_size=s.dp_size if s.dp_size > 1 else 0),
                                   model=s.model, weight=s.weight,
                                   loras=[pb.LoraAdapter(name=n, path=p) for n, p in fleet.state(s.id).loras])
                    for s in fleet.routable_specs()])
                out.put_nowait(pb.ControlPlaneMessage(fleet=snapshot))
                sent = fleet.version
            await asyncio.wait([change], timeout=FLEET_PUSH_INTERVAL_S)
            if change.done():
                change = fleet.changed()
                await asyncio.sleep(FLEET_PUSH_DEBOUNCE_S)   # a burst of changes: one snapshot

    async def _answer_later(self, req: pb.PlaceRequest, waiting: asyncio.Future, out: asyncio.Queue) -> None:
        try:
            placement = await waiting
        except asyncio.CancelledError:
            if not waiting.cancelled():
                raise   # the session itself is closing
            placement = pb.Placement(seq=req.seq, request_id=req.request_id, error=pb.NO_HEALTHY_WORKER,
                                     error_message="the request left the placement queue")
        except Exception as exc:
            log.exception("held placement of %s failed", req.request_id)
            placement = self.placer.internal_error(req, exc)
        placement.seq = req.seq
        out.put_nowait(placement)

    async def _place(self, req: pb.PlaceRequest, session: str) -> pb.Placement | asyncio.Future:
        started = time.perf_counter()
        span = self.tracing.start(req) if self.tracing is not None else None
        try:
            answer = await self.placer.submit(req, session)
            self.placer.stats.latency.observe(time.perf_counter() - started)
        except Exception as exc:  # a bug must cost one placement, never the whole session
            log.exception("placement of %s failed", req.request_id)
            answer = self.placer.internal_error(req, exc)
        if span is not None:
            self.tracing.answered(span, answer)
        return answer

    async def _record(self, req: pb.PlaceRequest, session: str) -> None:
        try:
            if req.HasField("ended"):
                # It ended before the data plane wrote the notice: counted, never charged.
                record = await self.placer.settle(req, session)
                if record is not None:
                    self.lifecycle.settle(record, req.ended)
            else:
                await self.placer.record(req, session)
        except Exception:  # contained to this request, as a placement's failure is
            log.exception("recording the local placement of %s failed", req.request_id)

    async def _report(self, event: pb.LifecycleEvent) -> None:
        try:
            await self.lifecycle.report(event)
        except Exception:
            log.exception("lifecycle report for %s failed", event.request_id)

    def _schedule_orphan_release(self) -> None:
        # The grace period counts from now, after the session's requests were orphaned, and the
        # release waits for it by this clock (the store's): a timer that fires a little early
        # (uvloop's loop time is cached per turn, in whole milliseconds) would otherwise
        # release nothing, and nothing would try again.
        deadline = time.monotonic() + self.lifecycle.session_grace_s

        async def release() -> None:
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(left)
            released = await self.lifecycle.release_orphans()
            if released:
                log.warning("released %d requests whose data plane did not come back", released)

        task = asyncio.ensure_future(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def place(self, req: pb.PlaceRequest) -> pb.Placement:
        """One placement by the path every data plane's takes (the queue stage for an entry
        leg, the latency statistics, tracing, a bug contained to it), answered once decided."""
        answer = await self._place(req, "")
        return answer if isinstance(answer, pb.Placement) else await answer

    async def report(self, event: pb.LifecycleEvent) -> None:
        """A lifecycle report, as a data plane's (a failure is logged, never raised)."""
        await self._report(event)

    async def GetSessionEndpoint(self, request, context):
        return self.endpoint

    async def Place(self, request, context):
        return await self.place(request)

    async def Report(self, request, context):
        await self._report(request)
        return pb.Ack()

    async def ListModels(self, request, context):
        fleet = self.registry.fleet
        models: dict[str, pb.ModelInfo] = {}
        for spec in fleet.specs():
            if not spec.model:
                continue
            info = models.setdefault(spec.model, pb.ModelInfo(id=spec.model))
            info.workers += 1
            state = fleet.state(spec.id)
            if state.health is Health.HEALTHY and spec.role is not Role.DECODE:
                info.healthy_workers += 1
            if state.max_model_len > 0:   # the smallest: a prompt that fits it fits every worker
                info.max_model_len = min(info.max_model_len or state.max_model_len, state.max_model_len)
        return pb.ListModelsResponse(models=sorted(models.values(), key=lambda m: m.id))


def _spec_from_register(req: pb.RegisterRequest) -> dict:
    """Every value a registration or an operator's AddWorker brings, checked (ValueError)."""
    role = PB_TO_ROLE.get(req.role)
    if role is None:
        raise ValueError("role must be BOTH, PREFILL or DECODE")
    dp_size = validate.int_range(req.dp_size or 1, "dp_size", 1, 1024)
    return dict(url=validate.url(req.url), role=role, model=validate.text(req.model, "model", max_len=256),
                weight=validate.weight(req.weight) or None,     # None: keep the operator's, else 1
                worker_id=validate.worker_id(req.worker_id, "worker_id", allow_empty=True),
                labels={validate.text(k, "label key", max_len=128): validate.text(v, "label value", max_len=1024)
                        for k, v in req.labels.items()},
                bootstrap_port=validate.int_range(req.bootstrap_port, "bootstrap_port", 0, 65535),
                kv_events=validate.kv_endpoint(req.kv_events, "kv_events", dp_size),
                kv_replay=validate.kv_endpoint(req.kv_replay, "kv_replay", dp_size), dp_size=dp_size,
                heartbeat_ttl_s=(validate.positive_seconds(req.heartbeat_ttl_s, "heartbeat_ttl_s", max_s=86400)
                                 if req.heartbeat_ttl_s else 0.0))


# The engine plugin's EngineFacts, kept in the worker's labels under "engine." (so every
# state backend and replica has them) and shown again as WorkerInfo.engine.
_FACTS = ("block_size", "prefix_caching", "hash_algo", "hash_seed_set", "kv_capacity_tokens",
          "max_batched_tokens", "kv_connector", "kv_role", "engine_version")


def engine_facts(labels) -> pb.EngineFacts | None:
    if "engine.block_size" not in labels:
        return None
    out = pb.EngineFacts()
    for name in _FACTS:
        value = labels.get("engine." + name, "")
        kind = type(getattr(out, name))
        try:
            setattr(out, name, value == "true" if kind is bool else kind(value or 0) if kind is int else value)
        except ValueError:
            pass
    return out


def hashing_mismatch(facts: pb.EngineFacts, kv: pb.KVHashConfig | None) -> str:
    """Why an engine's prefix-cache hashing cannot match the control plane's [kv_cache]; ""."""
    if kv is None or not kv.enabled or not facts.block_size:
        return ""
    wrong = []
    if facts.block_size != kv.block_size:
        wrong.append(f"block size {facts.block_size} (control plane [kv_cache] block_size = {kv.block_size})")
    if facts.hash_algo and facts.hash_algo != kv.algo:
        wrong.append(f"hash algorithm {facts.hash_algo} ([kv_cache] hash_algo = {kv.algo!r})")
    if facts.hash_seed_set != kv.seed_set or (kv.seed_set and facts.hash_seed != kv.seed):
        engine = "PYTHONHASHSEED set" if facts.hash_seed_set else "PYTHONHASHSEED unset"
        wrong.append(f"{engine} ([kv_cache] hash_seed {'set' if kv.seed_set else 'unset'}"
                     f"{', to another value' if facts.hash_seed_set and kv.seed_set else ''})")
    if not wrong:
        return ""
    return ("prefix-cache hashing cannot match this control plane's, whose policy uses the prefix cache: "
            "the engine has " + "; ".join(wrong) + ". Start the engine with the control plane's "
            "--block-size, --prefix-caching-hash-algo and PYTHONHASHSEED, or change [kv_cache]")


async def _keep_fences(store, shared: bool, admin, *, fenced: str = "", lifted: Sequence[str] = ()) -> None:
    """Write removal fences where every replica (Redis) or the next start (state file) sees them."""
    if shared:
        try:
            if fenced:
                await store.put_fence(fenced, admin.removed[fenced])
            for wid in lifted:
                await store.drop_fence(wid)
        except Exception as exc:  # noqa: BLE001 - the store is away: this replica's fence holds
            log.warning("cannot write the removal fence of %s to the store (%s): only this replica has it",
                        fenced or ", ".join(lifted), exc)
    elif admin.persistent:
        await asyncio.to_thread(admin.save)


class RegistryService(pb_grpc.RegistryServicer):
    """Engine plugins' calls. Each may touch only the worker id its registration owns
    (controlplane/ownership.py); configured and operators' workers are refused."""

    def __init__(self, registry: WorkerRegistry, kv_hash: pb.KVHashConfig | None = None) -> None:
        self.registry = registry
        self.kv_hash = kv_hash           # the control plane's [kv_cache], to check engine plugins against
        self._registering = asyncio.Lock()   # an ownership check and its write, together

    async def _refuse(self, context, refusal: ownership.Refusal, what: str) -> None:
        log.warning("registry: %s refused (%s), by %s", what, refusal.code.name, auth.caller(context))
        await context.abort(refusal.code, refusal.message)

    async def Register(self, request, context):
        try:
            spec = _spec_from_register(request)
            key = ownership.check_key(request.owner_key)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.HasField("engine"):
            why = hashing_mismatch(request.engine, self.kv_hash)
            if why:
                log.warning("registry: refused %s (%s): %s", request.url, request.model or "?", why)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
            facts = {f.name: v for f, v in request.engine.ListFields() if f.name != "hash_seed"}
            facts.setdefault("block_size", 0)
            spec["labels"].update({f"engine.{k}": str(v).lower() if isinstance(v, bool) else str(v)
                                   for k, v in facts.items()})
        spec["heartbeat_ttl_s"] = spec["heartbeat_ttl_s"] or self.registry.heartbeat_ttl_s
        wid = spec["worker_id"] or worker_id_for(normalize_url(spec["url"]), spec["role"])
        admin = self.registry.admin
        store = self.registry.store
        shared = isinstance(store, SharedStore)
        if shared:   # removals made through any replica (Redis); while it is away, this replica's
            try:
                admin.removed = await store.fences()
            except Exception as exc:  # noqa: BLE001 - StoreUnavailable and the like
                log.warning("registry: cannot read the removal fences from the store (%s): this replica's "
                            "are used", exc)
        fenced_id, fenced = admin.fenced(wid, normalize_url(spec["url"]), ownership.key_hash(key))
        if fenced:   # omni-ctl remove holds: the plugin's next heartbeat (known=false) lands here
            log.warning("registry: refused %s (%s): %s", request.url, wid, fenced)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, fenced)
        if fenced_id:   # a new engine process (another owner key): the deliberate way back
            admin.lift(fenced_id)
            await _keep_fences(store, shared, admin, lifted=[fenced_id])
        # A re-registration keeps the operator's weight and drain; the engine's weight is a default.
        spec["default_weight"] = spec.pop("weight") or 1.0
        who = auth.principal.get()
        async with self._registering:
            refusal = ownership.may_register(self.registry.fleet.get(wid), key, who, normalize_url(spec["url"]))
            if refusal is not None:
                await self._refuse(context, refusal, f"registration of {wid} ({spec['url']})")
            spec["worker_id"] = wid
            worker = await self.registry.add(**spec, source=ownership.REGISTRY_SOURCE, owner=who,
                                             owner_key=ownership.key_hash(key) if key else "")
        return pb.RegisterResponse(worker_id=worker.id, heartbeat_interval_s=self.registry.heartbeat_interval_s,
                                   owner_key=key)

    async def Heartbeat(self, request, context):
        spec = self.registry.fleet.get(request.worker_id)
        if spec is None:
            return pb.HeartbeatResponse(known=False)
        refusal = ownership.may_change(spec, request.owner_key, auth.principal.get(), "a heartbeat")
        if refusal is not None:
            await self._refuse(context, refusal, f"heartbeat for {spec.id}")
        known = self.registry.heartbeat(request.worker_id, request.running, request.waiting)
        return pb.HeartbeatResponse(known=known)

    async def Deregister(self, request, context):
        spec = self.registry.fleet.get(request.worker_id)
        if spec is not None:
            refusal = ownership.may_change(spec, request.owner_key, auth.principal.get(), "deregistration")
            if refusal is not None:
                await self._refuse(context, refusal, f"deregistration of {spec.id}")
            await self.registry.remove(request.worker_id)
        return pb.Ack()


class AdminService(pb_grpc.AdminServicer):
    """omni-ctl's API. Every change is logged with who made it (peer address, token name)."""

    def __init__(self, registry: WorkerRegistry, placer: Placer, *, health: HealthChecker | None = None,
                 info: pb.SessionInfo | None = None, check_timeout_s: float = 3.0) -> None:
        self.registry = registry
        self.placer = placer
        self.health = health                 # HealthChecker: AddWorker runs the first check at once
        self.info = info or pb.SessionInfo(pd_flow=placer.pd_flow)
        self.check_timeout_s = check_timeout_s
        # Where operators' changes are kept: a shared store (Redis) keeps the specs itself.
        self.shared_store = isinstance(placer.store, SharedStore)

    async def _keep(self) -> str:
        """Write the operators' changes to the state file (off the event loop); where they are
        kept, for the answer: "file PATH", "redis", or "" (memory only, lost at restart)."""
        admin = self.registry.admin
        if self.shared_store:
            return "redis"
        if not admin.persistent:
            return ""
        try:
            await asyncio.to_thread(admin.save)
        except OSError as exc:
            log.error("admin: cannot write the state file %s: %s: the change holds until a restart",
                      admin.path, exc)
            return ""
        return admin.describe()

    def _info_of(self, view: WorkerView, cached: int = 0) -> pb.WorkerInfo:
        st, wid = self.placer.stats, view.id
        return worker_info(view, self.registry.fleet.placements[wid], cached,
                           predicted_hit_blocks=st.predicted_hit_blocks.get(wid, 0),
                           query_blocks=st.query_blocks.get(wid, 0))

    async def _info(self, worker_id: str) -> pb.WorkerInfo:
        fleet = self.registry.fleet
        spec = fleet.get(worker_id)
        assert spec is not None, f"no worker {worker_id}"   # asked for a worker just found or changed
        load = (await self.placer.store.loads([worker_id]))[worker_id]
        cached = self.placer.kv.cached_blocks([worker_id]).get(worker_id, 0) if self.placer.kv else 0
        return self._info_of(fleet.view(spec, load), cached)

    async def _update(self, worker_id: str, context, **changes) -> pb.WorkerResponse:
        spec = await self.registry.update(worker_id, **changes)
        if spec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {validate.show(worker_id)}")
        assert spec is not None   # abort raised
        self.registry.admin.set_override(spec)
        kept = await self._keep()
        info = await self._info(worker_id)
        log.info("admin: worker %s: %s (%d in flight), by %s", worker_id,
                 ", ".join(f"{k}={v}" for k, v in changes.items()), info.load.inflight_requests,
                 auth.caller(context))
        return pb.WorkerResponse(worker=info, persistence=kept)

    async def ListWorkers(self, request, context):
        fleet = self.registry.fleet
        specs = sorted((s for s in fleet.specs() if not request.model or s.model == request.model),
                       key=lambda s: s.id)
        loads = await self.placer.store.loads([s.id for s in specs])
        cached = self.placer.kv.cached_blocks() if self.placer.kv else {}
        return pb.ListWorkersResponse(workers=[self._info_of(fleet.view(s, loads[s.id]), cached.get(s.id, 0))
                                               for s in specs],
                                      policy=self.placer.profile.name)

    async def AddWorker(self, request, context):
        """Add an engine, or (replace) overwrite one. A replace keeps the worker's id (when none
        is given, the one of the worker with this URL) and every field the request leaves
        empty (model, weight, bootstrap port, KV-event endpoints, labels, role, drain).
        With require_check, an engine that fails the first check is not added at all."""
        fleet = self.registry.fleet
        try:
            url = normalize_url(validate.url(request.url))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        role = PB_TO_ROLE.get(request.role)
        same_url = [s for s in fleet.specs() if s.url.lower() == url.lower()]
        base = fleet.get(request.worker_id) if request.worker_id else None
        if base is None and not request.worker_id and request.replace and same_url:
            # the worker with this URL (of this role, if one is given): its id is kept
            base = next((s for s in same_url if role is None or s.role is role), same_url[0])
        req = pb.RegisterRequest()
        req.CopyFrom(request)
        if base is not None and request.replace:     # fields not given: the worker's
            req.role = req.role or ROLE_TO_PB[base.role]
            req.model = req.model or base.model
            req.bootstrap_port = req.bootstrap_port or base.bootstrap_port
            req.dp_size = req.dp_size or base.dp_size
            if not req.kv_events:
                req.kv_events, req.kv_replay = base.kv_events, req.kv_replay or base.kv_replay
            if not req.labels:
                req.labels.update(base.labels)
            req.worker_id = base.id
        req.role = req.role or pb.ROLE_BOTH
        try:
            spec = _spec_from_register(req)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        wid = spec["worker_id"] or worker_id_for(url, spec["role"])
        same_id = fleet.get(wid)
        others = [s for s in same_url if s.id != wid]
        conflicts = ([same_id] if same_id is not None else []) + others
        if conflicts and not request.replace:
            what = "; ".join(f"worker {s.id} ({s.url}, {s.role.value}, source {s.source})" for s in conflicts)
            log.warning("admin: add %s (%s) refused: %s exists, by %s", wid, url, what, auth.caller(context))
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"{what} already exists: add with replace (omni-ctl add --replace) to overwrite it")
        if request.require_check:
            code, why = await self._probe(url, spec["model"], spec["role"])
            if code is not None:
                log.warning("admin: add %s (%s) refused: first check failed: %s, by %s", wid, url, why,
                            auth.caller(context))
                await context.abort(code, f"{url} failed its first check: {why}; nothing was changed "
                                          f"(omni-ctl add --force adds it anyway, unplaced until a check passes)")
        for s in others:
            await self.registry.remove(s.id)
        draining = None
        if same_id is not None:
            if spec["weight"] is None:
                spec["weight"] = same_id.weight       # keep the operator's weight (and drain)
            draining = same_id.draining
            if same_id.url != url or same_id.role is not spec["role"]:
                await self.registry.remove(wid)       # another engine: start from a fresh health state
        spec["worker_id"] = wid
        spec["weight"] = spec["weight"] or 1.0
        added = await self.registry.add(**spec, source="admin", draining=draining)
        lifted = self.registry.admin.note_added(added)
        if lifted and self.shared_store:
            await _keep_fences(self.placer.store, True, self.registry.admin, lifted=lifted)
        kept = await self._keep()
        log.info("admin: worker %s %s (%s, %s, weight %g), by %s", added.id,
                 "replaced" if conflicts else "added", added.url, added.role.value, added.weight,
                 auth.caller(context))
        checked, error = await self._first_check(added)
        if error:
            log.warning("admin: worker %s: first check failed: %s (no placements until a check passes)",
                        added.id, error)
        return pb.WorkerResponse(worker=await self._info(added.id), checked=checked, check_error=error,
                                 persistence=kept)

    async def _probe(self, url: str, model: str, role: Role) -> tuple[grpc.StatusCode | None, str]:
        """The first check before anything changes: (None, "") when the engine answers /health
        (and lists ``model``, and runs as ``role`` where it says); else the status to refuse with."""
        session = self.health.session if self.health is not None else None
        if session is None:
            return None, ""
        try:
            async with asyncio.timeout(self.check_timeout_s):
                async with session.get(url + "/health") as resp:
                    await resp.read()
                    if resp.status != 200:
                        return grpc.StatusCode.UNAVAILABLE, f"/health returned {resp.status}"
        except TimeoutError:
            return grpc.StatusCode.UNAVAILABLE, f"no answer from /health within {self.check_timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - aiohttp client errors, OSError
            return grpc.StatusCode.UNAVAILABLE, f"/health: {type(exc).__name__}: {exc}"
        probe = WorkerSpec(id="probe", url=url, role=role, model=model)
        why = await self._model_error(probe) if model else ""
        why = why or await self._role_mismatch(probe)
        return (grpc.StatusCode.FAILED_PRECONDITION, why) if why else (None, "")

    async def _model_error(self, spec: WorkerSpec) -> str:
        """Why /v1/models does not list the worker's model; "" (called once the health
        checker has its session)."""
        try:
            async with self._http().get(spec.url + "/v1/models") as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
            if data is None:
                return f"/v1/models returned {resp.status}"
            served = [str(m.get("id")) for m in data.get("data") or [] if isinstance(m, dict)]
            if spec.model not in served:
                return (f"/v1/models does not list model {spec.model!r} "
                        f"(it lists {', '.join(served[:5]) or 'none'})")
        except Exception as exc:  # noqa: BLE001 - aiohttp client errors, timeouts, bad JSON
            return f"/v1/models: {type(exc).__name__}: {exc}"
        return ""

    async def _first_check(self, spec: WorkerSpec) -> tuple[bool, str]:
        """Health (and model discovery) at once, and whether /v1/models lists the model."""
        health = self.health
        if health is None or health.session is None:
            return False, ""
        try:
            await asyncio.wait_for(health.check(spec), self.check_timeout_s)
        except TimeoutError:
            return False, ""
        except Exception as exc:  # noqa: BLE001 - the add itself has succeeded
            return True, f"{type(exc).__name__}: {exc}"
        fleet = self.registry.fleet
        state = fleet.state(spec.id)
        if state.health is not Health.HEALTHY:
            return True, state.last_error or "unhealthy"
        current = fleet.get(spec.id)
        if current is not None and spec.model:
            why = await self._model_error(current)
            if why:
                return True, why
        if current is not None:
            mismatch = await self._role_mismatch(current)
            if mismatch:
                return True, mismatch
        return True, ""

    async def _role_mismatch(self, spec: WorkerSpec) -> str:
        """SGLang says its PD role (``/get_server_info`` ``disaggregation_mode``); vLLM does not
        expose one, so nothing is checked there."""
        try:
            async with self._http().get(spec.url + "/get_server_info") as resp:
                if resp.status != 200:
                    return ""
                info = await resp.json(content_type=None)
        except Exception:  # noqa: BLE001 - best effort: most engines have no such endpoint
            return ""
        mode = info.get("disaggregation_mode") if isinstance(info, dict) else None
        engine_role = {"prefill": Role.PREFILL, "decode": Role.DECODE, "null": Role.BOTH}.get(str(mode))
        if engine_role is not None and engine_role is not spec.role:
            return f"the engine runs as {engine_role.value} (disaggregation_mode={mode}), not {spec.role.value}"
        return ""

    def _http(self) -> aiohttp.ClientSession:
        session = self.health.session if self.health is not None else None
        if session is None:
            raise RuntimeError("the health checker has not started")
        return session

    async def Drain(self, request, context):
        return await self._update(request.worker_id, context, draining=True)

    async def Undrain(self, request, context):
        return await self._update(request.worker_id, context, draining=False)

    async def SetWeight(self, request, context):
        try:
            weight = validate.weight(request.weight)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await self._update(request.worker_id, context, weight=weight)

    async def RemoveWorker(self, request, context):
        """Forget a worker and fence it: its plugin's next heartbeat is answered known=false and
        the registration that follows is refused (FAILED_PRECONDITION), until an operator adds
        it again; a configured worker stays out after a restart (with a state file)."""
        spec = self.registry.fleet.get(request.worker_id)
        info = await self._info(request.worker_id) if spec is not None else None
        if spec is None or not await self.registry.remove(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {validate.show(request.worker_id)}")
        self.registry.admin.note_removed(spec)
        if self.shared_store:
            await _keep_fences(self.placer.store, True, self.registry.admin, fenced=spec.id)
        kept = await self._keep()
        log.info("admin: worker %s removed (source %s, fenced), by %s", request.worker_id, spec.source,
                 auth.caller(context))
        return pb.WorkerResponse(worker=info, persistence=kept)

    async def Explain(self, request, context):
        if request.leg == pb.LEG_UNSPECIFIED:
            request.leg = pb.LEG_ENTRY
        return await self.placer.place(request, dry_run=True)

    async def Stats(self, request, context):
        fleet, st = self.registry.fleet, self.placer.stats
        by_leg: dict[str, int] = {}
        by_worker: dict[str, int] = {}
        for (worker_id, leg), n in st.placed.items():
            by_leg[leg] = by_leg.get(leg, 0) + n
            by_worker[worker_id] = by_worker.get(worker_id, 0) + n
        events = []
        kv = self.placer.kv
        if kv is not None:
            counters = kv.counters()
            for spec in sorted(fleet.specs(), key=lambda s: s.id):
                events.append(pb.WorkerEvents(worker_id=spec.id, counters=counters.get(spec.id, {}),
                                              last_seq=kv.last_event_seq(spec.id), exact=kv.tracked_exactly(spec),
                                              untracked_reason=kv.untracked.get(spec.id, "")))
        queue = self.placer.queue
        lat = st.latency
        return pb.StatsResponse(policy=self.placer.profile.name, placements_by_leg=by_leg,
                                placements_by_worker=by_worker, errors={str(k): v for k, v in st.errors.items()},
                                sessions={str(k): v for k, v in st.sessions.items()},
                                queue_depth=len(queue) if queue is not None else -1,
                                kv_hash=self.info.kv_hash, events=events, workers=len(fleet),
                                routable_workers=len(fleet.routable_specs()),
                                placement_count=lat.total, placement_seconds_sum=lat.sum_s)
