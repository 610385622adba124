"""bench/session_cost.py runs: its session places and ends every request it sends."""

from __future__ import annotations

from bench.session_cost import _Session, measure


async def test_session_cost_places_and_ends_every_request():
    runs = await measure(requests=64, repeats=2, batch=8)
    assert len(runs) == 2 and all(r > 0 for r in runs)


async def test_its_session_leaves_no_load_behind():
    session = _Session(batch=4)
    await session.start()
    try:
        await session.run(16)
        assert session.seq == 16 and len(session.finished) == 4
        # The last batch's reports are sent with the next batch: until then they hold load.
        assert sum(v.requests for v in (await session.store.loads(["a", "b"])).values()) == 4
        await session.run(4)
        assert sum(v.requests for v in (await session.store.loads(["a", "b"])).values()) == 4
    finally:
        await session.close()
