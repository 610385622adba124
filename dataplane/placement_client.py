"""The data plane's side of the control-plane session: one bidirectional gRPC stream.

Placements ride the stream as request/answer pairs matched by ``seq``; lifecycle reports
ride it one way. If the stream breaks, every waiting placement is retried once on the next
session, and the client reconnects with backoff. Requests already placed keep streaming:
on reconnect the node names them (``SessionOpen.live_requests``) so the control plane keeps
their load charged, and the reports that could not be sent meanwhile go out first.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging

import grpc

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from protos.options import CLIENT_KEEPALIVE_MS, client_options

log = logging.getLogger(__name__)


_ENDINGS = frozenset({pb.EVENT_FINISHED, pb.EVENT_FAILED, pb.EVENT_CANCELLED})


class ControlPlaneUnavailable(Exception):
    pass


class PlacementClient:
    def __init__(self, target: str, node_id: str, *, timeout_s: float = 5.0,
                 keepalive_ms: int = CLIENT_KEEPALIVE_MS, max_buffered_reports: int = 100_000) -> None:
        self.target = target
        self.node_id = node_id
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(target, options=client_options(keepalive_ms))
        # Requests placed through this node whose ending has not been reported yet.
        self._live: set[str] = set()
        # Reports made while no session was up, sent first on the next one.
        self._unsent: collections.deque[pb.DataPlaneMessage] = collections.deque(maxlen=max_buffered_reports)
        self.sessions_started = 0
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._closing = False
        # What the control plane told us about this deployment at session start.
        self.info = pb.SessionInfo()

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
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self._closing = True
        if self._queue is not None:
            self._queue.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()

    async def place(self, req: pb.PlaceRequest) -> pb.Placement:
        """Ask for a placement; retried once if the stream breaks while we wait."""
        for attempt in (1, 2):
            if not self._connected.is_set() and not await self.wait_connected(self.timeout_s):
                raise ControlPlaneUnavailable(f"control plane {self.target} is not reachable")
            seq = next(self._seq)
            req.seq = seq
            fut = asyncio.get_running_loop().create_future()
            self._pending[seq] = fut
            assert self._queue is not None
            self._queue.put_nowait(pb.DataPlaneMessage(place=req))
            try:
                placement = await asyncio.wait_for(fut, self.timeout_s)
                if not placement.error:
                    self._live.add(req.request_id)
                return placement
            except asyncio.CancelledError:
                # The client went away while the placement was pending (perhaps held in the
                # control plane's queue): tell the control plane, so it leaves the queue now.
                self.report(pb.LifecycleEvent(request_id=req.request_id, kind=pb.EVENT_CANCELLED))
                raise
            except ControlPlaneUnavailable:
                if attempt == 2:
                    raise
            except asyncio.TimeoutError:
                self.report(pb.LifecycleEvent(request_id=req.request_id, kind=pb.EVENT_CANCELLED))
                raise ControlPlaneUnavailable(f"no placement from {self.target} within {self.timeout_s}s") from None
            finally:
                self._pending.pop(seq, None)
        raise AssertionError("unreachable")

    def report(self, event: pb.LifecycleEvent) -> None:
        """Fire and forget; kept for the next session while none is up (bounded)."""
        if event.kind in _ENDINGS:
            self._live.discard(event.request_id)
        msg = pb.DataPlaneMessage(event=event)
        if self._connected.is_set() and self._queue is not None:
            self._queue.put_nowait(msg)
        else:
            self._unsent.append(msg)

    async def list_models(self) -> pb.ListModelsResponse:
        try:
            return await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise ControlPlaneUnavailable(exc.details() or str(exc.code())) from None

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            try:
                await asyncio.wait_for(self._channel.channel_ready(), timeout=max(self.timeout_s, 1.0))
            except asyncio.TimeoutError:
                continue
            queue: asyncio.Queue = asyncio.Queue()
            queue.put_nowait(pb.DataPlaneMessage(open=pb.SessionOpen(node_id=self.node_id,
                                                                     live_requests=self._live)))
            while self._unsent:
                queue.put_nowait(self._unsent.popleft())
            self._queue = queue
            call = self._stub.Session(self._outgoing(queue))
            self._call = call
            self.sessions_started += 1
            self._connected.set()
            log.info("connected to control plane %s (%d live requests)", self.target, len(self._live))
            try:
                async for msg in call:
                    if msg.WhichOneof("body") == "info":
                        self.info = msg.info
                        continue
                    placement = msg.placement
                    fut = self._pending.get(placement.seq)
                    if fut is not None and not fut.done():
                        fut.set_result(placement)
                backoff = 0.05
            except grpc.aio.AioRpcError as exc:
                if not self._closing:
                    log.warning("control-plane session ended: %s %s", exc.code().name, exc.details())
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closing or (task is not None and task.cancelling()):
                    raise
                log.warning("control-plane session cancelled; reconnecting")   # drop_session()
            finally:
                self._connected.clear()
                self._keep_unsent(queue)
                queue.put_nowait(None)
                call.cancel()
                for fut in list(self._pending.values()):
                    if not fut.done():
                        fut.set_exception(ControlPlaneUnavailable("control-plane session ended"))
            if not self._closing:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _keep_unsent(self, queue: asyncio.Queue) -> None:
        """Reports still queued when a session ends go out on the next one."""
        while not queue.empty():
            msg = queue.get_nowait()
            if msg is not None and msg.WhichOneof("body") == "event":
                self._unsent.append(msg)

    @staticmethod
    async def _outgoing(queue: asyncio.Queue):
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg
