"""Local placement: the data plane places round robin itself and tells the control plane after.

Real processes on loopback (two aggregated simulators, a control plane, a data plane). With a
policy that needs no shared state (``round_robin``) the control plane lets the data plane
place entry legs itself (``SessionInfo.local_placement``); the control plane still records
every request (its in-flight counts, placements per worker), and a drained worker gets no new
request once the data plane's worker list says so. Any other policy is asked as before.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from dataplane.fallback import FallbackPlacer
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"
# Requests that stay in flight a while: 30 tokens of 40 ms.
SLOW = ["--decode-ms-per-step", "40"]
SLOW_TOKENS = 30


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"a": "both", "b": "both"}, policy="round_robin", sim_args={"a": SLOW, "b": SLOW})
    try:
        yield c
    finally:
        c.group.close()


@pytest.fixture
async def fresh(cluster: Cluster):
    await cluster.fresh()
    try:
        yield cluster
    finally:
        await cluster.restore()


async def metric(http, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as r:
        m = re.search(rf"^{name} (\S+)$", await r.text(), re.M)
    return float(m.group(1)) if m else 0.0


async def complete(http, url: str, max_tokens: int = 2) -> int:
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens}) as r:
        await r.read()
        return r.status


async def test_a_burst_placed_locally_is_counted_in_flight_by_the_control_plane(fresh: Cluster, http):
    c = fresh
    before = await metric(http, c.url, "omni_dp_local_placements_total")
    placed_before = {w: i.placements_total for w, i in (await c.workers()).items()}
    burst = [asyncio.ensure_future(complete(http, c.url, SLOW_TOKENS)) for _ in range(12)]
    try:
        async def all_in_flight() -> bool:
            workers = await c.workers()
            return [workers[w].load.inflight_requests for w in ("a", "b")] == [6, 6]
        # Every request of the burst is charged where it runs, while it runs.
        await wait_until(all_in_flight, what="the control plane counting the burst, 6 on each worker")
        states = [await c.sim_get(n, "/sim/state") for n in ("a", "b")]
        assert [s["running"] + s["waiting"] for s in states] == [6, 6]
    finally:
        statuses = await asyncio.gather(*burst)
    assert statuses == [200] * 12
    assert await metric(http, c.url, "omni_dp_local_placements_total") - before == 12
    workers = await c.workers()
    assert {w: workers[w].placements_total - placed_before[w] for w in ("a", "b")} == {"a": 6, "b": 6}
    await wait_until(c.all_idle, what="every request released once it ended")


async def test_a_drained_worker_gets_no_new_local_placement(fresh: Cluster, http):
    c = fresh
    async with grpc.aio.insecure_channel(c.cp.address) as ch:
        await pb_grpc.AdminStub(ch).Drain(pb.WorkerRef(worker_id="a"), timeout=5)
    await wait_until(lambda: _lists(http, c.url, 1), what="the data plane's worker list without the drained worker")
    before = await metric(http, c.url, "omni_dp_local_placements_total")
    assert await asyncio.gather(*(complete(http, c.url) for _ in range(6))) == [200] * 6
    assert await metric(http, c.url, "omni_dp_local_placements_total") - before == 6
    assert len(await c.sim_requests("a")) == 0 and len(await c.sim_requests("b")) == 6
    async with grpc.aio.insecure_channel(c.cp.address) as ch:
        await pb_grpc.AdminStub(ch).Undrain(pb.WorkerRef(worker_id="a"), timeout=5)
    await wait_until(lambda: _lists(http, c.url, 2), what="the worker back in the data plane's list")


async def test_weights_set_by_the_operator_shape_the_local_round_robin(fresh: Cluster, http):
    c = fresh
    pushed = await metric(http, c.url, "omni_dp_controlplane_fleet_updates_total")
    async with grpc.aio.insecure_channel(c.cp.address) as ch:
        await pb_grpc.AdminStub(ch).SetWeight(pb.SetWeightRequest(worker_id="a", weight=3.0), timeout=5)
    await wait_until(lambda: _updated(http, c.url, pushed), what="the data plane's worker list with the new weight")
    assert await asyncio.gather(*(complete(http, c.url) for _ in range(8))) == [200] * 8
    assert (len(await c.sim_requests("a")), len(await c.sim_requests("b"))) == (6, 2)


async def _updated(http, url: str, before: float) -> bool:
    return await metric(http, url, "omni_dp_controlplane_fleet_updates_total") > before


async def _lists(http, url: str, n: int) -> bool:
    return await metric(http, url, "omni_dp_fallback_workers") == n


async def test_a_policy_with_shared_state_is_still_asked(http):
    c = start_cluster({"a": "both"}, policy="least_load")
    try:
        await wait_until(lambda: _lists(http, c.url, 1), what="the data plane connected with its worker list")
        assert await asyncio.gather(*(complete(http, c.url) for _ in range(4))) == [200] * 4
        assert await metric(http, c.url, "omni_dp_local_placements_total") == 0
        assert (await c.workers())["a"].placements_total == 4
    finally:
        c.group.close()


def _snapshot(*workers: tuple[str, float, int]) -> pb.FleetSnapshot:
    return pb.FleetSnapshot(workers=[
        pb.KnownWorker(endpoint=pb.Endpoint(worker_id=wid, url=f"http://{wid}", role=role), model=MODEL, weight=w)
        for wid, w, role in workers])


def test_local_round_robin_follows_the_weights_smoothly():
    placer = FallbackPlacer()
    placer.update(_snapshot(("a", 2.0, pb.ROLE_BOTH), ("b", 1.0, pb.ROLE_BOTH)))
    picks = [placer.place_local(pb.PlaceRequest(request_id=str(i), model=MODEL)).decode.worker_id
             for i in range(6)]
    assert picks == ["a", "b", "a", "a", "b", "a"]      # nginx's smooth order, as the control plane's
    excluded = placer.place_local(pb.PlaceRequest(request_id="x", model=MODEL, exclude_workers=["a"]))
    assert excluded.decode.worker_id == "b" and excluded.flow == pb.FLOW_AGGREGATED


async def test_an_engines_retry_after_keeps_it_out_of_the_local_round_robin_until_it_ends(monkeypatch):
    """The data plane that saw the Retry-After does not wait for the control plane's next
    worker list (a round robin would send the engine more requests meanwhile); a new list
    does not bring it back early, and it returns when its time is up."""
    import types

    import dataplane.fallback as fallback
    from dataplane.placement_client import PlacementClient
    now = [1000.0]
    monkeypatch.setattr(fallback, "time", types.SimpleNamespace(monotonic=lambda: now[0]))   # this module's clock
    client = PlacementClient(["127.0.0.1:1"], "dp-test")
    try:
        _check_rest(client, now)
    finally:
        await client.close()


def _check_rest(client, now: list[float]) -> None:
    placer = client.fallback
    placer.update(_snapshot(("a", 1.0, pb.ROLE_BOTH), ("b", 1.0, pb.ROLE_BOTH)))
    client.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_LEG_FAILED, worker_id="a", retry_after_s=30))
    placer.update(_snapshot(("a", 1.0, pb.ROLE_BOTH), ("b", 1.0, pb.ROLE_BOTH)))   # built before the report
    picks = [placer.place_local(pb.PlaceRequest(request_id=str(i), model=MODEL)).decode.worker_id for i in range(4)]
    assert picks == ["b"] * 4
    assert placer.place(pb.PlaceRequest(request_id="f", model=MODEL), pb.FLOW_SEQUENTIAL).decode.worker_id == "b"
    only_b = pb.PlaceRequest(request_id="x", model=MODEL, exclude_workers=["b"])
    assert placer.place_local(only_b) is None            # every worker out: the control plane decides
    now[0] += 30.5
    picks = {placer.place_local(pb.PlaceRequest(request_id=str(i), model=MODEL)).decode.worker_id for i in range(4)}
    assert picks == {"a", "b"}


def test_local_placement_leaves_pd_models_and_unknown_models_to_the_control_plane():
    placer = FallbackPlacer()
    placer.update(_snapshot(("a", 1.0, pb.ROLE_BOTH), ("p", 1.0, pb.ROLE_PREFILL)))
    assert placer.place_local(pb.PlaceRequest(request_id="1", model=MODEL)) is None     # P beside it
    assert placer.place_local(pb.PlaceRequest(request_id="2", model="other")) is None   # 404 is the CP's
    placer.update(_snapshot(("a", 1.0, pb.ROLE_BOTH)))
    assert placer.place_local(pb.PlaceRequest(request_id="3", model=MODEL, exclude_workers=["a"])) is None
    assert placer.place_local(pb.PlaceRequest(request_id="4", model=MODEL)).decode.worker_id == "a"
    assert placer.placed_local == 1


async def test_the_control_plane_records_a_local_placement_and_learns_a_folded_first_token():
    from tests.test_omni_scheduling import entry, make

    plane = await make("round_robin")
    assert plane.placer.places_anywhere
    learned: list[tuple[str, float, float]] = []
    plane.placer.predictor.observe_ttft = lambda wid, work, ttft: learned.append((wid, work, ttft))  # type: ignore[method-assign]
    assert await plane.placer.record(entry("r1", tokens=300, placed_on="b"), "s1")
    assert (await plane.load("b")).requests == 1 and (await plane.load("a")).requests == 0
    assert plane.fleet.placements["b"] == 1
    # Its FIRST_TOKEN folded into its FINISHED: the end releases it, and the first token is learned.
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, first_token=True,
                                                   streamed=True, ttft_ms=250.0, latency_ms=400.0,
                                                   completion_tokens=10))
    assert (await plane.load("b")).requests == 0
    assert learned == [("b", 300, 0.25)]
    # Not folded: a FINISHED alone teaches no time to first token.
    assert await plane.placer.record(entry("r2", placed_on="a"), "s1")
    await plane.lifecycle.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FINISHED, ttft_ms=250.0,
                                                   latency_ms=400.0, completion_tokens=10))
    assert len(learned) == 1
    # A worker it does not know (removed meanwhile): nothing recorded, counted.
    assert not await plane.placer.record(entry("r3", placed_on="gone"), "s1")
    assert plane.placer.stats.errors["LOCAL_PLACEMENT_UNRECORDED"] == 1
    assert not (await make("least_load")).placer.places_anywhere


async def test_a_finished_report_takes_the_place_of_its_unsent_first_token():
    from dataplane.placement_client import PlacementClient

    pc = PlacementClient("127.0.0.1:1", "node")
    try:
        pc._queue = queue = asyncio.Queue()
        pc._connected.set()
        pc._folds = True
        pc.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=5.0, streamed=True))
        pc.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, ttft_ms=5.0, latency_ms=9.0))
        assert queue.qsize() == 1
        folded = queue.get_nowait().event
        assert (folded.kind, folded.first_token, folded.streamed, folded.latency_ms) == \
            (pb.EVENT_FINISHED, True, True, 9.0)
        # Once written (``_outgoing`` forgets it), a first token is never changed: the end follows it.
        pc.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=5.0, streamed=True))
        pc._first_unsent.clear()
        pc.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FINISHED, latency_ms=9.0))
        kinds = [queue.get_nowait().event for _ in range(queue.qsize())]
        assert [(e.kind, e.first_token) for e in kinds] == [(pb.EVENT_FIRST_TOKEN, False), (pb.EVENT_FINISHED, False)]
    finally:
        await pc.close()


def _local_client():
    """A placement client as a session whose control plane reads folded ends leaves it."""
    from dataplane.placement_client import PlacementClient

    pc = PlacementClient("127.0.0.1:1", "node")
    pc._queue = asyncio.Queue()
    pc._loop = asyncio.get_running_loop()
    pc._connected.set()
    pc._local = pc._folds = pc._folds_place = True
    pc.fallback.update(_snapshot(("a", 1.0, pb.ROLE_BOTH), ("b", 1.0, pb.ROLE_BOTH)))
    return pc


def _placed(pc, rid: str, **kw) -> pb.Placement:
    placement = pc.place_here(pb.DataPlaneMessage(place=pb.PlaceRequest(request_id=rid, model=MODEL,
                                                                        leg=pb.LEG_ENTRY, **kw)))
    assert placement is not None
    return placement


def _queued(pc) -> list[pb.DataPlaneMessage]:
    return [pc._queue.get_nowait() for _ in range(pc._queue.qsize())]


async def test_a_request_that_ends_while_its_local_placement_notice_is_held_is_told_in_that_notice():
    pc = _local_client()
    try:
        _placed(pc, "r1")
        assert pc._queue.empty()              # held for the request's end
        pc.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, completion_tokens=3, latency_ms=2.0))
        [notice] = _queued(pc)
        assert (notice.place.placed_on, notice.place.ended.kind, notice.place.ended.completion_tokens) == \
            ("a", pb.EVENT_FINISHED, 3)
        # Streamed: its first token waits with it, and goes in it with the end.
        _placed(pc, "r2")
        pc.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=1.0, streamed=True))
        pc.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FINISHED, ttft_ms=1.0, latency_ms=4.0))
        [notice] = _queued(pc)
        ended = notice.place.ended
        assert (ended.kind, ended.first_token, ended.streamed, ended.ttft_ms) == (pb.EVENT_FINISHED, True, True, 1.0)
        # A failed leg, a first token before a failure, a retry's placement: the notice leaves
        # first, and every report follows it as it is.
        _placed(pc, "r3")
        pc.report(pb.LifecycleEvent(request_id="r3", kind=pb.EVENT_LEG_FAILED, worker_id="a"))
        _placed(pc, "r3", exclude_workers=["a"])
        pc.report(pb.LifecycleEvent(request_id="r3", kind=pb.EVENT_FINISHED))
        _placed(pc, "r4")
        pc.report(pb.LifecycleEvent(request_id="r4", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=1.0, streamed=True))
        pc.report(pb.LifecycleEvent(request_id="r4", kind=pb.EVENT_CANCELLED))
        sent = _queued(pc)
        assert [(m.WhichOneof("body"), m.place.request_id or m.event.request_id) for m in sent] == [
            ("place", "r3"), ("event", "r3"), ("place", "r3"), ("event", "r3"),
            ("place", "r4"), ("event", "r4"), ("event", "r4")]
        assert [m.event.kind for m in sent[-2:]] == [pb.EVENT_FIRST_TOKEN, pb.EVENT_CANCELLED]
        assert not any(m.place.HasField("ended") for m in sent)
        assert pc.live_requests == 0
        # A request still running when its hold is up: the notice leaves without it (the
        # control plane counts it in flight), with the first token held with it.
        _placed(pc, "r5")
        pc.report(pb.LifecycleEvent(request_id="r5", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=1.0, streamed=True))
        await wait_until(lambda: pc._queue.qsize() == 2, what="the held notice released", interval=0.01)
        notice, first = _queued(pc)
        pc._first_unsent.clear()              # (what _outgoing does once it writes them)
        assert (notice.place.request_id, notice.place.HasField("ended"), first.event.kind) == \
            ("r5", False, pb.EVENT_FIRST_TOKEN)
        pc.report(pb.LifecycleEvent(request_id="r5", kind=pb.EVENT_FINISHED, latency_ms=80.0))
        [end] = _queued(pc)
        assert end.event.kind == pb.EVENT_FINISHED and pc.live_requests == 0
    finally:
        await pc.close()


async def test_held_notices_go_as_they_stand_when_the_session_ends():
    """The next control plane may not read folds: a notice folded already goes as the
    placement and then its end, one still held as the placement (with its first token)."""
    pc = _local_client()
    try:
        _placed(pc, "r1")
        pc.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, completion_tokens=3))
        _placed(pc, "r2")
        pc.report(pb.LifecycleEvent(request_id="r2", kind=pb.EVENT_FIRST_TOKEN, ttft_ms=1.0, streamed=True))
        pc._keep_unsent(pc._queue)
        kept = [(m.WhichOneof("body"), m.place.request_id or m.event.request_id, m.place.HasField("ended"))
                for m in pc._unsent]
        assert kept == [("place", "r1", False), ("event", "r1", False), ("place", "r2", False), ("event", "r2", False)]
        assert pc._unsent[1].event.completion_tokens == 3 and pc._unsent[3].event.kind == pb.EVENT_FIRST_TOKEN
        assert not pc._notices and not pc._first_unsent    # nothing folds into what the next session sends
    finally:
        await pc.close()


async def test_the_control_plane_counts_a_local_placement_with_its_folded_end_without_charging_it():
    from bench.session_cost import control_plane

    c = await control_plane("a", "b")
    learned: list[tuple[str, float]] = []
    c.placer.predictor.observe_ttft = lambda wid, work, ttft: learned.append((wid, ttft))  # type: ignore[method-assign]
    charged: list[str] = []
    c.store.load_listeners.append(lambda wid, load: charged.append(wid))
    incoming: asyncio.Queue = asyncio.Queue()

    async def messages():
        yield pb.DataPlaneMessage(open=pb.SessionOpen(node_id="n", batches=True))
        while (m := await incoming.get()) is not None:
            yield m

    answers = c.scheduler.Session(messages(), None)
    try:
        info = (await answers.__anext__()).info
        assert info.local_placement and info.folds_placement
        batch = pb.DataPlaneMessage()
        msgs = batch.batch.messages
        for rid, wid in (("r1", "a"), ("r2", "b"), ("r3", "b")):
            msgs.add().place.CopyFrom(pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=12,
                                                      max_tokens=4, placed_on=wid))
        msgs[0].place.ended.CopyFrom(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, completion_tokens=4,
                                                       first_token=True, streamed=True, ttft_ms=5.0, latency_ms=9.0))
        msgs[2].place.ended.CopyFrom(pb.LifecycleEvent(request_id="r3", kind=pb.EVENT_FAILED, worker_id="b",
                                                       upstream_status=500, message="boom"))
        msgs.add()      # a first token folded along (left empty): skipped
        incoming.put_nowait(batch)
        await wait_until(lambda: c.fleet.placements["b"] == 2, what="the three placements counted")
        assert c.fleet.placements["a"] == 1
        loads = await c.store.loads(["a", "b"])
        assert (loads["a"].requests, loads["b"].requests) == (0, 1)     # only r2 is in flight
        assert await c.store.get("r1") is None and await c.store.get("r3") is None
        assert charged == ["b"]                                        # r2's charge, nothing else
        assert learned == [("a", 0.005)]                              # r1's folded first token taught
        assert c.fleet.state("b").failures_total == 1                 # r3's failure counted
    finally:
        incoming.put_nowait(None)
        await answers.aclose()
