"""The session socket: data-plane sessions on plain TCP, with gRPC's ``Session`` as the fallback.

A control plane in this process (its state can be inspected) against a real simulator;
the data plane's placement client, or a raw socket speaking ``protos/framing.py``.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

from controlplane.auth import AuthConfig
from controlplane.config import ControlPlaneConfig, WorkerSpec
from controlplane.server import ControlPlane
from controlplane.workers import Role
from dataplane.placement_client import PlacementClient
from protos import omni_proxy_pb2 as pb
from protos.framing import encode, frame, read_frames
from tests.conftest import wait_until
from tests.ports import refused_port


def _entry(rid: str) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, model="", leg=pb.LEG_ENTRY, prompt_tokens=10, max_tokens=5)


async def _client(cp: ControlPlane, **kw) -> PlacementClient:
    client = PlacementClient(f"127.0.0.1:{cp.grpc_port}", "dp-test", timeout_s=5.0, **kw)
    await client.start()
    assert await client.wait_connected(10)
    return client


async def _requests_on_w(cp: ControlPlane) -> int:
    return (await cp.store.loads(["w"]))["w"].requests


async def _plane(sim, **config) -> ControlPlane:
    plane = ControlPlane(ControlPlaneConfig(http_port=0, listen="127.0.0.1:0",
                                            workers=[WorkerSpec(url=sim.url, role=Role.BOTH, id="w")], **config))
    await plane.start()
    return plane


class Raw:
    """A hand-driven session socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = read_frames(reader)

    @classmethod
    async def open(cls, cp: ControlPlane) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", cp.session_port))

    async def answer(self) -> pb.ControlPlaneMessage | None:
        """The next message, or None at the end of the stream."""
        try:
            raw = await asyncio.wait_for(self.frames.__anext__(), 10)
        except StopAsyncIteration:
            return None
        return pb.ControlPlaneMessage.FromString(raw)

    async def ended(self) -> bool:
        return await self.answer() is None

    def close(self) -> None:
        self.writer.close()


async def test_data_plane_places_and_reports_over_the_socket(inproc_cp):
    cp = inproc_cp
    assert cp.session_port
    client = await _client(cp)
    try:
        assert client.transport == "socket"
        placement = await client.place(_entry("r1"))
        assert not placement.error and placement.decode.worker_id == "w"
        assert await _requests_on_w(cp) == 1
        client.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED))

        async def released() -> bool:
            return await _requests_on_w(cp) == 0
        await wait_until(released, what="the report to release the request")
        assert cp.placer.stats.sessions["opened"] >= 1
    finally:
        await client.close()


async def test_closing_the_client_ends_the_session_cleanly(inproc_cp):
    cp = inproc_cp
    client = await _client(cp)
    assert not (await client.place(_entry("r1"))).error
    client.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED))
    await client.close()       # the last report goes out before the socket closes

    async def ended() -> bool:
        return cp.placer.stats.sessions["closed"] >= 1 and await _requests_on_w(cp) == 0
    await wait_until(ended, what="the session to end with its request released")


@pytest.mark.parametrize("session_socket", [True, False], ids=["socket", "grpc"])
async def test_either_transport_serves_when_the_other_is_not_wanted(sim_both, session_socket):
    cp = await _plane(sim_both, session_listen="auto" if session_socket else "off")
    try:
        assert bool(cp.session_port) is session_socket
        client = await _client(cp)
        try:
            assert client.transport == ("socket" if session_socket else "grpc")
            assert not (await client.place(_entry("r1"))).error
        finally:
            await client.close()
    finally:
        await cp.stop()


async def test_an_unreachable_socket_falls_back_to_the_grpc_stream(inproc_cp, caplog):
    cp = inproc_cp
    with refused_port() as port:         # nothing listens there: connections are refused
        cp.session_socket.service.endpoint = pb.SessionEndpoint(port=port)
        client = await _client(cp)
        try:
            assert client.transport == "grpc"
            assert not (await client.place(_entry("r1"))).error
            assert any("session socket" in r.getMessage() and "unreachable" in r.getMessage()
                       for r in caplog.records)
        finally:
            await client.close()


async def test_a_token_is_needed_when_the_control_plane_asks_for_one(sim_both):
    cp = await _plane(sim_both, auth=AuthConfig(dataplane_tokens={"dp": "s3cret"}))
    try:
        for token, accepted in (("", False), ("wrong", False), ("s3cret", True)):
            raw = await Raw.open(cp)
            try:
                raw.writer.write(encode(pb.DataPlaneMessage(open=pb.SessionOpen(node_id="raw", token=token))))
                first = await raw.answer()
                assert first is not None
                assert first.WhichOneof("body") == ("info" if accepted else "refused"), token
                if not accepted:
                    assert "token" in first.refused and await raw.ended()
            finally:
                raw.close()
        client = await _client(cp, token="s3cret")    # the data plane sends its token in open
        try:
            assert client.transport == "socket"
            assert not (await client.place(_entry("r1"))).error
        finally:
            await client.close()
    finally:
        await cp.stop()


@pytest.mark.parametrize("first, why", [
    (frame(b"\xff\xff\xff"), "malformed"),
    (encode(pb.DataPlaneMessage(place=_entry("x"))), "'open'"),
], ids=["garbage", "not-open"])
async def test_a_bad_opening_is_refused_and_the_plane_keeps_serving(inproc_cp, first, why):
    cp = inproc_cp
    raw = await Raw.open(cp)
    try:
        raw.writer.write(first)
        answer = await raw.answer()
        assert answer is not None and answer.WhichOneof("body") == "refused" and why in answer.refused
        assert await raw.ended()
    finally:
        raw.close()
    client = await _client(cp)
    try:
        assert not (await client.place(_entry("after"))).error
    finally:
        await client.close()


async def test_an_oversized_or_malformed_frame_ends_only_its_session(inproc_cp):
    cp = inproc_cp
    bystander = await _client(cp)
    try:
        for bad in (struct.pack(">I", 0xFFFFFFFF), frame(b"\xff\xff\xff")):
            raw = await Raw.open(cp)
            try:
                raw.writer.write(encode(pb.DataPlaneMessage(open=pb.SessionOpen(node_id="raw"))))
                assert (await raw.answer()).WhichOneof("body") == "info"
                raw.writer.write(encode(pb.DataPlaneMessage(place=_entry(f"ok-{len(bad)}"))))
                for _ in range(5):      # the fleet snapshot may come first
                    answer = await raw.answer()
                    assert answer is not None
                    if answer.WhichOneof("body") == "placement":
                        break
                assert answer.WhichOneof("body") == "placement" and not answer.placement.error
                raw.writer.write(bad)
                while (msg := await raw.answer()) is not None:       # the session ends
                    assert msg.WhichOneof("body") != "placement"
            finally:
                raw.close()
            assert not (await bystander.place(_entry(f"still-{len(bad)}"))).error
        assert bystander.sessions_started == 1
    finally:
        await bystander.close()


async def test_held_reports_leave_with_the_next_placement(monkeypatch):
    """Reports alone wait for company; a placement ends the wait at once (whatever the
    hold time) and both leave in one write."""
    import dataplane.placement_client as module

    monkeypatch.setattr(module, "REPORT_HOLD_S", 60.0)   # only a wake-up can end the hold in time
    client = PlacementClient("127.0.0.1:1", "dp-test")
    client._cp_batches = True
    queue: asyncio.Queue = asyncio.Queue()
    client._queue = queue
    client._connected.set()
    writes = client._outgoing(queue)
    client.report(pb.LifecycleEvent(request_id="done", kind=pb.EVENT_FINISHED))
    first = asyncio.ensure_future(writes.__anext__())

    async def holding() -> bool:
        return client._hold is not None
    await wait_until(holding, what="the report to be held")
    placing = asyncio.ensure_future(client.place(_entry("next")))
    try:
        msg = await asyncio.wait_for(first, 10)
        assert msg.WhichOneof("body") == "batch"
        assert [m.WhichOneof("body") for m in msg.batch.messages] == ["event", "place"]
        # closing wakes a hold too: the last reports go out, then the stream ends
        client.report(pb.LifecycleEvent(request_id="next", kind=pb.EVENT_CANCELLED))
        last = asyncio.ensure_future(writes.__anext__())
        await wait_until(holding, what="the second report to be held")
        await client.close()
        msg = await asyncio.wait_for(last, 10)
        assert msg.WhichOneof("body") == "event" and msg.event.request_id == "next"
        with pytest.raises(StopAsyncIteration):
            await writes.__anext__()
    finally:
        placing.cancel()
        await asyncio.gather(placing, return_exceptions=True)
