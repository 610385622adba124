"""A data plane's session with the control plane may blip; its live requests must not.

Regression tests for the reliability issue's first defect: quiet sessions were ended by
gRPC keepalive (GOAWAY ``too_many_pings``) and every request still streaming lost its
load. Control plane and placement client run in this process, against a real simulator.
"""

from __future__ import annotations

import asyncio

import pytest

from controlplane.server import ControlPlane
from dataplane.placement_client import ControlPlaneUnavailable, PlacementClient
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


@pytest.fixture
def cp(inproc_cp):
    return inproc_cp


async def _client(cp: ControlPlane, **kw) -> PlacementClient:
    client = PlacementClient(f"127.0.0.1:{cp.grpc_port}", "dp-test", timeout_s=5.0, **kw)
    await client.start()
    assert await client.wait_connected(10)
    return client


async def _load(cp: ControlPlane) -> tuple[int, int]:
    """(requests charged on worker w, request records in the ledger)"""
    load = (await cp.store.loads(["w"]))["w"]
    return load.requests, len(await cp.store.records())


def _entry(rid: str) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, model="", leg=pb.LEG_ENTRY, prompt_tokens=10, max_tokens=5)


async def test_a_placement_never_answered_gives_up_at_its_deadline(cp, monkeypatch):
    """Deadlines are swept (no timer per placement): one the control plane never answers
    still fails with ControlPlaneUnavailable at its deadline (a sweep at most later), and
    leaves nothing pending behind."""
    client = PlacementClient(f"127.0.0.1:{cp.grpc_port}", "dp-test", timeout_s=0.4)
    await client.start()
    try:
        assert await client.wait_connected(10)
        assert not (await client.place(_entry("fast"))).error
        held: list[pb.PlaceRequest] = []

        async def hold(req, session):
            held.append(req)
            return asyncio.get_running_loop().create_future()   # never answered

        monkeypatch.setattr(cp.placer, "submit", hold)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ControlPlaneUnavailable, match="within 0.4s"):
            await client.place(_entry("stuck"))
        waited = loop.time() - started
        assert 0.4 <= waited < 0.4 + 0.25 and [r.request_id for r in held] == ["stuck"]
        assert not client._pending and not client._due
    finally:
        await client.close()


async def test_quiet_session_survives_frequent_keepalive_pings(cp):
    """Pings every 0.6 s on a silent stream: gRPC's default server policy would GOAWAY the
    session after two or three of them; the aligned policy keeps it."""
    client = await _client(cp, keepalive_ms=600, session_socket=False)   # gRPC's pings
    try:
        assert not (await client.place(_entry("r1"))).error
        # Watch a quiet stream for 4 s (about 6 pings); the condition is that nothing happens.
        deadline = asyncio.get_running_loop().time() + 4.0
        while asyncio.get_running_loop().time() < deadline:
            assert client.sessions_started == 1 and cp.placer.stats.sessions["closed"] == 0
            assert await _load(cp) == (1, 1)
            await asyncio.sleep(0.1)
    finally:
        await client.close()


@pytest.mark.parametrize("session_socket", [True, False], ids=["socket", "grpc"])
async def test_reconnecting_data_plane_claims_its_live_requests(cp, session_socket):
    client = await _client(cp, session_socket=session_socket)
    assert client.transport == ("socket" if session_socket else "grpc")
    try:
        assert not (await client.place(_entry("live"))).error
        assert not (await client.place(_entry("ends-during-blip"))).error
        assert await _load(cp) == (2, 2)
        client.drop_session()
        # As the session goes down, one request ends: its report must not be lost.
        client.report(pb.LifecycleEvent(request_id="ends-during-blip", kind=pb.EVENT_FINISHED))
        await wait_until(lambda: _async(client.sessions_started == 2 and client.connected
                                        and cp.placer.stats.sessions["closed"] == 1),
                         what="the session to end and a new one to start")
        # The live request is claimed back and stays charged; the ended one is released.
        await wait_until(lambda: _loaded(cp, (1, 1)), what="only the live request to stay charged")
        assert cp.placer.stats.sessions["requests_claimed"] >= 1
        client.report(pb.LifecycleEvent(request_id="live", kind=pb.EVENT_FINISHED))
        await wait_until(lambda: _loaded(cp, (0, 0)), what="the live request to be released")
    finally:
        await client.close()


async def test_a_reconnect_with_more_live_requests_than_the_opening_frame_holds_claims_them_all(cp):
    """The session socket reads at most 8 KiB before a session is admitted; a data plane
    whose live requests take more sends them in a second ``open`` and loses none."""
    from protos.options import MAX_OPENING_FRAME_BYTES

    client = await _client(cp)
    assert client.transport == "socket"
    try:
        ids = [f"live-{i:04d}-{'x' * 40}" for i in range(300)]
        answers = await asyncio.gather(*(client.place(_entry(rid)) for rid in ids))
        assert not any(a.error for a in answers)
        assert len(pb.SessionOpen(live_requests=ids).SerializeToString()) > MAX_OPENING_FRAME_BYTES
        client.drop_session()
        await wait_until(lambda: _async(client.sessions_started == 2 and client.connected),
                         what="a new session")
        await wait_until(lambda: _async(cp.placer.stats.sessions["requests_claimed"] >= len(ids)),
                         what="every live request claimed by the new session")
        assert await _load(cp) == (len(ids), len(ids))
        for rid in ids:
            client.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED))
        await wait_until(lambda: _loaded(cp, (0, 0)), what="all released")
    finally:
        await client.close()


async def test_requests_of_a_data_plane_that_never_returns_are_released_after_grace(cp):
    cp.lifecycle.session_grace_s = 2.0   # long enough to see the load kept, even on a loaded machine
    client = await _client(cp)
    assert not (await client.place(_entry("gone"))).error
    assert await _load(cp) == (1, 1)
    await client.close()
    await wait_until(lambda: _async(cp.placer.stats.sessions["closed"] == 1), what="the session to end")
    assert await _load(cp) == (1, 1)   # not released at once: the node may come back
    await wait_until(lambda: _loaded(cp, (0, 0)), timeout=10, what="release after the grace period")
    assert cp.placer.stats.sessions["requests_released"] == 1


async def test_an_exception_in_placement_costs_one_placement_not_the_session(cp, monkeypatch):
    client = await _client(cp)
    try:
        real = cp.placer.place

        async def broken(req, session="", **kw):
            if req.request_id == "boom":
                raise FloatingPointError("Total of weights must be finite")
            return await real(req, session, **kw)

        monkeypatch.setattr(cp.placer, "place", broken)
        bad = await client.place(_entry("boom"))
        assert bad.error == pb.INTERNAL and "FloatingPointError" in bad.error_message
        good = await client.place(_entry("fine"))
        assert not good.error and good.decode.worker_id == "w"
        assert client.sessions_started == 1 and cp.placer.stats.sessions["closed"] == 0
    finally:
        await client.close()


async def _async(value):
    return value


async def _loaded(cp: ControlPlane, expected: tuple[int, int]) -> bool:
    return await _load(cp) == expected


async def test_a_session_counts_only_once_the_control_plane_answers():
    """A control plane that has not answered (or refuses the session: a bad token) is not a
    connection: /health and placements must not rely on it meanwhile."""
    import grpc

    from protos import omni_proxy_pb2_grpc as pb_grpc

    opened = asyncio.Event()
    answer = asyncio.Event()

    class Silent(pb_grpc.SchedulerServicer):
        async def Session(self, request_iterator, context):
            opened.set()
            await answer.wait()              # accepted by gRPC, not yet answered
            yield pb.ControlPlaneMessage(info=pb.SessionInfo())
            await asyncio.Event().wait()

    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = PlacementClient(f"127.0.0.1:{port}", "dp-wait", timeout_s=5.0)
    try:
        await client.start()
        await asyncio.wait_for(opened.wait(), 10)
        client.report(pb.LifecycleEvent(request_id="early", kind=pb.EVENT_FINISHED))
        assert not client.connected
        answer.set()
        assert await client.wait_connected(10)
        assert not client._unsent          # what was reported meanwhile went out on this session
    finally:
        await client.close()
        await server.stop(None)


async def test_requests_orphaned_by_a_store_sweep_are_released_after_the_grace(sim_both):
    """A dead replica's requests are orphaned by another replica's sweep, where no session
    ends: they must still be released after session_grace_s, not after max_request_age_s."""
    import time

    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.workers import Role

    plane = ControlPlane(ControlPlaneConfig(http_port=0, listen="127.0.0.1:0", session_grace_s=1.0,
                                            workers=[WorkerSpec(url=sim_both.url, role=Role.BOTH, id="w")]))
    await plane.start()
    client = None
    try:
        client = await _client(plane)
        assert not (await client.place(_entry("r1"))).error
        (record,) = await plane.store.records()
        # What RedisStore.sweep does to the records of a replica that stopped heartbeating.
        assert await plane.store.orphan(record.session, time.monotonic()) == 1
        assert await _load(plane) == (1, 1)
        async def released():
            return await _load(plane) == (0, 0)
        await wait_until(released, timeout=10, what="the orphaned request to be released")
        assert plane.placer.stats.sessions["requests_released"] == 1
    finally:
        if client is not None:
            await client.close()
        await plane.stop()
