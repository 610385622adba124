"""A session never makes one placement wait for another's work (issue 19, item 2).

An in-process control plane whose ledger holds one request's reservation (as a Redis round
trip would) until the test lets it go: the placement behind it on the same data-plane session
is answered meanwhile, and a report about the held request, sent while it waits, still takes
effect after its reservation (no load is left charged).
"""

from __future__ import annotations

import asyncio

from dataplane.placement_client import PlacementClient
from omni_runtime.eager import start_eagerly
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


def _entry(rid: str) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, leg=pb.LEG_ENTRY, prompt_tokens=16, max_tokens=8)


async def test_a_placement_waiting_on_the_ledger_does_not_hold_up_the_next(inproc_cp, monkeypatch):
    store = inproc_cp.store
    reserve = store.reserve
    entered, gate = asyncio.Event(), asyncio.Event()

    async def held_reserve(record, charges, **notes):
        if record.request_id == "held":
            entered.set()
            await gate.wait()
        return await reserve(record, charges, **notes)

    monkeypatch.setattr(store, "reserve", held_reserve)
    client = PlacementClient(f"127.0.0.1:{inproc_cp.grpc_port}", "dp-concurrency", timeout_s=10.0)
    await client.start()
    try:
        assert await client.wait_connected(10)
        await wait_until(lambda: inproc_cp.fleet.state("w").health.value == "healthy", what="worker healthy")
        held = asyncio.ensure_future(client.place(_entry("held")))
        await asyncio.wait_for(entered.wait(), 10)
        # the held request ends (its client went away) while its placement still waits
        client.report(pb.LifecycleEvent(request_id="held", kind=pb.EVENT_CANCELLED))
        nxt = await asyncio.wait_for(client.place(_entry("next")), 10)
        assert not nxt.error and nxt.decode.worker_id == "w"
        assert not held.done(), "the held placement was answered before its ledger call returned"
        gate.set()
        placed = await asyncio.wait_for(held, 10)
        assert not placed.error
        client.report(pb.LifecycleEvent(request_id="next", kind=pb.EVENT_FINISHED))
        # the report about "held" went after its reservation: nothing stays charged
        await wait_until(lambda: _idle(store), what="both requests released")
    finally:
        await client.close()


async def _idle(store) -> bool:
    return not await store.records() and (await store.loads(["w"]))["w"].requests == 0


async def test_start_eagerly_runs_inline_until_the_first_wait():
    ran: list[str] = []

    async def quick() -> str:
        ran.append("quick")
        return "done"

    assert start_eagerly(quick()) is None and ran == ["quick"]   # finished here, no task

    gate = asyncio.Event()

    async def slow() -> str:
        ran.append("slow started")
        await gate.wait()
        ran.append("slow resumed")
        return "late"

    task = start_eagerly(slow())
    assert task is not None and ran[-1] == "slow started"      # started before any loop turn
    gate.set()
    assert await task == "late" and ran[-1] == "slow resumed"

    cleaned = asyncio.Event()

    async def cancelled() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    task = start_eagerly(cancelled())
    assert task is not None
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the cancel did not reach the coroutine")
    assert cleaned.is_set() and task.cancelled()
