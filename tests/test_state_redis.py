"""The Redis state store against a real redis-server, held to the in-memory store's behaviour.

The behavioural tests run twice, on MemoryStore (the reference) and on RedisStore. Then
what only a shared store has: atomicity under concurrent callers and two replicas, the
sweep of a dead replica's reservations, Redis going away and coming back, and a control
plane placing through Redis. Assumption for the restart test: Redis persists writes
(``appendonly yes``); without persistence a restart loses the specs and the ledger (the
test on an ephemeral server checks that the store works again and that the loss shows
as a new ``spec_epoch``; tests/test_redis_faults.py checks that replicas write their
fleets back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time

import pytest

from controlplane.config import ControlPlaneConfig
from controlplane.state import Charge, MemoryStore, RequestRecord, StoreUnavailable, make_store
from controlplane.state.redis import RedisStore, decode_spec, encode_spec, safe_url
from controlplane.workers import IDLE, Load, Role, WorkerSpec
from tests.conftest import cancel_until_done, wait_until
from tests.redis_fixtures import RedisServer

_prefixes = itertools.count(1)


def _prefix() -> str:
    return f"t{next(_prefixes)}-{random.getrandbits(32):08x}:"


@pytest.fixture(params=["memory", "redis-default", "redis", "redis-py", "redis-mirror", "redis-local"])
async def store(request, redis_server):
    """The reference; the store ``[state] backend = "redis"`` makes with every other setting
    at its default (as deployed: write-behind reserves, a load mirror, behind the local
    fallback ledger); the Redis store (hot calls on its own wire client, each call answered
    by Redis); the Redis store with every call through redis-py (as with rediss:// URLs);
    with a load mirror (a long max age: loads must then follow this store's own calls
    exactly, from replies); and the local ledger (``ledger = "local"``,
    tests/test_state_local_ledger.py)."""
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "redis-default":
        s = make_store(ControlPlaneConfig.from_dict(
            {"state": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": _prefix()}}))
        try:
            yield s
        finally:
            await s.close()
        return
    if request.param == "redis-local":
        from controlplane.state.local import LocalLedgerStore

        s = LocalLedgerStore(RedisStore(redis_server.url, key_prefix=_prefix()))
        try:
            yield s
        finally:
            await s.close()
        return
    s = RedisStore(redis_server.url, key_prefix=_prefix(), fast_path=request.param != "redis-py",
                   loads_max_age_s=3600.0 if request.param == "redis-mirror" else 0.0)
    try:
        yield s
    finally:
        await s.close()


def _rec(rid: str, session: str = "s1", **kw) -> RequestRecord:
    kw.setdefault("created_at", 1000.25)
    return RequestRecord(request_id=rid, model="m", prompt_tokens=100, max_tokens=20, session=session, **kw)


def _norm(record: RequestRecord | None):
    """Times go through wall-clock conversion in Redis: equal to within a microsecond."""
    if record is None:
        return None
    return dataclasses.replace(record, created_at=round(record.created_at, 5), placed_at=round(record.placed_at, 5),
                               orphaned_at=round(record.orphaned_at, 5))


# ---------------------------------------------------------------------------- behaviour (both stores)

async def test_reserve_charges_every_worker_and_keeps_the_record(store):
    rec = await store.reserve(_rec("r1"), (Charge("p", "prefill", 100, 60), Charge("d", "decode", 120)))
    assert [c.worker_id for c in rec.charges] == ["p", "d"]
    assert _norm(await store.get("r1")) == _norm(rec)
    loads = await store.loads(["p", "d", "other"])
    assert loads == {"p": Load(1, 100, 60, 1), "d": Load(1, 120, 0, 0), "other": IDLE}
    assert list(await store.loads(["d"])) == ["d"]   # only what was asked
    assert await store.loads([]) == {}


def _writes_behind(store) -> bool:
    """A store whose reserve answers before Redis does (``write_behind``, the default)."""
    return bool(getattr(getattr(store, "shared", store), "write_behind", False))


async def test_a_later_leg_adds_charges_and_replaces_notes(store):
    await store.reserve(_rec("r1", work_ahead_tokens=5), (Charge("p", "prefill", 100, 60),))
    answer = await store.reserve(_rec("r1", work_ahead_tokens=999), (Charge("d", "decode", 120),),
                                 decode_batch=3, predicted_ttft_s=0.125)
    rec = await store.get("r1")
    if _writes_behind(store):
        # It answers before Redis: the record it was given, charged and noted (Ledger.reserve).
        # What the ledger holds is the merge, as in every store.
        assert (answer.work_ahead_tokens, answer.decode_batch, [c.leg for c in answer.charges]) == \
            (999, 3, ["decode"])
    else:
        assert _norm(answer) == _norm(rec)
    assert [c.leg for c in rec.charges] == ["prefill", "decode"]
    assert (rec.work_ahead_tokens, rec.decode_batch, rec.predicted_ttft_s) == (5, 3, 0.125)
    assert rec.created_at == pytest.approx(1000.25, abs=1e-6)
    assert (await store.loads(["d"]))["d"] == Load(1, 120, 0, 0)


async def test_a_record_built_holding_its_charges_is_charged_once(store):
    """``charged``: the commit step builds a new request's record with its charges (one
    constructor call per placement); the store charges them once and keeps them once."""
    charges = (Charge("p", "prefill", 100, 60), Charge("d", "decode", 120))
    rec = await store.reserve(dataclasses.replace(_rec("r1"), charges=charges), charges, charged=True)
    assert rec.charges == charges and (await store.get("r1")).charges == charges
    assert await store.loads(["p", "d"]) == {"p": Load(1, 100, 60, 1), "d": Load(1, 120, 0, 0)}
    assert (await store.end("r1")).charges == charges
    assert await store.loads(["p", "d"]) == {"p": IDLE, "d": IDLE}


async def test_release_by_leg_or_worker_keeps_the_record(store):
    await store.reserve(_rec("r1"), (Charge("p", "prefill", 100, 60), Charge("d", "decode", 120)))
    rec = await store.release("r1", leg="prefill")
    assert [c.leg for c in rec.charges] == ["decode"]
    assert (await store.loads(["p"]))["p"] == IDLE
    assert (await store.release("r1", leg="prefill")).charges == rec.charges   # nothing left to match
    rec = await store.release("r1", worker_id="\0")                            # matches nothing
    assert len(rec.charges) == 1
    rec = await store.release("r1", worker_id="d")
    assert rec.charges == () and await store.get("r1") is not None
    assert await store.loads(["p", "d"]) == {"p": IDLE, "d": IDLE}
    assert await store.release("unknown") is None


async def test_end_releases_everything_once(store):
    await store.reserve(_rec("r1"), (Charge("w", "aggregated", 120, 100),))
    await store.reserve(_rec("r2"), (Charge("w", "aggregated", 50, 10),))
    ended = await store.end("r1")
    assert ended.request_id == "r1" and len(ended.charges) == 1
    assert (await store.loads(["w"]))["w"] == Load(1, 50, 10, 1)
    assert await store.end("r1") is None                       # a duplicate end changes nothing
    assert (await store.loads(["w"]))["w"] == Load(1, 50, 10, 1)
    assert await store.get("r1") is None
    assert [r.request_id for r in await store.records()] == ["r2"]


async def test_settle_prefill_clears_only_work_ahead(store):
    await store.reserve(_rec("r1"), (Charge("w", "aggregated", 120, 100),))
    rec = await store.settle_prefill("r1")
    assert rec.charges[0].prefill_tokens == 0
    assert (await store.loads(["w"]))["w"] == Load(1, 120, 0, 0)
    assert (await store.settle_prefill("r1")) == rec           # idempotent
    assert (await store.loads(["w"]))["w"] == Load(1, 120, 0, 0)
    await store.end("r1")
    assert (await store.loads(["w"]))["w"] == IDLE
    assert await store.settle_prefill("unknown") is None


async def test_forget_worker_and_loads_never_go_negative(store):
    await store.reserve(_rec("old"), (Charge("w", "aggregated", 100, 80),))
    assert await store.forget_worker("w") == Load(1, 100, 80, 1)
    assert await store.forget_worker("w") == IDLE
    await store.end("old")                                     # nothing recreated for a removed worker
    assert (await store.loads(["w"]))["w"] == IDLE
    # re-added: a fresh count; a stale release of more than is there clamps at zero
    await store.reserve(_rec("a"), (Charge("w", "aggregated", 10, 5),))
    await store.reserve(_rec("stale"), (Charge("x", "aggregated", 10, 5),))
    await store.forget_worker("x")
    await store.reserve(_rec("b"), (Charge("x", "aggregated", 1, 0),))
    await store.end("stale")
    assert (await store.loads(["x"]))["x"] == Load(0, 0, 0, 0)
    assert (await store.loads(["w"]))["w"] == Load(1, 10, 5, 1)


async def test_orphan_claim_and_orphans(store):
    for rid in ("a", "b"):
        await store.reserve(_rec(rid, session="s1"), (Charge("w", "aggregated", 10),))
    await store.reserve(_rec("c", session="s2"), (Charge("w", "aggregated", 10),))
    assert await store.orphan("s1", 500.0) == 2
    assert await store.orphan("s1", 501.0) == 0
    rec = await store.get("a")
    assert rec.session == "" and rec.orphaned_at == pytest.approx(500.0, abs=1e-6)
    assert sorted(await store.orphans(500.0)) == ["a", "b"]     # at or before the cutoff
    assert await store.orphans(499.0) == []
    # a live session's request and unknown ids are not claimed
    assert await store.claim("s3", ["a", "c", "nope"]) == 1
    rec = await store.get("a")
    assert (rec.session, rec.orphaned_at) == ("s3", 0.0)
    assert await store.orphans(1e9) == ["b"]
    assert await store.claim("s3", ["a"]) == 0                   # already owned
    assert await store.claim("s3", []) == 0
    # the claimed request belongs to s3 now: orphaning s3 orphans it again
    assert await store.orphan("s3", 600.0) == 1
    assert sorted(await store.orphans(1e9)) == ["a", "b"]
    await store.end("a")
    assert await store.orphans(1e9) == ["b"]
    assert (await store.loads(["w"]))["w"].requests == 2


async def test_specs_round_trip(store):
    a = WorkerSpec("a", "http://10.0.0.1:8000", Role.PREFILL, model="m", weight=2.5, labels={"zone": "x"},
                   kv_events="tcp://10.0.0.1:5557", dp_size=2, bootstrap_port=8998, source="registry",
                   heartbeat_ttl_s=10.0)
    b = WorkerSpec("b", "http://10.0.0.2:8000", Role.DECODE)
    await store.put_spec(a)
    await store.put_spec(b)
    await store.put_spec(dataclasses.replace(b, draining=True))
    specs = {s.id: s for s in await store.specs()}
    assert specs == {"a": a, "b": dataclasses.replace(b, draining=True)}
    assert specs["a"].labels["zone"] == "x" and type(specs["a"].labels).__name__ == "mappingproxy"
    assert await store.remove_spec("a") == a
    assert await store.remove_spec("a") is None
    assert [s.id for s in await store.specs()] == ["b"]


@pytest.mark.parametrize("setting", ["answered", "default"])
async def test_same_results_as_memory_for_random_operations(redis_server, setting):
    """A seeded random mix of every ledger call: RedisStore answers exactly as MemoryStore,
    each call answered by Redis, and as ``make_store`` builds it by default (write-behind
    reserves, whose answers are the caller's record: the stored one is compared instead)."""
    rng = random.Random(7)
    mem = MemoryStore()
    red = RedisStore(redis_server.url, key_prefix=_prefix()) if setting == "answered" else make_store(
        ControlPlaneConfig.from_dict({"state": {"backend": "redis", "redis_url": redis_server.url,
                                                "key_prefix": _prefix()}}))
    behind = _writes_behind(red)
    assert behind == (setting == "default")
    workers, sessions = [f"w{i}" for i in range(4)], ["s1", "s2", "s3"]
    try:
        for step in range(400):
            rid = f"r{rng.randrange(25)}"
            op = rng.choice(["reserve", "reserve", "release", "end", "settle", "orphan", "claim", "orphans",
                             "forget", "get"])
            if op == "reserve":
                charges = tuple(Charge(rng.choice(workers), rng.choice(["prefill", "decode", "aggregated"]),
                                       rng.randrange(1, 500), rng.choice([0, 0, rng.randrange(1, 300)]))
                                for _ in range(rng.randrange(1, 3)))
                notes = {"decode_batch": rng.randrange(9)} if rng.random() < 0.5 else {}
                call = ("reserve", _rec(rid, session=rng.choice(sessions), created_at=float(step)), charges)
                results = [await s.reserve(call[1], charges, **notes) for s in (mem, red)]
                if behind:
                    results = [await s.get(rid) for s in (mem, red)]
            elif op == "release":
                kw = rng.choice([{"leg": "prefill"}, {"worker_id": rng.choice(workers)}, {}])
                results = [await s.release(rid, **kw) for s in (mem, red)]
            elif op == "end":
                results = [await s.end(rid) for s in (mem, red)]
            elif op == "settle":
                results = [await s.settle_prefill(rid) for s in (mem, red)]
            elif op == "orphan":
                sess = rng.choice(sessions)
                results = [await s.orphan(sess, float(step)) for s in (mem, red)]
            elif op == "claim":
                sess, ids = rng.choice(sessions), [f"r{rng.randrange(25)}" for _ in range(3)]
                results = [await s.claim(sess, ids) for s in (mem, red)]
            elif op == "orphans":
                cutoff = float(rng.randrange(step + 1))
                results = [sorted(await s.orphans(cutoff)) for s in (mem, red)]
            elif op == "forget":
                wid = rng.choice(workers)
                results = [await s.forget_worker(wid) for s in (mem, red)]
            else:
                results = [await s.get(rid) for s in (mem, red)]
            if isinstance(results[0], RequestRecord) or results[0] is None:
                results = [_norm(r) for r in results]
            assert results[0] == results[1], f"step {step}: {op} {rid}"
            assert await mem.loads(workers) == await red.loads(workers), f"step {step}: loads after {op}"
        assert sorted(map(_norm, await mem.records()), key=lambda r: r.request_id) == \
            sorted(map(_norm, await red.records()), key=lambda r: r.request_id)
    finally:
        await red.close()


# ---------------------------------------------------------------------------- atomicity

async def _traffic(stores: list, n: int, workers: list[str], seed: int) -> None:
    rng = random.Random(seed)

    async def one(i: int) -> None:
        s = stores[i % len(stores)]
        rid = f"req-{seed}-{i}"
        first = Charge(rng.choice(workers), "prefill", rng.randrange(1, 1000), rng.randrange(0, 500))
        await s.reserve(_rec(rid, session=f"sess{i % 5}"), (first,))
        await asyncio.sleep(0)
        await s.reserve(_rec(rid), (Charge(rng.choice(workers), "decode", rng.randrange(1, 1000)),), decode_batch=2)
        await s.settle_prefill(rid)
        await s.release(rid, leg="prefill")
        await s.end(rid)
        await s.end(rid)   # duplicate end report

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_concurrent_reserves_and_ends_leave_exactly_zero(store):
    workers = [f"w{i}" for i in range(6)]
    await _traffic([store], 300, workers, seed=1)
    assert all(load == Load(0, 0, 0, 0) for load in (await store.loads(workers)).values())
    assert await store.records() == []


async def test_two_replicas_share_one_ledger(redis_server):
    """Two stores on one prefix are two control-plane replicas: every charge is seen by both."""
    prefix, workers = _prefix(), [f"w{i}" for i in range(6)]
    a, b = RedisStore(redis_server.url, key_prefix=prefix), RedisStore(redis_server.url, key_prefix=prefix)
    try:
        # reserves from both replicas interleaved; the sum is exact
        await asyncio.gather(*(
            (a if i % 2 else b).reserve(_rec(f"r{i}"), (Charge(workers[i % 6], "aggregated", 10, 4),))
            for i in range(240)))
        expected = {w: Load(40, 400, 160, 40) for w in workers}
        assert await a.loads(workers) == expected == await b.loads(workers)
        # ended by the other replica, and twice
        await asyncio.gather(*((b if i % 2 else a).end(f"r{i}") for i in range(240)),
                             *((a if i % 2 else b).end(f"r{i}") for i in range(240)))
        assert all(load == Load(0, 0, 0, 0) for load in (await a.loads(workers)).values())
        # full placement traffic through both at once
        await _traffic([a, b], 300, workers, seed=2)
        assert all(load == Load(0, 0, 0, 0) for load in (await b.loads(workers)).values())
        assert await a.records() == []
    finally:
        await a.close()
        await b.close()


async def test_load_mirror_sees_other_replicas_within_its_max_age(redis_server):
    prefix = _prefix()
    a = RedisStore(redis_server.url, key_prefix=prefix, loads_max_age_s=0.3)
    b = RedisStore(redis_server.url, key_prefix=prefix)
    try:
        await b.reserve(_rec("b1"), (Charge("w", "aggregated", 10),))
        assert (await a.loads(["w"]))["w"] == Load(1, 10, 0, 0)        # first read goes to Redis
        await b.reserve(_rec("b2"), (Charge("w", "aggregated", 10),))
        await a.reserve(_rec("a1"), (Charge("w", "aggregated", 5),))    # its reply carries w's load now
        assert (await a.loads(["w"]))["w"] == Load(3, 25, 0, 0)
        await b.end("b1")
        assert (await a.loads(["w"]))["w"].requests == 3                # b's release: not seen yet

        async def caught_up() -> bool:
            return (await a.loads(["w"]))["w"] == Load(2, 15, 0, 0)
        await wait_until(caught_up, timeout=5, what="the mirror to refresh")
        assert (await a.loads(["w", "new"]))["new"] == IDLE              # unknown ids are read at once
    finally:
        await a.close()
        await b.close()


async def test_load_mirror_answers_at_once_while_it_refreshes(redis_server, monkeypatch):
    """A copy that is stale but young answers a placement at once while the refresh runs
    behind it; one older than ``mirror_wait_s`` (Redis has not answered for that long) waits."""
    a = RedisStore(redis_server.url, key_prefix=_prefix(), loads_max_age_s=0.01)
    try:
        await a.reserve(_rec("a1"), (Charge("w", "aggregated", 10),))
        assert (await a.loads(["w"]))["w"].requests == 1            # first read: Redis
        gate, read = asyncio.Event(), a._read_loads

        async def held(ids):
            await gate.wait()
            return await read(ids)

        monkeypatch.setattr(a, "_read_loads", held)
        await wait_until(lambda: time.monotonic() - a._mirror_at > a.loads_max_age_s, what="the copy to age")
        got = await asyncio.wait_for(a.loads(["w"]), 2)             # from the copy, not waiting
        assert got["w"].requests == 1 and a._refreshing is not None and not a._refreshing.done()
        a.mirror_wait_s = 0.0
        waiting = asyncio.ensure_future(a.loads(["w"]))
        done, _ = await asyncio.wait([waiting], timeout=0.2)
        assert not done, "a copy older than mirror_wait_s answered without Redis"
        gate.set()
        assert (await asyncio.wait_for(waiting, 5))["w"].requests == 1
    finally:
        await a.close()


async def test_write_behind_reserve_is_exact_once_sent(redis_server):
    """``write_behind``: reserve answers before Redis does; the charge lands in order before
    any later call of the same store, so loads and ends stay exact."""
    prefix, workers = _prefix(), [f"w{i}" for i in range(4)]
    wb = RedisStore(redis_server.url, key_prefix=prefix, write_behind=True, loads_max_age_s=0.2)
    other = RedisStore(redis_server.url, key_prefix=prefix)
    try:
        await wb.reserve(_rec("warm"), (Charge("w0", "aggregated", 1),))   # loads the script: then behind
        await wb.end("warm")
        assert (await wb.loads(workers))["w0"] == Load(0, 0, 0, 0)
        rec = await wb.reserve(_rec("r1"), (Charge("w1", "aggregated", 10, 4),), decode_batch=2)
        assert rec.charges == (Charge("w1", "aggregated", 10, 4),)
        assert (await wb.loads(["w1"]))["w1"] == Load(1, 10, 4, 1)        # its own charge (mirror or Redis)
        assert (await other.loads(["w1"]))["w1"] == Load(1, 10, 4, 1)     # and in Redis by the next call
        assert (await wb.end("r1")).request_id == "r1"
        await _traffic([wb, other], 200, workers, seed=3)
        assert all(load == Load(0, 0, 0, 0) for load in (await other.loads(workers)).values())

        async def mirror_zero() -> bool:   # the other replica's ends reach the mirror within its max age
            return all(load == Load(0, 0, 0, 0) for load in (await wb.loads(workers)).values())
        await wait_until(mirror_zero, timeout=5, what="the mirror to show zero")
        assert wb.write_behind_failures == 0 and await other.records() == []
    finally:
        await wb.close()
        await other.close()


async def test_a_loop_turns_ledger_calls_leave_in_one_write_in_order(redis_server):
    """Reserves (write-behind), ends, settles and gets made in one turn of the event loop go to
    Redis in one write (the write-behind reserves and ends in one script call); a call written
    at once (a loads read) sends what was queued before it, so it sees those charges."""
    prefix, n = _prefix(), 12
    wb = RedisStore(redis_server.url, key_prefix=prefix, write_behind=True)
    try:
        await wb.reserve(_rec("warm"), (Charge("w", "aggregated", 1),))   # loads the scripts
        for script in ("end", "settle_prefill"):
            await getattr(wb, script)("warm")
        assert wb.wire is not None and wb.write_behind
        for i in range(n):
            await wb.reserve(_rec(f"a{i}"), (Charge("w", "aggregated", 10, 4),))
        await wb.loads(["w"])   # (everything above has been sent)
        writes, commands = wb.wire.writes, wb.wire.commands

        async def report(i: int) -> RequestRecord | None:
            await wb.settle_prefill(f"a{i}")
            assert (await wb.get(f"a{i}")).charges == (Charge("w", "aggregated", 10, 0),)
            return await wb.end(f"a{i}")

        async def place(i: int) -> None:
            await wb.reserve(_rec(f"b{i}"), (Charge("w", "aggregated", 5),))

        ended = await asyncio.gather(*(report(i) for i in range(n)), *(place(i) for i in range(n)))
        assert [r.request_id for r in ended[:n]] == [f"a{i}" for i in range(n)]
        # 3 turns: settles and reserves, gets, ends; a settle and a get a request, the turn's
        # write-behind reserves one command, its ends another
        assert wb.wire.commands - commands == 2 * n + 2
        assert wb.wire.writes - writes == 3, "a turn's calls went out in more than one write"
        wb.loads_max_age_s = 0.0   # (loads read from Redis: a write of its own)
        for i in range(n, 2 * n):
            await wb.reserve(_rec(f"b{i}"), (Charge("w", "aggregated", 5),))
        assert (await wb.loads(["w"]))["w"] == Load(2 * n, 10 * n, 0, 0)   # the queued reserves went first
        await wb.reserve(_rec("c"), (Charge("w", "aggregated", 5),))
        assert (await wb.loads(["w", "x"]))["w"].requests == 2 * n + 1    # (a pipeline of reads too)
        assert wb.write_behind_failures == 0
    finally:
        await wb.close()


async def _warm_write_behind(redis_server) -> RedisStore:
    """A write-behind store whose connection and scripts are up (one reserve, end and read
    done), so a test counts only its own commands and writes."""
    wb = RedisStore(redis_server.url, key_prefix=_prefix(), write_behind=True, loads_max_age_s=3600.0)
    try:
        await wb.reserve(_rec("warm"), (Charge("w", "aggregated", 1),))
        await wb.end("warm")
        await wb.loads(["w"])
    except BaseException:
        await wb.close()
        raise
    return wb


async def test_write_behind_calls_join_one_script_call_only_until_another_command(redis_server):
    """A turn's write-behind reserves and ends share one script call (one command, one reply)
    while nothing else is queued after it; a command queued between them closes it, so a read
    queued after a reserve sees it and an end queued after the read is not applied before it."""
    wb = await _warm_write_behind(redis_server)
    try:
        assert wb.wire is not None
        writes, commands = wb.wire.writes, wb.wire.commands
        for i in range(3):
            await wb.reserve(_rec(f"r{i}"), (Charge("w", "aggregated", 10),))
        read = wb.wire.pipeline_nowait([("HGETALL", wb._k_rec + "r1")])   # queued after the reserves
        assert read is not None
        assert (await wb.end("r1")).request_id == "r1"
        await wb.end("r0")
        assert wb._record((await read)[0]).request_id == "r1"   # the reserve went first, the end after
        await wait_until(lambda: not wb._behind, timeout=5, what="the replies")
        assert (wb.wire.commands - commands, wb.wire.writes - writes) == (3, 1)
        assert (await wb.loads(["w"]))["w"] == Load(1, 10, 0, 0) == (await RedisStore(
            redis_server.url, key_prefix=wb.prefix).loads(["w"]))["w"]
        assert [r.request_id for r in await wb.records()] == ["r2"] and wb.write_behind_failures == 0
    finally:
        await wb.close()


async def test_one_script_call_takes_at_most_batch_max_callers(redis_server, monkeypatch):
    """A burst's write-behind calls are split into script calls of at most BATCH_MAX callers
    (one call holds Redis for all of them), still in one write and all applied."""
    from controlplane.state import redis_wire

    monkeypatch.setattr(redis_wire, "BATCH_MAX", 3)
    wb = await _warm_write_behind(redis_server)
    try:
        assert wb.wire is not None
        writes, commands = wb.wire.writes, wb.wire.commands
        for i in range(7):
            await wb.reserve(_rec(f"r{i}"), (Charge("w", "aggregated", 10),))
        await wait_until(lambda: not wb._behind, timeout=5, what="the replies")
        assert (wb.wire.commands - commands, wb.wire.writes - writes) == (3, 1)
        assert (await wb.loads(["w"]))["w"] == Load(7, 70, 0, 0) and len(await wb.records()) == 7
    finally:
        await wb.close()


async def test_the_mirror_keeps_its_own_charges_still_on_their_way_to_redis(redis_server, monkeypatch):
    """Write-behind reserves sent together: the reply to the first reports Redis's load
    without the later ones, which this replica already counts; the mirror keeps counting them
    (else a burst's placements would see fewer of their own charges than they made)."""
    wb = RedisStore(redis_server.url, key_prefix=_prefix(), write_behind=True, loads_max_age_s=3600.0)
    try:
        await wb.reserve(_rec("warm"), (Charge("w", "aggregated", 1),))
        await wb.end("warm")
        assert (await wb.loads(["w"]))["w"] == Load(0, 0, 0, 0)
        seen: list[Load] = []
        handle = wb._behind_done

        def spy(ops, fut: asyncio.Future) -> None:
            handle(ops, fut)
            seen.append(wb._mirror["w"])
        monkeypatch.setattr(wb, "_behind_done", spy)
        assert wb.wire is not None
        for i in range(5):
            await wb.reserve(_rec(f"r{i}"), (Charge("w", "aggregated", 10, 4),))
            wb.wire.pipeline_nowait([("PING",)])   # (a command queued between: each reserve a call of its own)
        assert (await wb.loads(["w"]))["w"] == Load(5, 50, 20, 5)
        await wait_until(lambda: len(seen) == 5, timeout=5, what="the replies")
        assert seen == [Load(5, 50, 20, 5)] * 5, "the mirror forgot charges not yet in Redis"
        assert wb._unconfirmed == {} and not wb._behind
    finally:
        await wb.close()


async def test_a_placing_replica_sees_others_charges_in_a_refresh_riding_its_writes(redis_server):
    """While a replica writes reserves, its load copy is refreshed in the same writes once it
    is RIDE_REFRESH_S old, whatever ``loads_max_age_s`` says (here an hour): another
    replica's charge shows up without a send of its own."""
    prefix = _prefix()
    a = RedisStore(redis_server.url, key_prefix=prefix, write_behind=True, loads_max_age_s=3600.0)
    b = RedisStore(redis_server.url, key_prefix=prefix)
    try:
        await a.reserve(_rec("a0"), (Charge("x", "aggregated", 1),))
        assert (await a.loads(["w", "x"]))["w"] == IDLE
        await b.reserve(_rec("b1"), (Charge("w", "aggregated", 10),))
        assert a.wire is not None
        writes, placed = a.wire.writes, itertools.count(1)

        async def seen() -> bool:
            await a.reserve(_rec(f"a{next(placed)}"), (Charge("x", "aggregated", 1),))
            return (await a.loads(["w"]))["w"].requests == 1
        await wait_until(seen, timeout=5, what="the other replica's charge in this one's copy")
        n = next(placed) - 1
        a.wire.flush()   # (the last reserve's write)
        assert a.wire.writes - writes == n, "the refresh was sent on its own"
        assert (await a.loads(["x"]))["x"].requests == n + 1   # its own charges: exact
    finally:
        await a.close()
        await b.close()


async def test_write_behind_goes_on_after_redis_flushes_its_scripts(redis_server):
    """A write-behind reserve that Redis answers NOSCRIPT (SCRIPT FLUSH) is one failure, counted;
    the next one loads the script again instead of failing forever."""
    s = RedisStore(redis_server.url, key_prefix=_prefix(), write_behind=True)
    try:
        await s.reserve(_rec("r0"), (Charge("w", "aggregated", 1),))
        await s.reserve(_rec("r1"), (Charge("w", "aggregated", 1),))   # behind, loaded
        assert (await s.loads(["w"]))["w"].requests == 2
        await s.redis.script_flush()
        await s.reserve(_rec("r2"), (Charge("w", "aggregated", 1),))
        await wait_until(lambda: s.write_behind_failures == 1, timeout=5, what="the failed reserve to be counted")
        await s.reserve(_rec("r3"), (Charge("w", "aggregated", 1),))
        assert (await s.loads(["w"]))["w"].requests == 3 and s.write_behind_failures == 1
        assert (await s.end("r3")).request_id == "r3"    # (the end's script: loaded again too)
    finally:
        await s.close()


async def test_a_write_behind_end_answers_from_this_replicas_copy(redis_server):
    """``write_behind``: the end of a request this replica reserved answers at once (Redis
    stopped meanwhile) with the record as this replica's own calls left it, and the load copy
    drops its charges at once; Redis applies the end when it runs again."""
    prefix = _prefix()
    s = RedisStore(redis_server.url, key_prefix=prefix, write_behind=True, loads_max_age_s=3600.0)
    other = RedisStore(redis_server.url, key_prefix=prefix)
    try:
        await s.reserve(_rec("r1"), (Charge("w", "aggregated", 10, 4),))
        assert (await s.settle_prefill("r1")).charges[0].prefill_tokens == 0    # (awaited: Redis's record)
        await s.reserve(_rec("r2"), (Charge("w", "aggregated", 5, 5),))
        assert (await s.loads(["w"]))["w"] == Load(2, 15, 5, 1)
        redis_server.pause()
        try:
            ended = await asyncio.wait_for(s.end("r1"), 0.5)
            assert ended.request_id == "r1" and ended.charges == (Charge("w", "aggregated", 10, 0),)
            assert (await asyncio.wait_for(s.loads(["w"]), 0.5))["w"] == Load(1, 5, 5, 1)
        finally:
            redis_server.resume()

        async def applied() -> bool:
            return (await other.loads(["w"]))["w"] == Load(1, 5, 5, 1)
        await wait_until(applied, timeout=5, what="Redis to apply the end")
        await wait_until(lambda: not s._behind, timeout=5, what="the end's reply")
        assert s.write_behind_failures == 0 and s._unconfirmed == {}
        assert (await s.loads(["w"]))["w"] == Load(1, 5, 5, 1)
        assert await s.end("r1") is None                      # (not its copy any more: Redis answers)
    finally:
        await s.close()
        await other.close()


async def test_write_behind_calls_that_cancel_out_are_each_confirmed(redis_server):
    """A reserve and the end of the same request both on their way, behind another call: the
    copy's count of this replica's unanswered calls stays right through every reply (their
    amounts cancel out before the last reply comes)."""
    s = RedisStore(redis_server.url, key_prefix=_prefix(), write_behind=True, loads_max_age_s=3600.0)
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        await s.reserve(_rec("warm"), (Charge("w", "aggregated", 1),))
        await s.end("warm")
        await wait_until(lambda: not s._behind, timeout=5, what="the warm-up's replies")
        await s.reserve(_rec("x"), (Charge("w", "aggregated", 3),))
        await s.reserve(_rec("a"), (Charge("w", "aggregated", 10, 4),))
        await s.end("a")                      # (one loop turn: all three on their way together)
        assert len(s._behind) == 3 and (await s.loads(["w"]))["w"] == Load(1, 3, 0, 0)
        await wait_until(lambda: not s._behind, timeout=5, what="the replies")
        assert errors == [] and s._unconfirmed == {} and s.write_behind_failures == 0
        assert (await s.loads(["w"]))["w"] == Load(1, 3, 0, 0)
    finally:
        loop.set_exception_handler(handler)
        await s.close()


async def test_a_turns_calls_read_and_write_each_load_once(redis_server, monkeypatch):
    """A loop turn's write-behind calls read each load they change once and write it once, or
    not at all when they cancel out (the end of a request and the next placement on the worker
    it freed); the loads are still MemoryStore's, call by call, clamping included (an end of
    a worker forgotten meanwhile, then a reserve there, in one call)."""
    from controlplane.state import redis as redis_store

    monkeypatch.setattr(redis_store, "RIDE_REFRESH_S", 3600.0)   # (no refresh between the calls: one script call)
    wb = await _warm_write_behind(redis_server)
    mem = MemoryStore()
    admin = wb.redis
    try:
        assert wb.wire is not None
        for s in (wb, mem):
            await s.reserve(_rec("a"), (Charge("w", "aggregated", 10, 4),))
            await s.reserve(_rec("old"), (Charge("x", "aggregated", 7, 2),))
        await wait_until(lambda: not wb._behind, timeout=5, what="the replies")
        for s in (wb, mem):
            await s.forget_worker("x")
        await admin.config_resetstat()
        for s in (wb, mem):   # one turn, one script call
            await s.end("a")
            await s.reserve(_rec("b"), (Charge("w", "aggregated", 10, 4),))
            await s.end("old")
            await s.reserve(_rec("c"), (Charge("x", "aggregated", 1, 0),))
            await s.reserve(_rec("d"), (Charge("y", "aggregated", 5, 0),))
        await wait_until(lambda: not wb._behind, timeout=5, what="the replies")
        stats = await admin.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert "cmdstat_hincrby" not in stats
        # HMGET: the three loads and the two ends' records; HSET: three records, the loads of x and y
        assert (stats["cmdstat_hmget"]["calls"], stats["cmdstat_hset"]["calls"]) == (5, 5)
        workers = ["w", "x", "y"]
        fresh = RedisStore(redis_server.url, key_prefix=wb.prefix)
        try:
            assert await fresh.loads(workers) == await mem.loads(workers) == {
                "w": Load(1, 10, 4, 1), "x": Load(1, 1, 0, 0), "y": Load(1, 5, 0, 0)}
        finally:
            await fresh.close()
        assert await wb.loads(workers) == await mem.loads(workers)
    finally:
        await wb.close()


async def test_a_write_behind_end_redis_did_not_take_is_replayed(redis_server):
    """The default store: a write-behind end that Redis refuses (its script cache flushed:
    NOSCRIPT) is handed to the ResilientStore, which replays it; the load leaves Redis, and
    no outage is declared for an error reply."""
    prefix = _prefix()
    store = make_store(ControlPlaneConfig.from_dict(
        {"state": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix}}))
    other = RedisStore(redis_server.url, key_prefix=prefix)
    try:
        await store.reserve(_rec("r0"), (Charge("w", "aggregated", 1),))
        await store.end("r0")                                 # (the end's script loaded, behind)
        await store.reserve(_rec("r1"), (Charge("w", "aggregated", 10),))

        async def in_redis(load: Load) -> bool:
            return (await other.loads(["w"]))["w"] == load
        await wait_until(lambda: in_redis(Load(1, 10, 0, 0)), timeout=5, what="the reserve in Redis")
        await store.shared.redis.script_flush()
        assert (await store.end("r1")).request_id == "r1"
        await wait_until(lambda: store.shared.write_behind_failures == 1, timeout=5, what="the end to fail")
        await wait_until(lambda: in_redis(IDLE), timeout=10, what="the end replayed")
        assert store.replayed == 1 and store.pending == 0 and store.outages == 0 and store.available
    finally:
        await store.close()
        await other.close()


async def test_reserve_survives_a_dropped_connection_without_charging_twice(redis_server):
    """A pooled connection that the server closed is reconnected transparently."""
    s = RedisStore(redis_server.url, key_prefix=_prefix())
    try:
        await s.reserve(_rec("r1"), (Charge("w", "aggregated", 10),))
        await s.redis.client_kill_filter(_type="normal", skipme=False)   # every client, ours too
        await s.reserve(_rec("r2"), (Charge("w", "aggregated", 10),))
        assert (await s.loads(["w"]))["w"] == Load(2, 20, 0, 0)
        # the same operation delivered twice (a retry after a lost reply) is applied once
        args = [s.prefix, s.replica_id, s.replica_ttl_ms, "r3", "op-x", "", "", '[["w","aggregated",5,0]]',
                1, "session", "", 0, 1, "w", "aggregated", 5, 0]
        await s._reserve(args=args)
        await s._reserve(args=args)
        assert (await s.loads(["w"]))["w"] == Load(3, 25, 0, 0)
    finally:
        await s.close()


# ---------------------------------------------------------------------------- replicas expire

async def test_a_dead_replicas_reservations_are_swept(redis_server):
    prefix = _prefix()
    dead = RedisStore(redis_server.url, key_prefix=prefix, replica_id="dead", replica_ttl_s=0.3)
    live = RedisStore(redis_server.url, key_prefix=prefix, replica_id="live", replica_ttl_s=30)
    try:
        await dead.heartbeat()
        await live.heartbeat()
        await dead.reserve(_rec("d1", session="sd"), (Charge("w", "aggregated", 10, 5),))
        await dead.reserve(_rec("d2", session="sd"), (Charge("w", "prefill", 20, 20),))
        await live.reserve(_rec("l1", session="sl"), (Charge("w", "aggregated", 7),))
        assert await live.sweep() == []                      # both alive
        assert (await live.loads(["w"]))["w"].requests == 3

        async def expired() -> bool:
            return not await live.redis.exists(prefix + "alive:dead")
        await wait_until(expired, timeout=5, what="the dead replica's heartbeat to expire")
        assert sorted(await live.sweep()) == ["d1", "d2"]
        assert (await live.loads(["w"]))["w"] == Load(1, 7, 0, 0)
        assert [r.request_id for r in await live.records()] == ["l1"]
        assert await live.sweep() == []
        assert await live.orphan("sd", 1.0) == 0             # its session index is gone too
    finally:
        await dead.close()
        await live.close()


async def test_a_dead_replicas_requests_can_be_orphaned_for_failover(redis_server):
    """``sweep(orphan_at=...)``: a data plane that moves to another replica claims them back."""
    prefix = _prefix()
    dead = RedisStore(redis_server.url, key_prefix=prefix, replica_id="dead", replica_ttl_s=0.3)
    live = RedisStore(redis_server.url, key_prefix=prefix, replica_id="live", replica_ttl_s=30)
    try:
        await live.heartbeat()
        await dead.reserve(_rec("d1", session="sd"), (Charge("w", "aggregated", 10),))   # reserve heartbeats
        await dead.reserve(_rec("d2", session="sd"), (Charge("w", "aggregated", 10),))

        async def expired() -> bool:
            return not await live.redis.exists(prefix + "alive:dead")
        await wait_until(expired, timeout=5, what="the dead replica's heartbeat to expire")
        now = time.monotonic()
        assert sorted(await live.sweep(orphan_at=now)) == ["d1", "d2"]
        assert (await live.loads(["w"]))["w"].requests == 2          # kept for the grace period
        assert sorted(await live.orphans(now)) == ["d1", "d2"]
        # records() finds them in the orphans, out of any replica's set
        assert sorted(r.request_id for r in await live.records()) == ["d1", "d2"]
        assert await live.claim("s-new", ["d1"]) == 1                 # the data plane came back here
        assert await live.orphans(now) == ["d2"]
        assert sorted(r.request_id for r in await live.records()) == ["d1", "d2"]
        await live.end("d2")                                          # what release_orphans does
        assert (await live.loads(["w"]))["w"].requests == 1
        assert [r.request_id for r in await live.records()] == ["d1"]
        # d1 is the live replica's now: a sweep of "dead" cannot touch it any more
        await live.redis.delete(prefix + "alive:live")
        other = RedisStore(redis_server.url, key_prefix=prefix, replica_id="other")
        try:
            assert await other.sweep() == ["d1"]
        finally:
            await other.close()
    finally:
        await dead.close()
        await live.close()


async def test_maintain_heartbeats_and_sweeps(redis_server):
    prefix = _prefix()
    dead = RedisStore(redis_server.url, key_prefix=prefix, replica_id="dead", replica_ttl_s=0.2)
    live = RedisStore(redis_server.url, key_prefix=prefix, replica_id="live", replica_ttl_s=0.3)
    task = asyncio.create_task(live.maintain(0.05, orphan=False))
    try:
        await dead.reserve(_rec("d1"), (Charge("w", "aggregated", 10),))

        async def swept() -> bool:
            return (await live.loads(["w"]))["w"].requests == 0
        await wait_until(swept, timeout=5, what="maintain() to sweep the dead replica")
        assert await live.redis.exists(prefix + "alive:live")   # and kept itself alive meanwhile
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await dead.close()
        await live.close()


# ---------------------------------------------------------------------------- Redis lost

async def test_redis_restart_raises_store_unavailable_then_recovers(redis_persistent):
    s = RedisStore(redis_persistent.url, key_prefix=_prefix(), socket_timeout_s=0.5)
    spec = WorkerSpec("w", "http://10.0.0.1:8000", Role.BOTH, labels={"a": "1"})
    try:
        await s.put_spec(spec)
        await s.reserve(_rec("r1"), (Charge("w", "aggregated", 10, 4),))
        redis_persistent.stop()
        for call in (s.loads(["w"]), s.reserve(_rec("r2"), (Charge("w", "aggregated", 1),)), s.end("r1"),
                     s.specs(), s.put_spec(spec), s.heartbeat(), s.sweep(), s.records(), s.ping()):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="unavailable"):
                await call
            assert time.monotonic() - started < 2.0     # fails fast: placement must not wait on it
        redis_persistent.start()
        # persisted (appendonly): the spec, the record and the load came back
        assert await s.specs() == [spec]
        assert (await s.loads(["w"]))["w"] == Load(1, 10, 4, 1)
        assert (await s.end("r1")).request_id == "r1"
        assert (await s.loads(["w"]))["w"] == Load(0, 0, 0, 0)
    finally:
        await s.close()


async def test_redis_without_persistence_comes_back_empty_and_usable():
    server = RedisServer().start()
    s = RedisStore(server.url, key_prefix=_prefix(), socket_timeout_s=0.5)
    try:
        epoch = await s.spec_epoch()
        assert await s.spec_epoch() == epoch                             # made once, then kept
        await s.reserve(_rec("r1"), (Charge("w", "aggregated", 10),))
        server.stop()
        with pytest.raises(StoreUnavailable):
            await s.get("r1")
        server.start()
        assert await s.get("r1") is None and await s.end("r1") is None   # state was lost with it
        # ...and it can be told: a new epoch (SpecSync then writes its fleet back,
        # tests/test_redis_faults.py)
        assert await s.spec_epoch() != epoch
        await s.reserve(_rec("r2"), (Charge("w", "aggregated", 3),))
        assert (await s.loads(["w"]))["w"] == Load(1, 3, 0, 0)
    finally:
        await s.close()
        server.close()


async def test_an_end_with_a_tombstone_makes_a_late_reserve_charge_nothing(redis_server):
    """A reserve that timed out against a stalled Redis runs when Redis wakes up, possibly
    after the request's end (ResilientStore replays ends with a tombstone): it must not
    charge a load that nothing would release. Plain ends leave no tombstone."""
    s = RedisStore(redis_server.url, key_prefix=_prefix())
    try:
        assert await s.end("late", tombstone_s=30) is None
        assert await s.reserve(_rec("late"), (Charge("w", "aggregated", 10),)) is None
        assert (await s.loads(["w"]))["w"] == IDLE and await s.get("late") is None and await s.records() == []
        assert await s.end("plain") is None
        await s.reserve(_rec("plain"), (Charge("w", "aggregated", 10),))   # no tombstone: charged
        assert (await s.loads(["w"]))["w"].requests == 1
        # a tombstone does not touch a record that exists
        assert (await s.end("plain", tombstone_s=30)).request_id == "plain"
        assert (await s.loads(["w"]))["w"].requests == 0
    finally:
        await s.close()


async def test_spec_changes_are_published_to_every_replica(redis_server):
    prefix = _prefix()
    a, b = RedisStore(redis_server.url, key_prefix=prefix), RedisStore(redis_server.url, key_prefix=prefix)
    seen: list = []

    async def watch() -> None:
        async for change in b.watch_specs():
            seen.append(change)

    task = asyncio.create_task(watch())
    try:
        v0 = await b.spec_version()

        async def ready() -> bool:   # the subscription is in place once a put is seen
            await a.put_spec(WorkerSpec("probe", "http://x", Role.BOTH))
            return bool(seen)
        await wait_until(ready, timeout=5, what="the spec subscription")
        seen.clear()
        await a.put_spec(WorkerSpec("w1", "http://10.0.0.1:1", Role.BOTH))
        await a.remove_spec("w1")
        await a.remove_spec("w1")   # nothing removed: nothing published

        def about_w1() -> list:   # (a probe published late may still arrive)
            return [(c.kind, c.worker_id) for c in seen if c.worker_id == "w1"]

        async def two() -> bool:
            return len(about_w1()) >= 2
        await wait_until(two, timeout=5, what="two spec changes")
        assert about_w1() == [("put", "w1"), ("del", "w1")]
        ver, specs = await b.specs_versioned()
        assert ver == seen[-1].version > v0 and [s.id for s in specs] == ["probe"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await a.close()
        await b.close()


async def test_a_cancelled_spec_watch_ends_wherever_the_cancel_lands(redis_server):
    """Cancelling the task that waits for the next spec change ends it at any point of the
    subscription, also where redis-py swallows the cancel: it sends under asyncio.wait_for,
    which before Python 3.12 returns normally when the cancel arrives just after the send
    finished. The watch then waited for a message forever, and SpecSync.run (so
    ControlPlane.stop) waited for it. Each round lets it run one more loop step."""
    store = RedisStore(redis_server.url, key_prefix=_prefix())
    try:
        for steps in range(80):
            changes = store.watch_specs()
            nxt = asyncio.ensure_future(changes.__anext__())
            for _ in range(steps):
                await asyncio.sleep(0)
            nxt.cancel()
            done, _ = await asyncio.wait({nxt}, timeout=5)
            if not done:
                await cancel_until_done(nxt)
                pytest.fail(f"the cancelled watch did not end (cancelled after {steps} loop steps)")
            assert nxt.cancelled()
            await changes.aclose()
    finally:
        await store.close()


# ---------------------------------------------------------------------------- config and wiring

def test_state_config_and_make_store():
    cfg = ControlPlaneConfig.from_dict({"state": {"backend": "redis", "redis_url": "unix:///tmp/r.sock",
                                                  "key_prefix": "{prod}:", "replica_ttl_s": 5,
                                                  "loads_max_age_s": 0.05, "write_behind": True}})
    store = make_store(cfg).shared        # behind the local fallback ledger (controlplane.state.resilient)
    assert isinstance(store, RedisStore) and store.prefix == "{prod}:" and store.replica_ttl_ms == 5000
    assert store.loads_max_age_s == 0.05 and store.write_behind
    assert isinstance(make_store(ControlPlaneConfig()), MemoryStore)


@pytest.mark.parametrize("state, words", [
    ({"backend": "mongo"}, ["state.backend", "memory, redis"]),
    ({"redis_url": "http://h:1"}, ["state.redis_url", "redis://"]),
    ({"redis_url": "redis://:hunter2@h:99999"}, ["state.redis_url", "port"]),
    ({"redis_url": "redis://h/abc"}, ["state.redis_url", "db"]),
    ({"redis_url": ""}, ["state.redis_url"]),
    ({"key_prefix": ""}, ["state.key_prefix"]),
    ({"key_prefix": "a b"}, ["state.key_prefix"]),
    ({"replica_ttl_s": 0}, ["state.replica_ttl_s"]),
    ({"loads_max_age_s": 60}, ["state.loads_max_age_s", "<= 10"]),
    ({"write_behind": "yes"}, ["state.write_behind", "true or false"]),
    ({"redis": "x"}, ["unknown state key", "backend, redis_url"]),
])
def test_bad_state_config_is_one_clear_line(state, words):
    with pytest.raises(ValueError) as err:
        ControlPlaneConfig.from_dict({"state": state})
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert "hunter2" not in msg


def test_state_key_at_top_level_points_to_its_section():
    with pytest.raises(ValueError, match=r"belongs in \[state\]"):
        ControlPlaneConfig.from_dict({"redis_url": "redis://h"})


def test_spec_codec_and_safe_url():
    spec = WorkerSpec("w", "http://h", Role.DECODE, labels={"k": "v"})
    assert decode_spec(encode_spec(spec)) == spec
    newer = encode_spec(spec)[:-1] + b',"from_the_future":1}'
    assert decode_spec(newer) == spec
    assert safe_url("redis://user:secret@h:6379/0") == "redis://user:***@h:6379/0"
    assert safe_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"


async def test_control_plane_places_and_releases_through_redis(sim_both, redis_server):
    """``[state] backend = "redis"``: a real control plane in process, a data-plane client over
    gRPC, one simulator; the charge is in Redis (seen by a second replica's store) and goes."""
    from controlplane.config import StateConfig, WorkerSpec as WorkerConfig
    from controlplane.server import ControlPlane
    from dataplane.placement_client import PlacementClient
    from protos import omni_proxy_pb2 as pb

    prefix = _prefix()
    config = ControlPlaneConfig(http_port=0, listen="127.0.0.1:0",
                                workers=[WorkerConfig(url=sim_both.url, role=Role.BOTH, id="w")],
                                state=StateConfig(backend="redis", redis_url=redis_server.url, key_prefix=prefix))
    plane = ControlPlane(config)
    other = RedisStore(redis_server.url, key_prefix=prefix)   # what another replica sees
    assert isinstance(plane.store.shared, RedisStore)   # behind the local fallback ledger
    client = None
    await plane.start()
    try:
        assert [s.id for s in await other.specs()] == ["w"]
        client = PlacementClient(f"127.0.0.1:{plane.grpc_port}", "dp-redis", timeout_s=5.0)
        await client.start()
        assert await client.wait_connected(10)

        async def placed() -> bool:
            answer = await client.place(pb.PlaceRequest(request_id="r1", model="", leg=pb.LEG_ENTRY,
                                                        prompt_tokens=10, max_tokens=5))
            return not answer.error
        await wait_until(placed, timeout=15, what="a placement on the simulator")
        assert (await other.loads(["w"]))["w"] == Load(1, 15, 10, 1)
        assert (await other.get("r1")).charges == (Charge("w", "aggregated", 15, 10),)
        client.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_FINISHED, worker_id="w"))

        async def released() -> bool:
            return (await other.loads(["w"]))["w"] == Load(0, 0, 0, 0) and await other.get("r1") is None
        await wait_until(released, timeout=10, what="the release in Redis")
    finally:
        if client is not None:
            await client.close()
        await plane.stop()
        await plane.store.close()
        await other.close()


# ---------------------------------------------------------------------------- fleet sync

async def _sync_pair(url: str, prefix: str, **kw):
    from controlplane.fleet import Fleet
    from controlplane.hooks import WorkerEvents
    from controlplane.state.sync import SpecSync

    added, removed = [], []

    async def on_added(spec):
        added.append(spec.id)

    async def on_removed(wid):
        removed.append(wid)

    writer, reader = RedisStore(url, key_prefix=prefix), RedisStore(url, key_prefix=prefix, socket_timeout_s=0.5)
    fleet = Fleet()
    events = WorkerEvents()
    events.added.subscribe(on_added)
    events.removed.subscribe(on_removed)
    sync = SpecSync(reader, fleet, events=events, **kw)
    return writer, reader, fleet, sync, added, removed


async def test_spec_sync_follows_another_replicas_changes(redis_server):
    writer, reader, fleet, sync, added, removed = await _sync_pair(redis_server.url, _prefix(), poll_interval_s=30)
    a = WorkerSpec("a", "http://10.0.0.1:8000", Role.PREFILL, model="m")
    await writer.put_spec(a)
    task = asyncio.create_task(sync.run())
    try:
        async def has(cond) -> bool:
            return cond()
        await wait_until(lambda: has(lambda: fleet.get("a") == a), timeout=5, what="the first read")
        assert fleet.last_heartbeat("a") > 0                   # not expired at once on this replica
        b = WorkerSpec("b", "http://10.0.0.2:8000", Role.DECODE, model="m", labels={"z": "1"})
        await writer.put_spec(b)                                # pub/sub, not the 30 s poll
        await wait_until(lambda: has(lambda: fleet.get("b") == b), timeout=5, what="b added")
        await writer.put_spec(dataclasses.replace(a, draining=True, weight=0.5))
        await wait_until(lambda: has(lambda: fleet.get("a").draining), timeout=5, what="a drained")
        await writer.remove_spec("b")
        await wait_until(lambda: has(lambda: "b" not in fleet), timeout=5, what="b removed")
        assert (added, removed) == (["a", "b"], ["b"])
        assert sync.connected and sync.version == await writer.spec_version()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await writer.close()
        await reader.close()


async def test_spec_sync_keeps_the_fleet_while_redis_is_away_and_catches_up(redis_persistent):
    writer, reader, fleet, sync, added, removed = await _sync_pair(redis_persistent.url, _prefix(),
                                                                   poll_interval_s=0.2, retry_s=0.05)
    await writer.put_spec(WorkerSpec("a", "http://10.0.0.1:8000", Role.BOTH))
    task = asyncio.create_task(sync.run())

    async def has(cond) -> bool:
        return cond()
    try:
        await wait_until(lambda: has(lambda: "a" in fleet and sync.connected), timeout=5, what="the first read")
        redis_persistent.stop()
        await wait_until(lambda: has(lambda: not sync.connected), timeout=5, what="the sync to notice")
        assert "a" in fleet                                     # placement goes on with what it knows
        redis_persistent.start()
        await writer.put_spec(WorkerSpec("b", "http://10.0.0.2:8000", Role.BOTH))
        await wait_until(lambda: has(lambda: "b" in fleet and sync.connected), timeout=10, what="catching up")
        assert sorted(s.id for s in fleet.specs()) == ["a", "b"] and removed == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await writer.close()
        await reader.close()


async def test_spec_sync_polls_a_store_without_pubsub():
    from controlplane.fleet import Fleet
    from controlplane.state.sync import SpecSync

    store, fleet = MemoryStore(), Fleet()
    sync = SpecSync(store, fleet, poll_interval_s=0.02)
    await store.put_spec(WorkerSpec("a", "http://10.0.0.1:8000", Role.BOTH))
    task = asyncio.create_task(sync.run())

    async def synced() -> bool:
        return "a" in fleet and "x" not in fleet
    try:
        await wait_until(synced, timeout=5, what="the first poll")
        await store.put_spec(WorkerSpec("x", "http://10.0.0.9:8000", Role.BOTH))
        await store.remove_spec("a")

        async def followed() -> bool:
            return "x" in fleet and "a" not in fleet
        await wait_until(followed, timeout=5, what="the next poll")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_records_fast_encoding_matches_the_generic_one():
    """``RedisStore._encode_record`` (every reserve) writes each field as ``_encode_fields`` does,
    leaving out those at their zero value; ``_record`` reads every field back in its place
    (a record whose every field differs), and a missing field as its zero value."""
    from controlplane.state.base import with_charges
    from controlplane.state.redis import _RECORD_FIELDS, _charges_json
    from tests.test_ledger_records import _distinct_record

    s = RedisStore("redis://127.0.0.1:1/0", fast_path=False)
    for rec in (_rec("r1", flow=2, placed_at=1000.5, predicted_ttft_s=0.25, work_ahead_tokens=7, decode_batch=3,
                     decode_placed_at=1001.0, pull_tokens=9),
                _rec("r2", session="", created_at=0.0)):
        fields = {f: getattr(rec, f) for f in _RECORD_FIELDS
                  if f not in ("charges", "request_id", "session") and getattr(rec, f)}
        assert s._encode_record(rec) == s._encode_fields(fields)
    distinct = _distinct_record()
    zero = with_charges(RequestRecord("", "", 0, 0), ())

    def rounded(r):   # (times go through the wall clock: equal to within a microsecond)
        return dataclasses.replace(_norm(r), decode_placed_at=round(r.decode_placed_at, 5))

    for rec in (distinct, zero):
        flat = ["request_id", rec.request_id, "session", rec.session, *s._encode_record(rec), "charges",
                _charges_json(rec.charges).decode()]
        assert rounded(s._record(flat)) == rounded(rec)
        assert rounded(s._record(dict(zip(flat[::2], flat[1::2], strict=True)))) == rounded(rec)
    assert len(s._encode_record(zero)) == 0
    from controlplane.state.redis import _FIELD_KINDS   # every field, in order (a new field: add it there)
    assert s._encode_record(distinct)[::2] == [f for f, _ in _FIELD_KINDS]
