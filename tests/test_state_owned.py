"""A replica's own write-behind records (controlplane/state/owned.py): an orphaned session drops
its own records without a scan of every kept record, with the same results as a scan."""

from __future__ import annotations

import random

import pytest

from controlplane.state import Charge, RequestRecord
from controlplane.state.owned import OwnedRecords
from controlplane.state.redis import RedisStore
from tests.conftest import wait_until
from tests.test_state_redis import _prefix


def _rec(rid: str, session: str) -> RequestRecord:
    return RequestRecord(request_id=rid, model="m", prompt_tokens=10, max_tokens=5, session=session)


class _NoScan(dict):
    """A record table that fails any walk over it (the work a scan per session would do)."""

    def __iter__(self):
        raise AssertionError("walked every record")

    def items(self):
        raise AssertionError("walked every record")

    def values(self):
        raise AssertionError("walked every record")


def test_a_sessions_records_are_dropped_without_walking_the_others():
    owned = OwnedRecords(1 << 20)
    for i in range(50_000):
        owned.put(_rec(f"b{i}", "busy"))
    for i in range(3):
        owned.put(_rec(f"a{i}", "closing"))
    owned._records = _NoScan(owned._records)
    assert sorted(owned.pop_session("closing")) == ["a0", "a1", "a2"]
    assert owned.pop_session("closing") == [] and owned.pop_session("never") == []
    assert len(owned) == 50_000 and "a0" not in owned and "b7" in owned


def test_same_records_as_a_scan_for_random_operations():
    """A plain dict scanned per session (the former code) is the model."""
    rng = random.Random(11)
    owned, model = OwnedRecords(64), {}
    sessions = ["s1", "s2", "s3", ""]
    for step in range(20_000):
        op = rng.random()
        rid = f"r{rng.randrange(120)}"
        if op < 0.5:
            rec = _rec(rid, rng.choice(sessions))
            owned.put(rec)
            model[rid] = rec
            if len(model) > 64:
                del model[next(iter(model))]
        elif op < 0.8:
            assert owned.pop(rid) == model.pop(rid, None)
        else:
            sess = rng.choice(sessions[:3])
            gone = [r for r, rec in model.items() if rec.session == sess]
            for r in gone:
                del model[r]
            assert sorted(owned.pop_session(sess)) == sorted(gone), step
        assert len(owned) == len(model)
        assert all(owned.get(r) == rec for r, rec in model.items())
        assert list(owned._records) == list(model)          # the same oldest-first order
        by_session = {s: {r for r, rec in model.items() if rec.session == s} for s in sessions[:3]}
        assert {s: set(ids) for s, ids in owned._by_session.items()} == {s: ids for s, ids in by_session.items() if ids}


@pytest.mark.parametrize("n_other", [2_000])
async def test_orphaning_a_session_drops_only_its_own_copies(redis_server, n_other):
    """RedisStore.orphan with many records of another session kept: it walks none of them, the
    orphaned session's ends are then answered by Redis (not from this replica's copy), and the
    other session's still from the copy."""
    s = RedisStore(redis_server.url, key_prefix=_prefix(), write_behind=True, loads_max_age_s=3600.0)
    try:
        for i in range(n_other):
            await s.reserve(_rec(f"b{i}", "busy"), (Charge("w", "aggregated", 1),))
        await s.reserve(_rec("a0", "closing"), (Charge("w", "aggregated", 1),))
        await wait_until(lambda: not s._behind, timeout=5, what="the write-behind reserves' replies")
        s._mine._records = _NoScan(s._mine._records)
        assert await s.orphan("closing", 10.0) == 1
        assert "a0" not in s._mine and len(s._mine) == n_other
        s._mine._records = dict(s._mine._records)
        assert (await s.end("a0")).orphaned_at == pytest.approx(10.0, abs=1e-4)   # Redis's record
        assert (await s.end("b1")).session == "busy"
    finally:
        await s.close()
