"""The simulator's DP barrier: the ranks of one data-parallel engine step together.

In-process tests drive ``DpGroup`` step by step (no real time); the end-to-end test runs
real ``omni-proxy sim --dp-size 2`` processes with and without the barrier and counts the
tokens a decode on rank 0 streams while rank 1 prefills a long prompt.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from omni_proxy.launcher import Child, ProcessGroup
from simulator.config import SimConfig
from simulator.context import SimContext
from simulator.engine import SimRequest
from tests.conftest import wait_until

LONG = 30_000   # prompt tokens: 4 chunks of the 8192-token budget, ~1.5 s of prefill at 0.05 ms/token


def _req(rid: str, tokens: int, max_tokens: int) -> SimRequest:
    return SimRequest(request_id=rid, prompt_tokens=tokens, max_tokens=max_tokens, rng=1, arrival=0.0,
                      token_ids=list(range(1, tokens + 1)))


# ---- in-process ---------------------------------------------------------------------

def test_group_step_lasts_the_slowest_ranks_and_counts_the_held_time():
    ctx = SimContext.create(SimConfig(dp_size=2))
    assert ctx.group is not None and ctx.group.engines == ctx.ranks
    r0, r1 = ctx.ranks
    decode = _req("d", 16, max_tokens=100)
    r0.submit(decode)
    plans = ctx.group.plan_step()
    assert plans is not None
    ctx.group.account(plans, ctx.group.step_duration(plans))
    ctx.group.complete_step(plans, 0.0)   # rank 0's prompt is prefilled: it decodes from now on
    base = ctx.group.stats.steps, ctx.group.stats.mixed_steps

    r1.submit(_req("p", 8192, max_tokens=1))
    plans = ctx.group.plan_step()
    assert plans is not None
    own = [e.step_duration(p) for e, p in zip(ctx.ranks, plans, strict=True)]
    assert plans[0].decode == [decode] and not plans[0].prefill and plans[1].prefill_tokens == 8192
    duration = ctx.group.step_duration(plans)
    assert duration == max(own) == pytest.approx(8192 * 0.05 / 1000)   # the prefill sets the pace
    assert own[0] == pytest.approx((4.0 + 0.05) / 1000)                 # what rank 0 alone would take
    ctx.group.account(plans, duration)
    ctx.group.complete_step(plans, duration)
    st = ctx.group.stats
    assert (st.steps, st.mixed_steps) == (base[0] + 1, base[1] + 1)
    assert st.held_rank_s == pytest.approx(duration - own[0])
    # Rank 0's prefill step and rank 1's right after it are one phase (no step between them).
    assert st.prefill_steps == base[0] + 1 and st.prefill_phases == 1
    assert st.prefill_rank_steps == 2 and st.prefill_s >= duration
    assert st.prefill_work_s == pytest.approx(duration + (16 * 0.05) / 1000)   # rank 0's, then rank 1's
    assert r0.totals.busy_s == pytest.approx(own[0] + (16 * 0.05) / 1000)   # own work only


def test_idle_group_plans_nothing_and_independent_ranks_have_no_group():
    ctx = SimContext.create(SimConfig(dp_size=4))
    assert ctx.group is not None and ctx.group.plan_step() is None
    assert SimContext.create(SimConfig(dp_size=4, dp_barrier=False)).group is None
    assert SimContext.create(SimConfig(dp_size=1)).group is None


# ---- end to end ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sims():
    with ProcessGroup() as group:
        yield {
            "barrier": group.start("sim-dp-barrier", ["sim", "--port", "0", "--dp-size", "2"]),
            "free": group.start("sim-dp-free", ["sim", "--port", "0", "--dp-size", "2", "--no-dp-barrier"]),
        }


async def _tokens_during_long_prefill(http: aiohttp.ClientSession, sim: Child) -> int:
    """Tokens rank 0's stream delivers while rank 1 prefills a LONG-token prompt."""
    seen = [0]
    body = {"prompt": [list(range(1, 17))], "max_tokens": 20_000, "stream": True, "ignore_eos": True}
    async with http.post(sim.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "0"}) as stream:
        assert stream.status == 200

        async def count() -> None:
            async for line in stream.content:
                if line.startswith(b"data: {"):
                    seen[0] += 1

        reader = asyncio.create_task(count())
        try:
            await wait_until(lambda: seen[0] >= 5, what="rank 0 decoding")
            before = seen[0]
            async with http.post(sim.url + "/v1/completions", headers={"X-data-parallel-rank": "1"},
                                 json={"prompt": [list(range(100, 100 + LONG))], "max_tokens": 1}) as resp:
                assert resp.status == 200, await resp.text()
                assert orjson.loads(await resp.read())["usage"]["prompt_tokens"] == LONG
            return seen[0] - before
        finally:
            reader.cancel()


async def test_a_long_prefill_on_one_rank_holds_the_other_ranks_decode_only_with_the_barrier(sims):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        held = await _tokens_during_long_prefill(http, sims["barrier"])
        free = await _tokens_during_long_prefill(http, sims["free"])
        async with http.get(sims["barrier"].url + "/sim/state") as resp:
            stats = (await resp.json())["dp_barrier"]
        async with http.get(sims["free"].url + "/sim/state") as resp:
            assert (await resp.json())["dp_barrier"] is None
    # ~1.5 s of prefill: one decode token per group step (4 chunks) with the barrier, one per
    # ~4 ms step (hundreds) without it.
    assert held < 30 < 100 < free, (held, free)
    assert stats["mixed_steps"] >= 4 and stats["held_rank_s"] >= 1.0, stats
