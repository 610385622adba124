"""A local placement that arrives with its end folded in (``Placer.settle``) leaves the same
state as the general path: the placement recorded and charged (``Placer.record``), then its
end reported (``Lifecycle.report``).

``Placer.settle`` computes what ``_local``'s placement context and ``ledger_charges`` would
for such a placement without building them (a local placement has no prefix chain, no
prediction, no DP rank). Two in-process control planes get the same seeded sequence of
requests, one through each path, with requests kept in flight in between (loads with prefill
work ahead, so what is left of it is predicted) and ends that teach (streamed first tokens,
finished answers, failures); then everything either path writes is compared: the counters,
the loads, the workers' health, every engine model the predictor learned, and the records
each end was learned from.
"""

from __future__ import annotations

import random
import types

import pytest

from bench.session_cost import control_plane
from controlplane import lifecycle as lifecycle_module
from protos import omni_proxy_pb2 as pb

WORKERS = ("a", "b", "c")


class Clock:
    """One fake clock for a control plane's placer and lifecycle: the paths run at the same times."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ended(rng: random.Random, rid: str, wid: str) -> pb.LifecycleEvent:
    kind = rng.choice((pb.EVENT_FINISHED, pb.EVENT_FINISHED, pb.EVENT_FAILED, pb.EVENT_CANCELLED))
    if kind == pb.EVENT_FAILED:
        return pb.LifecycleEvent(request_id=rid, kind=kind, worker_id=wid, upstream_status=rng.choice((500, 503, 0)),
                                 message="boom")
    streamed = rng.random() < 0.5
    ttft = rng.uniform(5, 200)
    return pb.LifecycleEvent(request_id=rid, kind=kind, completion_tokens=rng.randint(0, 40), streamed=streamed,
                             first_token=streamed and rng.random() < 0.8, ttft_ms=ttft,
                             latency_ms=ttft + rng.uniform(0, 500))


async def _run(seed: int, settle: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The seeded sequence on a fresh control plane; folded ends through ``settle`` or the general path."""
    c = await control_plane(*WORKERS)
    clock = Clock()
    c.placer.clock = clock
    monkeypatch.setattr(lifecycle_module, "time", types.SimpleNamespace(monotonic=clock))
    learned: list = []
    ended = c.lifecycle._ended

    def learning(record, event) -> None:
        learned.append((record, event.request_id))
        ended(record, event)

    monkeypatch.setattr(c.lifecycle, "_ended", learning)
    rng = random.Random(seed)
    in_flight: list[tuple[str, str]] = []
    for i in range(400):
        clock.now += rng.uniform(0.0, 0.05)
        op = rng.random()
        if op < 0.25 and in_flight:
            # An in-flight request's first token (teaches TTFT) or its end.
            rid, wid = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < 0.5:
                await c.lifecycle.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FIRST_TOKEN, streamed=True,
                                                           ttft_ms=rng.uniform(5, 200)))
                in_flight.append((rid, wid))
            else:
                await c.lifecycle.report(_ended(rng, rid, wid))
            continue
        wid = rng.choice(WORKERS + ("gone",) if rng.random() < 0.05 else WORKERS)
        rid = f"r{i}" if rng.random() > 0.02 else ""
        # (an empty prompt: nothing computed, so nothing its end settles on the engine)
        prompt = rng.choice((0, rng.randint(1, 3000)))
        req = pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=prompt,
                              max_tokens=rng.randint(0, 500), placed_on=wid)
        if op < 0.55:
            # Still in flight when the notice was written: recorded (charged) by both.
            if await c.placer.record(req, "s"):
                in_flight.append((rid, wid))
            continue
        end = _ended(rng, rid, wid)
        if settle:   # as SchedulerService._record does with a folded end
            record = await c.placer.settle(req, "s")
            if record is not None:
                c.lifecycle.settle(record, end)
        elif await c.placer.record(req, "s"):
            await c.lifecycle.report(end)
    for rid, _ in in_flight:   # then, with nothing ahead, each engine told it computes from now
        await c.lifecycle.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_CANCELLED))
    for wid in WORKERS:
        clock.now += 1.0
        req = pb.PlaceRequest(request_id=f"last-{wid}", model="m", leg=pb.LEG_ENTRY, max_tokens=3, placed_on=wid)
        if settle:
            record = await c.placer.settle(req, "s")
            assert record is not None
            c.lifecycle.settle(record, pb.LifecycleEvent(request_id=req.request_id, kind=pb.EVENT_CANCELLED))
        else:
            assert await c.placer.record(req, "s")
            await c.lifecycle.report(pb.LifecycleEvent(request_id=req.request_id, kind=pb.EVENT_CANCELLED))
    return {
        "placements": dict(c.fleet.placements),
        "placed": dict(c.placer.stats.placed),
        "errors": dict(c.placer.stats.errors),
        "loads": await c.store.loads(WORKERS),
        "in_flight": sorted(r.request_id for r in await c.store.records()),
        "health": {wid: c.fleet.state(wid) for wid in WORKERS},
        "models": sorted(c.placer.predictor.items()),
        "learned": learned,
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_folded_end_settled_directly_leaves_the_state_the_general_path_leaves(seed, monkeypatch):
    general = await _run(seed, False, monkeypatch)
    direct = await _run(seed, True, monkeypatch)
    assert general["errors"].get("LOCAL_PLACEMENT_UNRECORDED")          # the refusals were exercised
    assert any(m.ttft.n for _, m in general["models"])                    # and the predictor learned
    assert any(r.work_ahead_tokens > r.prompt_tokens for r, _ in general["learned"] if r is not None)
    for key in general:
        assert direct[key] == general[key], key
