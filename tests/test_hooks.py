"""The control plane's multi-subscriber hooks (controlplane/hooks.py) and the events that use
them: every subscriber is called, in order, and one that raises stops none of the others."""

from __future__ import annotations

import dataclasses
import logging

from controlplane.fleet import Fleet
from controlplane.hooks import AsyncHook, Hook
from controlplane.lifecycle import Lifecycle
from controlplane.placement import PlacementStats, Placer
from controlplane.registry import WorkerRegistry
from controlplane.scheduling import build_profile
from controlplane.state import MemoryStore
from controlplane.state.sync import SpecSync
from controlplane.workers import Health, HealthState, Role, WorkerSpec
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


def _boom(*_args) -> None:
    raise RuntimeError("a broken subscriber")


async def _aboom(*_args) -> None:
    raise RuntimeError("a broken subscriber")


def test_hook_calls_every_subscriber_in_order_past_one_that_raises(caplog):
    hook: Hook[[str, int]] = Hook("thing happened")
    calls: list[tuple] = []
    hook.subscribe(lambda a, b: calls.append(("first", a, b)))
    hook.subscribe(_boom)
    hook.subscribe(lambda a, b: calls.append(("third", a, b)))
    assert hook and len(hook) == 3
    with caplog.at_level(logging.ERROR, logger="controlplane.hooks"):
        hook.emit("x", 1)
    assert calls == [("first", "x", 1), ("third", "x", 1)]
    assert "thing happened" in caplog.text and "a broken subscriber" in caplog.text
    hook.unsubscribe(_boom)
    hook.emit("y", 2)
    assert calls[-2:] == [("first", "y", 2), ("third", "y", 2)] and len(hook) == 2


async def test_async_hook_awaits_every_subscriber_in_order_past_one_that_raises(caplog):
    hook: AsyncHook[[str]] = AsyncHook("worker left")
    calls: list[str] = []

    async def first(x: str) -> None:
        calls.append("first " + x)

    async def third(x: str) -> None:
        calls.append("third " + x)

    for fn in (first, _aboom, third):
        hook.subscribe(fn)
    with caplog.at_level(logging.ERROR, logger="controlplane.hooks"):
        await hook.emit("w")
    assert calls == ["first w", "third w"] and "worker left" in caplog.text


def test_an_empty_hook_is_false():
    assert not Hook("nobody listens") and not AsyncHook("nobody listens")


# ---------------------------------------------------------------------------- the events


def _spec(wid: str, role: Role = Role.BOTH) -> WorkerSpec:
    return WorkerSpec(id=wid, url=f"http://{wid}:8000", role=role, model="m")


async def test_registry_emits_worker_added_and_removed_to_every_subscriber():
    store, fleet = MemoryStore(), Fleet()
    registry = WorkerRegistry(store, fleet)
    added_a: list[str] = []
    added_b: list[str] = []
    removed_a: list[str] = []
    removed_b: list[str] = []

    async def note(into: list[str], value: str) -> None:
        into.append(value)

    registry.events.added.subscribe(lambda s: note(added_a, s.id))
    registry.events.added.subscribe(_aboom)
    registry.events.added.subscribe(lambda s: note(added_b, s.id))
    registry.events.removed.subscribe(lambda wid: note(removed_a, wid))
    registry.events.removed.subscribe(_aboom)
    registry.events.removed.subscribe(lambda wid: note(removed_b, wid))
    await registry.add(url="http://w1:8000", role=Role.BOTH, model="m", worker_id="w1")
    await wait_until(lambda: added_a == ["w1"] and added_b == ["w1"])   # (emitted from a task)
    assert await registry.remove("w1")
    assert removed_a == ["w1"] and removed_b == ["w1"]
    await registry.stop()


async def test_spec_sync_emits_on_the_same_worker_events():
    """Another replica's changes, read from the shared store, reach the same subscribers."""
    store, fleet = MemoryStore(), Fleet()
    registry = WorkerRegistry(store, fleet)
    seen: list[str] = []

    async def added(spec: WorkerSpec) -> None:
        seen.append("+" + spec.id)

    async def removed(wid: str) -> None:
        seen.append("-" + wid)

    registry.events.added.subscribe(_aboom)
    registry.events.added.subscribe(added)
    registry.events.removed.subscribe(removed)
    sync = SpecSync(store, fleet, events=registry.events)
    await store.put_spec(_spec("other"))       # as another replica would
    await sync.refresh()
    await store.put_spec(dataclasses.replace(_spec("other"), weight=2.0))        # re-weighed: not news
    await sync.refresh()
    moved = dataclasses.replace(_spec("other"), kv_events="tcp://10.0.0.9:5557")   # registered again elsewhere
    await store.put_spec(moved)
    await sync.refresh()
    await store.remove_spec("other")
    await sync.refresh()
    assert seen == ["+other", "+other", "-other"]


async def _plane(flow: str) -> tuple[MemoryStore, Placer, Lifecycle]:
    store, fleet, stats = MemoryStore(), Fleet(), PlacementStats.new()
    for spec in (_spec("p", Role.PREFILL), _spec("d", Role.DECODE)):
        await store.put_spec(spec)
        fleet.put(spec)
        fleet.set_state(spec.id, HealthState(health=Health.HEALTHY))
    placer = Placer(store, fleet, build_profile("least_load"), pd_flow=flow, stats=stats)
    return store, placer, Lifecycle(store, fleet, stats)


async def test_layerwise_placed_reaches_every_subscriber_who_may_add_to_the_placement():
    _, placer, _ = await _plane("layerwise")
    placer.metaserver_url = "http://cp:1/v1/metaserver"
    seen: list[str] = []

    def token(req: pb.PlaceRequest, out: pb.Placement) -> None:
        out.metaserver_url += "?token=t"

    placer.layerwise_placed.subscribe(token)
    placer.layerwise_placed.subscribe(_boom)
    placer.layerwise_placed.subscribe(lambda req, out: seen.append(f"{req.request_id} {out.decode.worker_id}"))
    p = await placer.place(pb.PlaceRequest(request_id="r", model="m", leg=pb.LEG_ENTRY, prompt_tokens=10))
    assert not p.error and p.metaserver_url == "http://cp:1/v1/metaserver?token=t" and seen == ["r d"]


async def test_request_ended_reaches_every_subscriber_whatever_ended_it():
    store, placer, lifecycle = await _plane("sequential")
    first: list[str] = []
    last: list[str] = []
    lifecycle.request_ended.subscribe(first.append)
    lifecycle.request_ended.subscribe(_boom)
    lifecycle.request_ended.subscribe(last.append)
    for rid in ("a", "b"):
        p = await placer.place(pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=10), "s1")
        assert not p.error
    await lifecycle.report(pb.LifecycleEvent(request_id="a", kind=pb.EVENT_FINISHED))
    assert first == last == ["a"]
    # An orphan's release ends it too (no report).
    assert await lifecycle.orphan_session("s1") == 1
    assert await lifecycle.release_orphans(older_than_s=0) == 1
    assert first == last == ["a", "b"] and await store.get("b") is None


async def test_the_worker_watch_checks_and_follows_a_new_worker_only_once_started():
    """Workers known at start-up are checked together by HealthChecker.start and followed
    after a KV snapshot is loaded; from then on a worker that joins is at once."""
    from controlplane.compose import WorkerWatch
    from controlplane.prediction import Predictor

    calls: list[str] = []

    class Health:
        async def check(self, spec: WorkerSpec) -> None:
            calls.append("check " + spec.id)

    class KV:
        async def watch(self, spec: WorkerSpec) -> None:
            calls.append("watch " + spec.id)

        async def unwatch(self, worker_id: str) -> None:
            calls.append("unwatch " + worker_id)

    class Forgetting(Predictor):
        def forget(self, worker_id: str) -> None:
            calls.append("forget " + worker_id)

    store, fleet = MemoryStore(), Fleet()
    registry = WorkerRegistry(store, fleet)
    watch = WorkerWatch(Health(), KV(), Forgetting())
    registry.events.added.subscribe(watch.added)
    registry.events.removed.subscribe(watch.removed)
    await registry.events.added.emit(_spec("early"))
    assert calls == []
    watch.start()
    await registry.events.added.emit(_spec("late"))
    await registry.events.removed.emit("late")
    assert calls == ["check late", "watch late", "forget late", "unwatch late"]
