"""bench/session_cost.py runs: its session places and ends every request it sends."""

from __future__ import annotations

from bench.session_cost import _Session, measure
from controlplane.state.redis import RedisStore
from tests.conftest import wait_until


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


async def test_on_the_default_redis_store_too(redis_server):
    """``--store redis``: the same session on the store a scaled-out replica runs; every request
    it ended leaves Redis's loads (what is left is the last batch's, reported with the next).
    Its ends are answered by Redis after the session's answers: waited for."""
    session = _Session(batch=4, policy="least_load", workers=4, redis_url=redis_server.url)
    await session.start()
    try:
        await session.run(16)
        redis = RedisStore(redis_server.url, key_prefix=session.store.shared.prefix)   # (Redis itself, no copy)
        try:
            async def last_batch_held() -> bool:
                return sum(v.requests for v in (await redis.loads(session.worker_ids)).values()) == 4
            await wait_until(last_batch_held, timeout=10, what="the ended requests to leave Redis's loads")
        finally:
            await redis.close()
    finally:
        await session.close()


async def test_local_placements_are_recorded_and_ended():
    """``--local``: the data plane's own placements (``placed_on``) are charged where they say,
    one each, and released by their ends like asked ones."""
    session = _Session(batch=4, local=True)
    await session.start()
    try:
        await session.run(16)
        loads = await session.store.loads(["a", "b"])
        assert [loads[w].requests for w in ("a", "b")] == [2, 2]   # the last batch, round robin
        await session.run(4)
        assert sum(v.requests for v in (await session.store.loads(["a", "b"])).values()) == 4
    finally:
        await session.close()
