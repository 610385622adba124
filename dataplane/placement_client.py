"""The data plane's side of the control-plane session: one bidirectional gRPC stream.

Placements ride the stream as request/answer pairs matched by ``seq``; lifecycle reports
ride it one way. If the stream breaks, every waiting placement fails fast, the control
plane releases what this node held, and the client reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class ControlPlaneUnavailable(Exception):
    pass


class PlacementClient:
    def __init__(self, target: str, node_id: str, *, timeout_s: float = 5.0) -> None:
        self.target = target
        self.node_id = node_id
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)])
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        # What the control plane told us about this deployment at session start.
        self.info = pb.SessionInfo()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

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
                return await asyncio.wait_for(fut, self.timeout_s)
            except ControlPlaneUnavailable:
                if attempt == 2:
                    raise
            except asyncio.TimeoutError:
                raise ControlPlaneUnavailable(f"no placement from {self.target} within {self.timeout_s}s") from None
            finally:
                self._pending.pop(seq, None)
        raise AssertionError("unreachable")

    def report(self, event: pb.LifecycleEvent) -> None:
        """Fire and forget. While disconnected, reports are dropped: the control plane
        already released everything this node's old session held."""
        if self._connected.is_set() and self._queue is not None:
            self._queue.put_nowait(pb.DataPlaneMessage(event=event))

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
            queue.put_nowait(pb.DataPlaneMessage(open=pb.SessionOpen(node_id=self.node_id)))
            self._queue = queue
            call = self._stub.Session(self._outgoing(queue))
            self._connected.set()
            log.info("connected to control plane %s", self.target)
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
            finally:
                self._connected.clear()
                queue.put_nowait(None)
                call.cancel()
                for fut in list(self._pending.values()):
                    if not fut.done():
                        fut.set_exception(ControlPlaneUnavailable("control-plane session ended"))
            if not self._closing:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    @staticmethod
    async def _outgoing(queue: asyncio.Queue):
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg
