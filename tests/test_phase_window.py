"""The phase_window queue stage (controlplane.scheduling.queue.PhaseWindow): the long prompts
of a data-parallel engine whose ranks step together are dispatched in one window, onto
different ranks (dp_rank = "phase_aligned"). In process: a placer over the memory ledger."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.fleet import Fleet
from controlplane.lifecycle import Lifecycle
from controlplane.placement import PlacementStats, Placer
from controlplane.prediction import Predictor
from controlplane.scheduling import build_profile
from controlplane.scheduling.queue import PhaseWindow
from controlplane.state import MemoryStore
from controlplane.workers import Health, HealthState, Role, WorkerSpec
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


async def placer(dp_size: int = 2, window_s: float = 30.0) -> Placer:
    store, fleet = MemoryStore(), Fleet()
    spec = WorkerSpec(id="e", url="http://e", role=Role.BOTH, model="m", dp_size=dp_size)
    await store.put_spec(spec)
    fleet.put(spec)
    fleet.set_state("e", HealthState(health=Health.HEALTHY))
    profile = build_profile("pw", {"pw": {"scorers": [{"name": "least_load"}], "dp_rank": "phase_aligned",
                                          "queue": {"name": "phase_window", "window_s": window_s,
                                                    "min_tokens": 2048}}})
    stats, predictor = PlacementStats.new(), Predictor()
    p = Placer(store, fleet, profile, stats=stats, predictor=predictor)
    Lifecycle(store, fleet, stats, predictor=predictor, queue=p.queue)
    return p


def entry(rid: str, tokens: int) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=tokens, max_tokens=8)


async def test_long_prompts_wait_for_a_full_window_and_go_together_to_different_ranks():
    p = await placer(dp_size=2)
    assert p.queue is not None
    first = await p.submit(entry("long1", 4000), "s")
    assert isinstance(first, asyncio.Future) and len(p.queue) == 1      # no prefill under way: it waits
    # A short prompt is never held (it waits one queue round, as everyone behind a waiter does).
    short = await p.submit(entry("chat", 200), "s")
    assert isinstance(short, asyncio.Future)
    await wait_until(short.done, what="the short prompt placed")
    assert not first.done()
    # The second long prompt fills the window (dp_size 2): both are dispatched, one per rank.
    second = await p.submit(entry("long2", 5000), "s")
    a, b = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert not a.error and not b.error
    assert {a.decode.dp_rank, b.decode.dp_rank} == {0, 1}
    assert len(p.queue) == 0
    await p.queue.stop()


async def test_a_long_prompt_joins_a_prefill_under_way_and_an_empty_window_runs_out():
    p = await placer(dp_size=4, window_s=0.05)
    assert p.queue is not None
    alone = await p.submit(entry("alone", 4000), "s")
    assert isinstance(alone, asyncio.Future)
    placed = await asyncio.wait_for(alone, 5)            # the window ran out: it goes alone
    assert not placed.error and placed.queued_ms >= 50
    # Its prefill is under way (4000 tokens charged, not settled): the next long prompt joins
    # the phase at once, on another rank.
    joined = await p.submit(entry("joins", 3000), "s")
    assert isinstance(joined, pb.Placement) and not joined.error
    assert joined.decode.dp_rank != placed.decode.dp_rank
    await p.queue.stop()


async def test_engines_without_dp_ranks_are_never_held():
    p = await placer(dp_size=1)
    assert isinstance(await p.submit(entry("long", 8000), "s"), pb.Placement)


def test_phase_window_refuses_bad_settings():
    with pytest.raises(ValueError, match="window_s"):
        PhaseWindow(window_s=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        PhaseWindow(min_tokens=0)
    with pytest.raises(ValueError, match="bad options for queue 'phase_window'"):
        build_profile("x", {"x": {"queue": {"name": "phase_window", "window": 1}}})
