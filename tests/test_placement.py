"""Placement and the load ledger, in process: load is current at every placement."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest

from controlplane.fleet import Fleet
from controlplane.lifecycle import Lifecycle
from controlplane.placement import PlacementStats, Placer
from controlplane.scheduling import build_profile
from controlplane.state import MemoryStore
from controlplane.workers import Health, HealthState, Load, Role, WorkerSpec
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


@dataclasses.dataclass
class Plane:
    """The control plane's core without its servers: store, fleet view, placer, lifecycle."""

    store: MemoryStore
    fleet: Fleet
    placer: Placer
    lifecycle: Lifecycle

    async def place(self, req: pb.PlaceRequest, **kw) -> pb.Placement:
        return await self.placer.place(req, **kw)

    async def report(self, request_id: str, kind: int, **kw) -> None:
        await self.lifecycle.report(pb.LifecycleEvent(request_id=request_id, kind=kind, **kw))

    async def load(self, worker_id: str) -> tuple[int, int]:
        load = (await self.store.loads([worker_id]))[worker_id]
        return load.requests, load.tokens


def w(wid, role=Role.BOTH, model="m", health=Health.HEALTHY, **kw):
    return WorkerSpec(id=wid, url=f"http://{wid}", role=role, model=model, **kw), health


async def make(policy="least_load", workers=(), flow="sequential") -> Plane:
    store, fleet, stats = MemoryStore(), Fleet(), PlacementStats.new()
    for spec, health in workers:
        await store.put_spec(spec)
        fleet.put(spec)
        fleet.set_state(spec.id, HealthState(health=health))
    return Plane(store, fleet, Placer(store, fleet, build_profile(policy), pd_flow=flow, stats=stats),
                 Lifecycle(store, fleet, stats))


def entry(rid, tokens=100, model="m", **kw):
    return pb.PlaceRequest(request_id=rid, model=model, leg=pb.LEG_ENTRY, prompt_tokens=tokens, **kw)


async def test_burst_is_spread_because_load_is_counted_at_placement():
    plane = await make(workers=[w("a"), w("b"), w("c")])
    got = Counter()
    for i in range(30):
        p = await plane.place(entry(f"r{i}"))
        got[p.decode.worker_id] += 1
    assert got == {"a": 10, "b": 10, "c": 10}
    assert await plane.load("a") == (10, 1000)


async def test_finished_reports_release_exactly_what_was_charged():
    plane = await make(workers=[w("a")])
    await plane.place(entry("r1", tokens=50, max_tokens=10))
    assert await plane.load("a") == (1, 60)
    await plane.report("r1", pb.EVENT_FINISHED)
    assert await plane.load("a") == (0, 0)
    # A duplicate or unknown report changes nothing.
    await plane.report("r1", pb.EVENT_FINISHED)
    await plane.report("nope", pb.EVENT_FAILED)
    assert await plane.load("a") == (0, 0)


async def test_pd_entry_then_decode_and_prefill_release():
    plane = await make(workers=[w("p", Role.PREFILL), w("d", Role.DECODE)])
    first = await plane.place(entry("r1", tokens=40))
    assert first.flow == pb.FLOW_SEQUENTIAL and first.prefill.worker_id == "p"
    second = await plane.place(pb.PlaceRequest(request_id="r1", model="m", leg=pb.LEG_DECODE, prompt_tokens=40))
    assert second.decode.worker_id == "d"
    assert (await plane.load("p"))[0] == (await plane.load("d"))[0] == 1
    await plane.report("r1", pb.EVENT_PREFILL_DONE)
    assert (await plane.load("p"))[0] == 0 and (await plane.load("d"))[0] == 1
    await plane.report("r1", pb.EVENT_CANCELLED)
    assert await plane.load("d") == (0, 0)


async def test_prefill_workers_are_skipped_without_a_decode_worker():
    plane = await make(workers=[w("p", Role.PREFILL), w("d", Role.DECODE, health=Health.UNHEALTHY), w("b")])
    for i in range(5):
        p = await plane.place(entry(f"r{i}"))
        assert p.flow == pb.FLOW_AGGREGATED and p.decode.worker_id == "b"


async def test_errors_distinguish_unknown_model_from_no_healthy_worker():
    plane = await make(workers=[w("a", health=Health.UNHEALTHY)])
    p = await plane.place(entry("r", model="zzz"))
    assert p.error == pb.UNKNOWN_MODEL and "zzz" in p.error_message
    p = await plane.place(entry("r"))
    assert p.error == pb.NO_HEALTHY_WORKER and "healthy" in p.error_message


async def test_a_worker_whose_model_is_not_discovered_yet_means_503_not_404():
    plane = await make(workers=[w("a", model="", health=Health.UNKNOWN)])
    p = await plane.place(entry("r", model="zzz"))
    assert p.error == pb.NO_HEALTHY_WORKER


async def test_session_end_keeps_load_until_grace_and_claims_move_requests():
    plane = await make(workers=[w("a")])
    for i in range(3):
        await plane.placer.place(entry(f"s1-{i}"), session="s1")
    await plane.placer.place(entry("s2-0"), session="s2")
    lc = plane.lifecycle
    assert (await plane.load("a"))[0] == 4
    assert await lc.orphan_session("s1") == 3
    assert (await plane.load("a"))[0] == 4              # a blip is not the end of the requests
    assert await lc.claim("s3", ["s1-0", "s2-0", "unknown"]) == 1   # s2-0 has a live owner
    assert await lc.release_orphans(older_than_s=0) == 2
    assert (await plane.load("a"))[0] == 2
    assert await lc.orphan_session("s3") == 1 and await lc.orphan_session("s2") == 1


async def test_unreachable_worker_reported_by_data_plane_is_marked_unhealthy():
    plane = await make(workers=[w("a"), w("b")])
    p = await plane.place(entry("r"))
    bad = p.decode.worker_id
    await plane.report("r", pb.EVENT_FAILED, worker_id=bad, upstream_status=0, message="connection refused")
    state = plane.fleet.state(bad)
    assert state.health is Health.UNHEALTHY and state.failures_total == 1
    for i in range(4):
        assert (await plane.place(entry(f"x{i}"))).decode.worker_id != bad


async def test_dry_run_explains_without_charging():
    plane = await make(workers=[w("a"), w("b"), w("u", health=Health.UNHEALTHY)])
    p = await plane.place(entry("r"), dry_run=True)
    assert p.decode.worker_id in ("a", "b") and "policy=least_load" in p.explanation
    assert "-u dropped by healthy" in p.explanation
    assert [await plane.load(x) for x in "ab"] == [(0, 0), (0, 0)]
    assert await plane.store.records() == []


@pytest.mark.parametrize("policy", ["round_robin", "random", "power_of_two", "least_load", "cache_aware",
                                    "apc_first"])
async def test_every_policy_places_on_a_healthy_matching_worker(policy):
    plane = await make(policy, workers=[w("a"), w("b"), w("x", model="other"), w("u", health=Health.UNHEALTHY),
                                        w("dr", draining=True), w("z", weight=0.0)])
    seen = Counter()
    for i in range(40):
        seen[(await plane.place(entry(f"r{i}"))).decode.worker_id] += 1
    assert set(seen) <= {"a", "b"} and (len(seen) == 2 or policy == "cache_aware")


async def test_drain_and_weight_changes_take_effect_at_the_next_placement():
    plane = await make(workers=[w("a"), w("b")])
    plane.fleet.put(dataclasses.replace(plane.fleet.get("a"), draining=True))
    assert {(await plane.place(entry(f"r{i}"))).decode.worker_id for i in range(5)} == {"b"}
    plane.fleet.put(dataclasses.replace(plane.fleet.get("a"), draining=False))
    plane.fleet.put(dataclasses.replace(plane.fleet.get("b"), weight=0.0))
    assert {(await plane.place(entry(f"s{i}"))).decode.worker_id for i in range(5)} == {"a"}


async def test_parallel_entry_picks_and_charges_both_legs_at_once():
    plane = await make(workers=[w("p1", Role.PREFILL), w("p2", Role.PREFILL), w("d", Role.DECODE)], flow="parallel")
    p = await plane.place(entry("r", tokens=30, max_tokens=5))
    assert p.flow == pb.FLOW_PARALLEL and p.prefill.worker_id in ("p1", "p2") and p.decode.worker_id == "d"
    assert (await plane.load("d"))[1] == 35
    assert (await plane.load(p.prefill.worker_id))[1] == 30
    await plane.report("r", pb.EVENT_PREFILL_DONE)
    assert (await plane.load(p.prefill.worker_id))[0] == 0
    assert (await plane.load("d"))[0] == 1


async def test_layerwise_entry_picks_decode_first_and_hands_over_to_the_metaserver():
    plane = await make(workers=[w("p1", Role.PREFILL), w("p2", Role.PREFILL), w("d", Role.DECODE)], flow="layerwise")
    plane.placer.metaserver_url = "http://cp:1/v1/metaserver"
    seen = []
    plane.placer.layerwise_placed.subscribe(lambda req, out: seen.append((req.request_id, out.decode.worker_id)))
    ended: list[str] = []
    plane.lifecycle.request_ended.subscribe(ended.append)
    p = await plane.place(entry("r"))
    assert p.flow == pb.FLOW_LAYERWISE and p.decode.worker_id == "d" and not p.prefill.worker_id
    assert p.metaserver_url == "http://cp:1/v1/metaserver" and seen == [("r", "d")]
    assert [(await plane.load(x))[0] for x in ("p1", "p2")] == [0, 0]
    # The metaserver later places the prefill leg of the same request.
    pre = await plane.place(pb.PlaceRequest(request_id="r", model="m", leg=pb.LEG_PREFILL, prompt_tokens=10))
    assert pre.flow == pb.FLOW_LAYERWISE and pre.prefill.worker_id in ("p1", "p2")
    await plane.report("r", pb.EVENT_CANCELLED)
    assert ended == ["r"] and await plane.store.get("r") is None


async def test_leg_failed_releases_only_that_worker_and_keeps_the_request():
    plane = await make(workers=[w("p1", Role.PREFILL), w("p2", Role.PREFILL), w("d", Role.DECODE)])
    first = await plane.place(entry("r", tokens=10))
    bad = first.prefill.worker_id
    await plane.report("r", pb.EVENT_LEG_FAILED, worker_id=bad, upstream_status=500, message="boom")
    assert (await plane.load(bad))[0] == 0
    assert plane.fleet.state(bad).failures_total == 1
    retry = await plane.place(pb.PlaceRequest(request_id="r", model="m", leg=pb.LEG_PREFILL, prompt_tokens=10,
                                              exclude_workers=[bad]))
    assert retry.prefill.worker_id not in ("", bad)
    assert await plane.store.get("r") is not None


class CountingStore(MemoryStore):
    """Records which workers' loads each placement reads."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[int] = []

    async def loads(self, worker_ids):
        ids = list(worker_ids)
        self.read.append(len(ids))
        return await super().loads(ids)


async def test_placement_reads_only_its_candidates_not_the_fleet():
    plane = await make(workers=[w("a"), w("b")])
    store = CountingStore()
    fleet = plane.fleet
    for i in range(500):   # a large fleet of other models and roles
        spec, _ = w(f"o{i}", role=Role.DECODE if i % 2 else Role.BOTH, model=f"other-{i % 7}")
        fleet.put(spec)
        fleet.set_state(spec.id, HealthState(health=Health.HEALTHY))
    for spec in fleet.specs():
        await store.put_spec(spec)
    placer = Placer(store, fleet, build_profile("least_load"))
    for i in range(10):
        assert (await placer.place(entry(f"r{i}"))).decode.worker_id in ("a", "b")
    assert store.read == [2] * 10


async def test_a_pd_entrys_paired_decode_prediction_reads_a_sample_of_a_large_decode_group():
    plane = await make(workers=[w("p0", Role.PREFILL), w("p1", Role.PREFILL)])
    store = CountingStore()
    fleet = plane.fleet
    for i in range(200):
        spec, _ = w(f"d{i}", role=Role.DECODE)
        fleet.put(spec)
        fleet.set_state(spec.id, HealthState(health=Health.HEALTHY))
    for spec in fleet.specs():
        await store.put_spec(spec)
    placer = Placer(store, fleet, build_profile("predicted_latency"))
    for i in range(5):
        p = await placer.place(entry(f"r{i}", explain=True))
        assert p.prefill.worker_id in ("p0", "p1") and "paired decode: d" in p.explanation
    # Each load read: the 2 prefill candidates, or a sample of the 200 decode engines (not all).
    sample = build_profile("predicted_latency").candidates
    assert all(n <= 2 + sample.deepest + sample.least_loaded + sample.random for n in store.read), store.read


async def test_reserve_is_all_or_nothing_per_call_and_release_is_per_leg():
    store = MemoryStore()
    from controlplane.state import Charge, RequestRecord

    rec = RequestRecord(request_id="r", model="m", prompt_tokens=10, max_tokens=5, session="s")
    await store.reserve(rec, (Charge("p", "prefill", 10), Charge("d", "decode", 15)))
    assert await store.loads(["p", "d"]) == {"p": Load(1, 10), "d": Load(1, 15)}
    await store.release("r", leg="prefill")
    assert await store.loads(["p", "d"]) == {"p": Load(0, 0), "d": Load(1, 15)}
    ended = await store.end("r")
    assert ended is not None and [c.leg for c in ended.charges] == ["decode"]
    assert await store.loads(["p", "d"]) == {"p": Load(0, 0), "d": Load(0, 0)}
    assert await store.end("r") is None


async def _fail(plane: Plane, wid: str, status: int, n: int = 1) -> None:
    for i in range(n):
        rid = f"f-{wid}-{status}-{i}-{id(plane)}"
        await plane.report(rid, pb.EVENT_LEG_FAILED, worker_id=wid, upstream_status=status, message="boom")


async def test_breaker_ejects_a_worker_that_keeps_failing_requests_and_lets_it_back():
    from controlplane.lifecycle import BreakerConfig

    plane = await make(workers=[w("a"), w("b")])
    plane.lifecycle.breaker = BreakerConfig(failures=3, base_s=0.2, max_s=1.0)
    await _fail(plane, "a", 500, 2)
    assert not plane.fleet.state("a").ejected(time.monotonic())        # two is not three
    await _fail(plane, "a", 503)
    state = plane.fleet.state("a")
    assert state.ejected(time.monotonic()) and state.circuit(time.monotonic()) == "open"
    assert state.health is Health.HEALTHY                               # health checks are a separate matter
    for i in range(6):
        assert (await plane.place(entry(f"r{i}"))).decode.worker_id == "b"
    explained = await plane.place(entry("x"), dry_run=True)
    assert "-a dropped by ejected" in explained.explanation
    await wait_until(lambda: not plane.fleet.state("a").ejected(time.monotonic()), timeout=2.0,
                     what="the ejection to end", interval=0.01)
    seen = {(await plane.place(entry(f"s{i}"))).decode.worker_id for i in range(6)}
    assert "a" in seen                                                  # back in rotation (half open)
    assert plane.fleet.state("a").circuit(time.monotonic()) == "half_open"
    await _fail(plane, "a", 500)                                        # one failure re-ejects, for longer
    again = plane.fleet.state("a")
    assert again.ejections == 2 and again.ejected_until - time.monotonic() > 0.25


async def test_a_success_closes_the_breaker_and_client_errors_never_open_it():
    from controlplane.lifecycle import BreakerConfig

    plane = await make(workers=[w("a")])
    plane.lifecycle.breaker = BreakerConfig(failures=2, base_s=60)
    await _fail(plane, "a", 400, 5)
    await _fail(plane, "a", 404, 5)
    assert not plane.fleet.state("a").ejected(time.monotonic())
    await _fail(plane, "a", 504)                                        # a timeout counts
    p = await plane.place(entry("ok"))
    await plane.report("ok", pb.EVENT_FIRST_TOKEN, ttft_ms=5)
    assert plane.fleet.state("a").failure_streak == 0
    assert (await plane.place(entry("ok2"))).decode.worker_id == p.decode.worker_id == "a"


async def test_a_non_streamed_answers_finished_report_alone_closes_the_breaker():
    """A whole answer sends no first-token report (the data plane's one report per
    non-streamed request): its end is the success that closes the breaker."""
    from controlplane.lifecycle import BreakerConfig

    plane = await make(workers=[w("a")])
    plane.lifecycle.breaker = BreakerConfig(failures=2, base_s=60)
    await _fail(plane, "a", 500)
    assert plane.fleet.state("a").failure_streak == 1
    await plane.place(entry("whole"))
    await plane.report("whole", pb.EVENT_FINISHED, completion_tokens=16, latency_ms=40)
    assert plane.fleet.state("a").failure_streak == 0
    await _fail(plane, "a", 500)                   # one failure after a success does not eject
    assert not plane.fleet.state("a").ejected(time.monotonic())


async def test_an_engines_retry_after_keeps_it_out_of_rotation_that_long():
    plane = await make(workers=[w("a"), w("b")])
    await plane.report("x", pb.EVENT_LEG_FAILED, worker_id="a", upstream_status=429, message="busy",
                       retry_after_s=0.3)
    state = plane.fleet.state("a")
    assert state.ejected(time.monotonic()) and state.ejections == 0     # not an escalation
    assert {(await plane.place(entry(f"r{i}"))).decode.worker_id for i in range(4)} == {"b"}
    await wait_until(lambda: not plane.fleet.state("a").ejected(time.monotonic()), timeout=2.0,
                     what="the ejection to end", interval=0.01)
    assert "a" in {(await plane.place(entry(f"s{i}"))).decode.worker_id for i in range(4)}
