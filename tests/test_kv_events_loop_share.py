"""KV events never hold the placement loop for a whole big batch (issue 19, item 2).

A real ZMQ publisher on 127.0.0.1 sends a batch of thousands of events (a long prompt's
eviction, one ``BlockRemoved`` per block as vLLM sends them) to a ``KVCache``; while it is being
decoded and applied, the loop must answer a placement's index lookup, and the batch must still
be applied whole and in order.
"""

from __future__ import annotations

import asyncio
import socket
import time

import msgpack
import pytest
import zmq.asyncio

from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.kvcache.subscriber import APPLY_SLICE, KVEventSource, KVEventSubscriber, LoopBudget
from controlplane.workers import Role, WorkerSpec
from tests.test_kvcache_subscriber import Publisher, batch, stored_map, until


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def removed(h: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}


async def test_placement_lookup_answered_while_a_big_batch_is_applied(ctx):
    pub = Publisher(ctx, topic=b"")
    kv = KVCache(KVCacheConfig(block_size=16))
    worker = WorkerSpec(id="w", url="http://w", role=Role.BOTH, model="m", kv_events=pub.endpoint)
    held = list(range(1, 65))              # what the worker holds before the big batch
    later = list(range(100_001, 100_033))  # stored by the big batch's last event
    calls: list[int] = []                  # blocks per handler call
    first_slice = asyncio.Event()
    on_events = kv._on_events

    def counting(engine, dp, events):
        on_events(engine, dp, events)
        calls.append(sum(len(e.block_hashes) for e in events))
        first_slice.set()

    kv._on_events = counting              # watch() hands this bound attribute to the subscriber
    # A slice is spent after every step: applying 20,000 removals of blocks nobody holds takes
    # about 1 ms here now, so with the default 1 ms slice the loop may not turn at all (flaky).
    kv.budget = LoopBudget(slice_s=1e-6)
    await kv.watch(worker)
    try:
        await pub.wait_subscribed()
        await pub.send(batch(stored_map(held)))
        await until(lambda: kv.match(held, [worker]).get("w") == len(held), "the held chain indexed")
        calls.clear()
        first_slice.clear()
        big = [removed(h) for h in range(200_000, 220_000)] + [stored_map(later, parent=held[-1])]
        seen: dict = {}

        async def placement() -> None:
            await first_slice.wait()
            # a placement's lookup, run while the batch is still being applied
            seen["calls"] = len(calls)
            seen["depth"] = kv.match(held, [worker]).get("w")

        probe = asyncio.ensure_future(placement())
        await pub.send(msgpack.packb([0.0, big, 0], use_bin_type=True))
        await until(lambda: kv.match(held + later, [worker]).get("w") == len(held) + len(later),
                    "the big batch applied", timeout=30.0)
        await probe
        assert sum(calls) == len(big) - 1 + len(later)  # every block applied, once
        assert len(calls) > 1 and all(APPLY_SLICE <= c < APPLY_SLICE + 64 for c in calls[:-1])  # in slices
        assert seen["calls"] < len(calls), "the lookup waited for the whole batch"
        assert seen["depth"] == len(held)               # the batch's removals did not touch these
    finally:
        await kv.stop()
        pub.close()


async def test_a_malformed_event_late_in_a_big_batch_applies_none_of_it(ctx):
    pub = Publisher(ctx)
    got: list[tuple] = []
    sub = KVEventSubscriber(KVEventSource("eng", pub.endpoint, topic=pub.topic),
                            lambda engine, dp, evs: got.append(evs), lambda engine: None, ctx=ctx)
    await sub.start()
    try:
        await pub.wait_subscribed()
        bad = [removed(h) for h in range(1, 5000)] + [{"type": "BlockStored", "block_hashes": [1], "block_size": "x"}]
        await pub.send(msgpack.packb([0.0, bad, 0], use_bin_type=True))
        await pub.send(batch(stored_map([7])))
        await until(lambda: sub.counters.received == 2 and len(got) == 1, "the good batch after the bad one")
        assert sub.counters.malformed == 1
        assert [ev.block_hashes for ev in got[0]] == [(7,)]
    finally:
        await sub.stop()
        pub.close()


async def test_what_arrives_during_a_slice_runs_before_the_next_slice():
    # A placement's request that arrives on a socket while a slice of event work holds the
    # loop is polled at the next turn, behind the event task's own wake-up: LoopBudget.spend
    # yields twice so that it runs right after this slice, not after the next one too.
    budget = LoopBudget(slice_s=0.0005)
    loop = asyncio.get_running_loop()
    rsock, wsock = socket.socketpair()
    rsock.setblocking(False)
    order: list[str] = []

    def readable() -> None:
        rsock.recv(16)
        order.append("request")

    loop.add_reader(rsock.fileno(), readable)
    try:
        for k in range(3):
            order.append(f"slice {k}")
            wsock.send(b"x")                   # arrives while this slice holds the loop
            until_t = time.perf_counter() + 0.002
            while time.perf_counter() < until_t:
                pass
            await budget.spend()
        assert order == ["slice 0", "request", "slice 1", "request", "slice 2", "request"], order
        assert budget.yields == 3
    finally:
        loop.remove_reader(rsock.fileno())
        rsock.close()
        wsock.close()


async def test_slices_are_bounded_in_events_as_well_as_blocks():
    # Slices are counted in blocks (a merged run of removals is many); an event without blocks
    # still counts one, so thousands of them are never handed over, and applied, at once.
    got: list[int] = []
    sub = KVEventSubscriber(KVEventSource("w", "tcp://127.0.0.1:1"), lambda e, dp, evs: got.append(len(evs)),
                            lambda e: None)
    empty = {"type": "BlockStored", "block_hashes": [], "block_size": 16}
    assert await sub._deliver("w", msgpack.packb([0.0, [empty] * 3000, 0], use_bin_type=True))
    assert sum(got) == 3000 and max(got) <= APPLY_SLICE and len(got) == -(-3000 // APPLY_SLICE)
