"""Placement and the load ledger, in process: load is current at every placement."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.placement import Placer
from controlplane.scheduling import build_profile
from controlplane.state import MemoryStore
from controlplane.workers import Health, Role, Worker
from protos import omni_proxy_pb2 as pb


async def make(policy="least_load", workers=()):
    store = MemoryStore()
    for w in workers:
        await store.upsert_worker(w)
    return Placer(store, build_profile(policy)), store


def w(wid, role=Role.BOTH, model="m", health=Health.HEALTHY):
    return Worker(id=wid, url=f"http://{wid}", role=role, model=model, health=health)


def entry(rid, tokens=100, model="m", **kw):
    return pb.PlaceRequest(request_id=rid, model=model, leg=pb.LEG_ENTRY, prompt_tokens=tokens, **kw)


async def test_burst_is_spread_because_load_is_counted_at_placement():
    placer, store = await make(workers=[w("a"), w("b"), w("c")])
    got = Counter()
    for i in range(30):
        p = await placer.place(entry(f"r{i}"))
        got[p.decode.worker_id] += 1
    assert got == {"a": 10, "b": 10, "c": 10}
    a = await store.get_worker("a")
    assert a.inflight_requests == 10 and a.inflight_tokens == 1000


async def test_finished_reports_release_exactly_what_was_charged():
    placer, store = await make(workers=[w("a")])
    await placer.place(entry("r1", tokens=50, max_tokens=10))
    a = await store.get_worker("a")
    assert (a.inflight_requests, a.inflight_tokens) == (1, 60)
    await placer.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED))
    assert (a.inflight_requests, a.inflight_tokens) == (0, 0)
    # A duplicate or unknown report changes nothing.
    await placer.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED))
    await placer.report(pb.LifecycleEvent(request_id="nope", kind=pb.EVENT_FAILED))
    assert (a.inflight_requests, a.inflight_tokens) == (0, 0)


async def test_pd_entry_then_decode_and_prefill_release():
    placer, store = await make(workers=[w("p", Role.PREFILL), w("d", Role.DECODE)])
    first = await placer.place(entry("r1", tokens=40))
    assert first.flow == pb.FLOW_SEQUENTIAL and first.prefill.worker_id == "p"
    second = await placer.place(pb.PlaceRequest(request_id="r1", model="m", leg=pb.LEG_DECODE, prompt_tokens=40))
    assert second.decode.worker_id == "d"
    p, d = await store.get_worker("p"), await store.get_worker("d")
    assert p.inflight_requests == d.inflight_requests == 1
    await placer.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_PREFILL_DONE))
    assert p.inflight_requests == 0 and d.inflight_requests == 1
    await placer.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_CANCELLED))
    assert d.inflight_requests == 0 and d.inflight_tokens == 0


async def test_prefill_workers_are_skipped_without_a_decode_worker():
    placer, _ = await make(workers=[w("p", Role.PREFILL), w("d", Role.DECODE, health=Health.UNHEALTHY), w("b")])
    for i in range(5):
        p = await placer.place(entry(f"r{i}"))
        assert p.flow == pb.FLOW_AGGREGATED and p.decode.worker_id == "b"


async def test_errors_distinguish_unknown_model_from_no_healthy_worker():
    placer, _ = await make(workers=[w("a", health=Health.UNHEALTHY)])
    p = await placer.place(entry("r", model="zzz"))
    assert p.error == pb.UNKNOWN_MODEL and "zzz" in p.error_message
    p = await placer.place(entry("r"))
    assert p.error == pb.NO_HEALTHY_WORKER and "healthy" in p.error_message


async def test_session_end_keeps_load_until_grace_and_claims_move_requests():
    placer, store = await make(workers=[w("a")])
    for i in range(3):
        await placer.place(entry(f"s1-{i}"), session="s1")
    await placer.place(entry("s2-0"), session="s2")
    a = await store.get_worker("a")
    assert a.inflight_requests == 4
    assert await placer.orphan_session("s1") == 3
    assert a.inflight_requests == 4              # a blip is not the end of the requests
    assert await placer.claim("s3", ["s1-0", "s2-0", "unknown"]) == 1   # s2-0 has a live owner
    assert await placer.release_orphans(older_than_s=0) == 2
    assert a.inflight_requests == 2
    assert await placer.orphan_session("s3") == 1 and await placer.orphan_session("s2") == 1


async def test_unreachable_worker_reported_by_data_plane_is_marked_unhealthy():
    placer, store = await make(workers=[w("a"), w("b")])
    p = await placer.place(entry("r"))
    await placer.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_FAILED, worker_id=p.decode.worker_id,
                                          upstream_status=0, message="connection refused"))
    bad = await store.get_worker(p.decode.worker_id)
    assert bad.health is Health.UNHEALTHY and bad.failures_total == 1
    for i in range(4):
        assert (await placer.place(entry(f"x{i}"))).decode.worker_id != bad.id


async def test_dry_run_explains_without_charging():
    placer, store = await make(workers=[w("a"), w("b")])
    p = await placer.place(entry("r"), dry_run=True)
    assert p.decode.worker_id in ("a", "b") and "policy=least_load" in p.explanation
    assert all(x.inflight_requests == 0 for x in await store.list_workers())


@pytest.mark.parametrize("policy", ["round_robin", "random", "power_of_two", "least_load"])
async def test_every_policy_places_on_a_healthy_matching_worker(policy):
    placer, _ = await make(policy, workers=[w("a"), w("b"), w("x", model="other"), w("u", health=Health.UNHEALTHY)])
    seen = Counter()
    for i in range(40):
        seen[(await placer.place(entry(f"r{i}"))).decode.worker_id] += 1
    assert set(seen) <= {"a", "b"} and len(seen) == 2


async def _pd_placer(flow: str):
    store = MemoryStore()
    for x in (w("p1", Role.PREFILL), w("p2", Role.PREFILL), w("d", Role.DECODE)):
        await store.upsert_worker(x)
    return Placer(store, build_profile("least_load"), pd_flow=flow), store


async def test_parallel_entry_picks_and_charges_both_legs_at_once():
    placer, store = await _pd_placer("parallel")
    p = await placer.place(entry("r", tokens=30, max_tokens=5))
    assert p.flow == pb.FLOW_PARALLEL and p.prefill.worker_id in ("p1", "p2") and p.decode.worker_id == "d"
    assert (await store.get_worker("d")).inflight_tokens == 35
    assert (await store.get_worker(p.prefill.worker_id)).inflight_tokens == 30
    await placer.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_PREFILL_DONE))
    assert (await store.get_worker(p.prefill.worker_id)).inflight_requests == 0
    assert (await store.get_worker("d")).inflight_requests == 1


async def test_layerwise_entry_picks_decode_first_and_hands_over_to_the_metaserver():
    placer, store = await _pd_placer("layerwise")
    placer.metaserver_url = "http://cp:1/v1/metaserver"
    seen = []
    placer.on_layerwise = lambda req, out: seen.append((req.request_id, out.decode.worker_id))
    ended = []
    placer.on_request_end = ended.append
    p = await placer.place(entry("r"))
    assert p.flow == pb.FLOW_LAYERWISE and p.decode.worker_id == "d" and not p.prefill.worker_id
    assert p.metaserver_url == "http://cp:1/v1/metaserver" and seen == [("r", "d")]
    assert all(x.inflight_requests == 0 for x in (await store.get_worker("p1"), await store.get_worker("p2")))
    # The metaserver later places the prefill leg of the same request.
    pre = await placer.place(pb.PlaceRequest(request_id="r", model="m", leg=pb.LEG_PREFILL, prompt_tokens=10))
    assert pre.flow == pb.FLOW_LAYERWISE and pre.prefill.worker_id in ("p1", "p2")
    await placer.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_CANCELLED))
    assert ended == ["r"] and await placer.store.get_request("r") is None


async def test_leg_failed_releases_only_that_worker_and_keeps_the_request():
    placer, store = await _pd_placer("sequential")
    first = await placer.place(entry("r", tokens=10))
    bad = first.prefill.worker_id
    await placer.report(pb.LifecycleEvent(request_id="r", kind=pb.EVENT_LEG_FAILED, worker_id=bad,
                                          upstream_status=500, message="boom"))
    assert (await store.get_worker(bad)).inflight_requests == 0
    assert (await store.get_worker(bad)).failures_total == 1
    retry = await placer.place(pb.PlaceRequest(request_id="r", model="m", leg=pb.LEG_PREFILL, prompt_tokens=10,
                                               exclude_workers=[bad]))
    assert retry.prefill.worker_id not in ("", bad)
    assert (await store.get_request("r")) is not None
