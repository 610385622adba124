"""The data plane's side of the control-plane session: one bidirectional stream.

The stream is the control plane's session socket (``dataplane.session_socket``: the same
messages, length-prefixed on plain TCP, far less CPU per message) when it has one, and
the gRPC ``Session`` call otherwise. Placements ride the stream as request/answer pairs
matched by ``seq``; lifecycle reports ride it one way. A data plane may know several
control-plane replicas: it holds one session at a time, starting with the replica its node id
hashes to (so a fleet of data
planes spreads over them) and moving to the next when that one stops answering.

If the stream breaks, waiting placements are asked again on the next session. Requests
already placed keep streaming: on reconnect the node names them
(``SessionOpen.live_requests``) so the control plane keeps their load charged, and the
reports that could not be sent meanwhile go out first. When no replica has answered for
``fallback_after_s``, placements are made locally (``dataplane.fallback``) from the last
list of routable workers a control plane sent, until a session is back.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import ssl
import sys
import time
import zlib

import grpc
from google.protobuf.message import DecodeError

from dataplane.fallback import FallbackPlacer
from dataplane.session_socket import SessionRefused, SocketCall
from dataplane.session_socket import connect as connect_socket
from omni_runtime.retry import Retry
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from protos.framing import FrameError, split_target
from protos.options import CLIENT_KEEPALIVE_MS, MAX_OPENING_FRAME_BYTES, client_options

log = logging.getLogger(__name__)


_ENDINGS = frozenset({pb.EVENT_FINISHED, pb.EVENT_FAILED, pb.EVENT_CANCELLED})
# Messages queued while the previous stream write was in flight go out as one batch (one
# gRPC write costs far more CPU than the message in it); at most this many per write.
MAX_BATCH = 256
# Reports alone (no placement among them) wait this long for company before they are
# written: at low load the next request's placement, or the other reports of a request,
# then share the write. A placement never waits.
REPORT_HOLD_S = 0.002
# With local placement every message is one way (notices of placements made here and
# reports): nothing waits on them but the control plane's counts, so they wait longer for
# company, in fewer and larger writes (each write on loopback costs both processes a wake-up).
LOCAL_HOLD_S = 0.010
# The notice of a local placement waits for its request's end this long at most (then it is
# written, and the end follows in its own report): a request that ends sooner is told in one
# message (PlaceRequest.ended), and the control plane counts it without charging its ledger.
# A request is in the control plane's in-flight counts from this long after it started.
NOTICE_HOLD_S = 0.050
# A control plane whose session socket could not be reached is asked on gRPC meanwhile.
SOCKET_RETRY_S = 60.0
# The pause before connecting again (omni_runtime.retry: full jitter, 50 ms doubling to 1 s):
# after every replica failed to answer, longer each round; after a session ended, longer
# each time one ends within RECONNECT.max_s of its start (a control plane refusing us).
RECONNECT = Retry(attempts=sys.maxsize, base_s=0.05, max_s=1.0)


class ControlPlaneUnavailable(Exception):
    pass


class _Outbox(asyncio.Queue):
    """The session's outgoing messages: an unbounded ``asyncio.Queue`` whose ``put_nowait``
    is one call (the base class's is four Python calls, and it counts unfinished tasks for a
    ``join()`` nobody makes); a request puts one or two messages on it."""

    def put_nowait(self, item) -> None:
        # (asyncio.Queue's deque of items and of waiting getters)
        self._queue.append(item)      # type: ignore[attr-defined]
        getters = self._getters       # type: ignore[attr-defined]
        while getters:
            getter = getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return


def _drain(queue: asyncio.Queue, batch: list) -> bool:
    """Move what is queued into ``batch`` (up to MAX_BATCH); True when the end mark came."""
    while len(batch) < MAX_BATCH and not queue.empty():
        nxt = queue.get_nowait()
        if nxt is None:
            return True
        batch.append(nxt)
    return False


def _asks(msg: pb.DataPlaneMessage) -> bool:
    """A placement that waits for its answer (not a local placement's notice)."""
    return msg.HasField("place") and not msg.place.placed_on


def _report_like(msg: pb.DataPlaneMessage) -> bool:
    """A one-way message: a lifecycle report, or the notice of a local placement."""
    body = msg.WhichOneof("body")
    return body == "event" or (body == "place" and bool(msg.place.placed_on))


def _wake(fut: asyncio.Future | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def parse_targets(targets: str | list[str]) -> list[str]:
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = [t.strip() for t in items if t.strip()]
    if not out:
        raise ValueError("at least one control-plane address is needed")
    return out


class PlacementClient:
    def __init__(self, targets: str | list[str], node_id: str, *, timeout_s: float = 5.0,
                 keepalive_ms: int = CLIENT_KEEPALIVE_MS, max_buffered_reports: int = 100_000,
                 connect_timeout_s: float = 1.0, fallback_after_s: float = 1.0, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None,
                 ssl_context: ssl.SSLContext | None = None, session_socket: bool = True) -> None:
        self._credentials = credentials      # TLS to the control plane; None: plaintext
        self._ssl_context = ssl_context      # the same TLS, for the session socket
        self._use_socket = session_socket    # False: sessions on the gRPC stream only
        self._token = token
        # target -> when to try its session socket again after it could not be reached
        self._socket_retry_at: dict[str, float] = {}
        self.transport = ""                  # "socket" or "grpc": the current session's
        self.targets = parse_targets(targets)
        # the control plane's dataplane token ([auth] dataplane_tokens), when it asks for one
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.fallback_after_s = fallback_after_s
        self._keepalive_ms = keepalive_ms
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._first = zlib.crc32(node_id.encode()) % len(self.targets)
        self.target = self.targets[self._first]
        self._stub = pb_grpc.SchedulerStub(self._channel(self.target))
        # Requests placed through this node whose ending has not been reported yet.
        self._live: set[str] = set()
        # Reports made while no session was up, sent first on the next one.
        self._unsent: collections.deque[pb.DataPlaneMessage] = collections.deque(maxlen=max_buffered_reports)
        self.sessions_started = 0
        self.fleet_updates = 0         # FleetSnapshots received
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        # When each pending placement gives up (loop time), swept every _sweep_s: a timeout
        # fires up to that much late (50 ms of the default 5 s).
        self._due: dict[int, float] = {}
        self._sweep_s = min(0.05, timeout_s / 4)
        self._sweeper: asyncio.TimerHandle | None = None
        self._queue: asyncio.Queue | None = None
        self._connected = asyncio.Event()
        self._down_since = time.monotonic()
        self._task: asyncio.Task | None = None
        self._call: grpc.aio.StreamStreamCall | SocketCall | None = None
        self._closing = False
        self._in_fallback = False
        self._cp_batches = False
        # The current session's control plane lets this node place entry legs itself
        # (SessionInfo.local_placement); False while no session is up.
        self._local = False
        # The control plane reads a FIRST_TOKEN folded into its FINISHED (report()), and the
        # FIRST_TOKEN reports queued or held but not written yet, by request id.
        self._folds = False
        self._first_unsent: dict[str, pb.DataPlaneMessage] = {}
        # The control plane reads a local placement's end folded into its notice
        # (SessionInfo.folds_placement, with folds_first_token): the notices held back for
        # their request's end (NOTICE_HOLD_S), oldest first, with when each was made, and
        # the FIRST_TOKEN reports held with them, by request id.
        self._folds_place = False
        self._notices: dict[str, tuple[pb.DataPlaneMessage, float]] = {}
        self._held_firsts: dict[str, pb.LifecycleEvent] = {}
        self._notice_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holding: list | None = None    # reports held for company by _outgoing
        self._hold: asyncio.Future | None = None   # what _outgoing waits on while it holds them
        self.fallback = FallbackPlacer()
        # What the control plane told us about this deployment at session start.
        self.info = pb.SessionInfo()

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = (
                grpc.aio.secure_channel(target, self._credentials, options=client_options(self._keepalive_ms))
                if self._credentials is not None else
                grpc.aio.insecure_channel(target, options=client_options(self._keepalive_ms)))
        return channel

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def live_requests(self) -> int:
        return len(self._live)

    def drop_session(self) -> None:
        """End the current session as a network fault would (tests, and operators'
        "reconnect now"); the client reconnects by itself."""
        if self._call is not None:
            self._call.cancel()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._notice_timer is not None:
            self._notice_timer.cancel()
        self._release_notices(every=True)
        if self._queue is not None:
            self._queue.put_nowait(None)   # ends the stream after what is queued (held reports too)
            _wake(self._hold)
        if self._task is not None:
            if self._connected.is_set():
                # Let the last reports go out: the control plane releases their load now,
                # not after the session's grace period.
                await asyncio.wait([self._task], timeout=1.0)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    # ------------------------------------------------------------------ placements and reports

    async def place(self, req: pb.PlaceRequest | pb.DataPlaneMessage) -> pb.Placement:
        """Ask for a placement: from the control plane, asked again on the next session if
        the stream breaks meanwhile, or locally when none has answered for a while.

        ``req`` may come as the ``place`` of a session message already (``placing.place``
        builds it there): it is then sent as it is, not copied into one."""
        out = req if isinstance(req, pb.DataPlaneMessage) else pb.DataPlaneMessage(place=req)
        req = out.place                  # seq is set on the message that is sent
        if self._local:
            local = self.place_here(out)
            if local is not None:
                return local
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            remaining = deadline - loop.time()
            if not self._connected.is_set():
                grace = self.fallback_after_s - (time.monotonic() - self._down_since)
                if self.fallback.known and grace <= 0:
                    return self._place_locally(req)
                wait = min(remaining, grace) if self.fallback.known else remaining
                if wait <= 0 or not await self.wait_connected(wait):
                    if self.fallback.known:
                        continue      # the grace is over: place locally on the next turn
                    raise ControlPlaneUnavailable(f"no control plane reachable ({', '.join(self.targets)})")
                remaining = deadline - loop.time()
            seq = next(self._seq)
            req.seq = seq
            fut = loop.create_future()
            self._pending[seq] = fut
            assert self._queue is not None
            self._queue.put_nowait(out)
            _wake(self._hold)        # held reports leave with it
            # Not wait_for, nor a timer per placement: one sweep over the pending ones fails
            # those past their deadline (no task, timeout scope or timer handle per request).
            self._due[seq] = loop.time() + max(remaining, 0.001)
            if self._sweeper is None:
                self._sweeper = loop.call_later(self._sweep_s, self._sweep)
            try:
                placement = await fut
                if not placement.error:
                    self._live.add(req.request_id)
                return placement
            except asyncio.CancelledError:
                # The client went away while the placement was pending (perhaps held in the
                # control plane's queue): tell the control plane, so it leaves the queue now.
                self.report(pb.LifecycleEvent(request_id=req.request_id, kind=pb.EVENT_CANCELLED))
                raise
            except ControlPlaneUnavailable:
                continue              # the session broke while we waited: ask the next one
            except TimeoutError:
                self.report(pb.LifecycleEvent(request_id=req.request_id, kind=pb.EVENT_CANCELLED))
                raise ControlPlaneUnavailable(f"no placement from {self.target} within {self.timeout_s}s") from None
            finally:
                self._due.pop(seq, None)
                self._pending.pop(seq, None)

    def place_here(self, out: pb.DataPlaneMessage) -> pb.Placement | None:
        """The placement of ``out``'s entry leg made here, when the control plane's policy
        needs no shared state (``SessionInfo.local_placement``; see ``dataplane.fallback``),
        the control plane told with the next batch of reports (no round trip); else None:
        ask it (:meth:`place`). Not a coroutine: the common case awaits nothing."""
        req = out.place
        queue = self._queue
        if not self._local or queue is None or req.leg != pb.LEG_ENTRY or req.explain:
            return None
        local = self.fallback.place_local(req)   # (marks req.placed_on)
        if local is not None:
            self._live.add(req.request_id)
            loop = self._loop
            if self._folds_place and loop is not None and not req.exclude_workers:   # (never a retry's)
                self._notices[req.request_id] = (out, loop.time())   # held for the request's end
                if self._notice_timer is None:
                    self._notice_timer = loop.call_later(NOTICE_HOLD_S, self._release_notices)
            else:
                queue.put_nowait(out)
        return local

    def _release_notices(self, every: bool = False) -> None:
        """Queue the held notices whose time is up (``every``: all of them), each followed by
        its held FIRST_TOKEN; again when the next one's time is up."""
        self._notice_timer = None
        notices, queue, loop = self._notices, self._queue, self._loop
        if not notices or queue is None or loop is None:
            return
        due = loop.time() - NOTICE_HOLD_S
        for rid, (msg, made) in list(notices.items()):
            if made > due and not every:
                self._notice_timer = loop.call_later(made - due, self._release_notices)
                return
            del notices[rid]
            self._release(rid, msg)

    def _release(self, rid: str, notice: pb.DataPlaneMessage) -> None:
        """Queue a held notice as it stands, then the FIRST_TOKEN held with it."""
        assert self._queue is not None
        self._queue.put_nowait(notice)
        event = self._held_firsts.pop(rid, None) if self._held_firsts else None
        if event is not None:
            first = pb.DataPlaneMessage(event=event)
            self._queue.put_nowait(first)
            self._first_unsent[rid] = first

    def _sweep(self) -> None:
        """Fail the placements whose deadline passed; again in ``_sweep_s`` while any wait."""
        self._sweeper = None
        if not self._due:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for seq, due in list(self._due.items()):
            if due <= now:
                del self._due[seq]
                fut = self._pending.get(seq)
                if fut is not None:
                    _expire(fut)
        if self._due and not self._closing:
            self._sweeper = loop.call_later(self._sweep_s, self._sweep)

    def _place_locally(self, req: pb.PlaceRequest) -> pb.Placement:
        if not self._in_fallback:
            self._in_fallback = True
            log.warning("no control plane has answered for %.1fs: placing locally, round robin over %d last "
                        "known workers, until one is back", self.fallback_after_s, self.fallback.known)
        return self.fallback.place(req, self.info.pd_flow or pb.FLOW_SEQUENTIAL)

    def report(self, event: pb.LifecycleEvent) -> None:
        """Fire and forget; kept for the next session while none is up (bounded).

        A FINISHED whose request's FIRST_TOKEN is still waiting to be written (held for
        company, or queued) takes that report's place instead of following it, marked
        ``first_token``: one message for the two, when the control plane reads it so
        (``SessionInfo.folds_first_token``). A short streamed answer usually ends within
        the hold.

        Likewise a request placed here whose notice is still held for its end
        (``NOTICE_HOLD_S``) ends in that notice (``PlaceRequest.ended``,
        ``SessionInfo.folds_placement``), its FIRST_TOKEN folded in too: the control plane
        counts the request without ever charging its ledger. Any other report (a failed leg,
        an end that is not FINISHED after a first token) releases the notice first, and the
        reports follow it as they are."""
        kind = event.kind
        rid = event.request_id
        if event.retry_after_s > 0:
            self.fallback.rest(event.worker_id, event.retry_after_s)
        held = self._notices.pop(rid, None) if self._notices else None
        if held is not None:
            notice = held[0]
            first_held = rid in self._held_firsts
            if kind == pb.EVENT_FIRST_TOKEN:
                self._notices[rid] = held          # (its place among the held ones is kept)
                self._held_firsts[rid] = event    # (wrapped in a message only if it goes alone)
                return
            if kind in _ENDINGS and (kind == pb.EVENT_FINISHED or not first_held):
                self._live.discard(rid)
                ended = notice.place.ended
                ended.CopyFrom(event)
                if first_held:
                    del self._held_firsts[rid]
                    ended.first_token = ended.streamed = True
                assert self._queue is not None     # (held only while a session is up)
                self._queue.put_nowait(notice)
                return
            self._release(rid, notice)
        if kind in _ENDINGS:
            self._live.discard(rid)
            if self._first_unsent:
                first = self._first_unsent.pop(rid, None)
                if first is not None and kind == pb.EVENT_FINISHED:
                    first.event.CopyFrom(event)     # not written yet: _outgoing forgets it first
                    first.event.first_token = True
                    first.event.streamed = True
                    return
        msg = pb.DataPlaneMessage(event=event)
        if self._connected.is_set() and self._queue is not None:
            self._queue.put_nowait(msg)
            if kind == pb.EVENT_FIRST_TOKEN and self._folds:
                self._first_unsent[rid] = msg
        else:
            self._unsent.append(msg)

    def finished(self, rid: str, prompt_tokens: int, completion_tokens: int, ttft_ms: float,
                 latency_ms: float) -> None:
        """``report`` of a FINISHED end. Its request's notice is usually still held for it
        (local placement): the end is then written straight into the notice, the same fields
        ``report`` would copy there from a ``LifecycleEvent`` built for the purpose."""
        held = self._notices.pop(rid, None) if self._notices else None
        if held is None:
            self.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED, prompt_tokens=prompt_tokens,
                                          completion_tokens=completion_tokens, ttft_ms=ttft_ms,
                                          latency_ms=latency_ms))
            return
        self._live.discard(rid)
        notice = held[0]
        ended = notice.place.ended
        ended.request_id = rid
        ended.kind = pb.EVENT_FINISHED
        ended.prompt_tokens = prompt_tokens
        ended.completion_tokens = completion_tokens
        ended.ttft_ms = ttft_ms
        ended.latency_ms = latency_ms
        if self._held_firsts and self._held_firsts.pop(rid, None) is not None:
            ended.first_token = ended.streamed = True
        assert self._queue is not None     # (held only while a session is up)
        self._queue.put_nowait(notice)

    async def list_models(self) -> pb.ListModelsResponse:
        """The served models: from the control plane, or from the fallback list without one."""
        if self._connected.is_set():
            try:
                return await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s,
                                                   metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if not self.fallback.known:
                    raise ControlPlaneUnavailable(exc.details() or str(exc.code())) from None
        if self.fallback.known:
            return pb.ListModelsResponse(models=[pb.ModelInfo(id=m) for m in self.fallback.models()])
        raise ControlPlaneUnavailable(f"no control plane reachable ({', '.join(self.targets)})")

    # ------------------------------------------------------------------ sessions

    async def _run(self) -> None:
        index = self._first
        failed_in_a_row = 0      # replicas that did not answer since one did
        ended_in_a_row = 0       # sessions that ended soon after they started
        while not self._closing:
            target = self.targets[index]
            channel = self._channel(target)
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=self.connect_timeout_s)
            except TimeoutError:
                index = (index + 1) % len(self.targets)
                failed_in_a_row += 1
                if failed_in_a_row >= len(self.targets):   # every replica tried: breathe
                    await RECONNECT.sleep(RECONNECT.delay(failed_in_a_row - len(self.targets) + 1))
                continue
            failed_in_a_row = 0
            started = RECONNECT.clock()
            await self._session(target, channel)
            ended_in_a_row = ended_in_a_row + 1 if RECONNECT.clock() - started < RECONNECT.max_s else 1
            if not self._closing:
                await RECONNECT.sleep(RECONNECT.delay(ended_in_a_row))

    async def _open_socket(self, target: str) -> SocketCall | None:
        """The session socket of ``target``'s control plane, or None: use the gRPC stream
        (the socket is off there, an older control plane, or it cannot be reached)."""
        if not self._use_socket or time.monotonic() < self._socket_retry_at.get(target, 0.0):
            return None
        try:
            endpoint = await self._stub.GetSessionEndpoint(pb.SessionEndpointRequest(), timeout=self.connect_timeout_s,
                                                           metadata=self._metadata)
        except grpc.aio.AioRpcError:
            return None          # UNIMPLEMENTED (older) or unreachable: the stream will tell
        if not endpoint.port or (endpoint.tls and self._ssl_context is None):
            return None
        host = split_target(target)[0]
        try:
            return await connect_socket(host, endpoint.port, ssl_context=self._ssl_context if endpoint.tls else None,
                                        timeout_s=self.connect_timeout_s)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            self._socket_retry_at[target] = time.monotonic() + SOCKET_RETRY_S
            log.warning("control plane %s: session socket port %d unreachable (%s); sessions use the gRPC "
                        "stream, trying the socket again in %.0fs", target, endpoint.port,
                        f"{type(exc).__name__} {exc}".strip(), SOCKET_RETRY_S)
            return None

    async def _session(self, target: str, channel: grpc.aio.Channel) -> None:
        self.target = target
        self._stub = pb_grpc.SchedulerStub(channel)
        sock = await self._open_socket(target)
        queue: asyncio.Queue = _Outbox()
        opening = pb.SessionOpen(node_id=self.node_id, live_requests=self._live, batches=True,
                                 token=self._token if sock is not None else "")   # gRPC: in metadata
        if sock is not None and opening.ByteSize() > MAX_OPENING_FRAME_BYTES - 16:
            # The socket's first frame is read before its token is checked, so it is small;
            # the live requests follow in a second open, once the session is admitted.
            queue.put_nowait(pb.DataPlaneMessage(open=pb.SessionOpen(node_id=self.node_id, batches=True,
                                                                     token=opening.token)))
            opening.token = ""
        queue.put_nowait(pb.DataPlaneMessage(open=opening))
        self._queue = queue          # what waits in _unsent follows once the control plane answers
        self._loop = asyncio.get_running_loop()
        self._cp_batches = False   # batch only once this control plane says it reads batches
        if sock is not None:
            sock.send_from(self._outgoing(queue))
            call = sock
        else:
            call = self._stub.Session(self._outgoing(queue), metadata=self._metadata)
        self.transport = "socket" if sock is not None else "grpc"
        self._call = call
        self.sessions_started += 1
        try:
            async for msg in call:
                if not self._connected.is_set():
                    # Connected once the control plane answers (its SessionInfo comes first),
                    # not when the call is made: one that refuses the session (a bad token)
                    # must not count as a control plane for /health and placements meanwhile.
                    self._on_connected(target)
                body = msg.WhichOneof("body")
                if body == "batch":
                    for one in msg.batch.messages:
                        self._received(one, one.WhichOneof("body"))
                else:
                    self._received(msg, body)
        except grpc.aio.AioRpcError as exc:
            if not self._closing:
                log.warning("control-plane session with %s ended: %s %s", target, exc.code().name, exc.details())
        except SessionRefused as exc:
            log.warning("control-plane session with %s ended: refused: %s", target, exc)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, FrameError, DecodeError) as exc:
            if not self._closing:
                log.warning("control-plane session with %s ended: %s", target, f"{type(exc).__name__} {exc}".strip())
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closing or (task is not None and task.cancelling()):
                raise
            log.warning("control-plane session with %s cancelled; reconnecting", target)   # drop_session()
        finally:
            self._local = self._folds = self._folds_place = False
            self._first_unsent.clear()
            self._connected.clear()
            self._down_since = time.monotonic()
            self._keep_unsent(queue)
            queue.put_nowait(None)
            call.cancel()
            for fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(ControlPlaneUnavailable("control-plane session ended"))

    def _on_connected(self, target: str) -> None:
        queue = self._queue
        while self._unsent and queue is not None:   # kept from earlier sessions, or reported meanwhile
            queue.put_nowait(self._unsent.popleft())
        self._connected.set()
        if self._in_fallback:
            self._in_fallback = False
            log.warning("control plane %s is back: local fallback placement ends (%d placed locally so far)",
                        target, self.fallback.placed)
        log.info("connected to control plane %s (%d live requests)", target, len(self._live))

    def _received(self, msg: pb.ControlPlaneMessage, body: str | None) -> None:
        if body == "placement":
            fut = self._pending.get(msg.placement.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg.placement)
        elif body == "fleet":
            self.fallback.update(msg.fleet)
            self.fleet_updates += 1
            # Local placement starts with this session's own list, not the last session's.
            self._local = self.info.local_placement and self._cp_batches
        elif body == "info":
            self.info = msg.info
            self._cp_batches = msg.info.batches
            self._folds = msg.info.folds_first_token
            self._folds_place = msg.info.folds_placement and msg.info.folds_first_token

    def _keep_unsent(self, queue: asyncio.Queue) -> None:
        """Reports still queued (or held for company) when a session ends go out on the next
        one, and so do the notices of local placements (a placement asked goes again instead).
        A notice with its end folded in goes as the two messages it was made of: the next
        control plane may not read folds."""
        if self._notice_timer is not None:
            self._notice_timer.cancel()
        self._release_notices(every=True)      # (into the queue, read below)
        held, self._holding = self._holding, None
        for msg in held or ():
            if _report_like(msg):
                self._keep(msg)
        while not queue.empty():
            msg = queue.get_nowait()
            if msg is not None and _report_like(msg):
                self._keep(msg)
        self._first_unsent.clear()   # (kept as they are: nothing folds into them on the next session)

    def _keep(self, msg: pb.DataPlaneMessage) -> None:
        self._unsent.append(msg)
        if msg.HasField("place") and msg.place.HasField("ended"):
            end = pb.DataPlaneMessage()
            end.event.CopyFrom(msg.place.ended)
            msg.place.ClearField("ended")
            self._unsent.append(end)

    async def _outgoing(self, queue: asyncio.Queue):
        """The stream's writes: one message, or (the control plane reads batches) everything
        queued meanwhile as one batch. A message taken for a write that never happens (the
        session ended) is lost to _keep_unsent, as a single one always was."""
        loop = asyncio.get_running_loop()
        while True:
            msg = await queue.get()
            if msg is None:
                return
            if not self._cp_batches:
                self._first_unsent.clear()   # what is written is never changed by report()
                yield msg
                continue
            batch = [msg]
            end = _drain(queue, batch)
            hold_s = LOCAL_HOLD_S if self._local else REPORT_HOLD_S
            if not end and hold_s > 0 and len(batch) < MAX_BATCH and not any(_asks(m) for m in batch):
                # Hold until a placement is queued (place() wakes us), the session is
                # closing (close() does), or the hold time is up; then take what came.
                self._holding = batch
                waiter = self._hold = loop.create_future()
                timer = loop.call_later(hold_s, _wake, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                    self._hold = None
                end = _drain(queue, batch)
                self._holding = None
            self._first_unsent.clear()   # written now: report() no longer folds into them
            yield pb.DataPlaneMessage(batch=pb.DataPlaneBatch(messages=batch)) if len(batch) > 1 else batch[0]
            if end:
                return
