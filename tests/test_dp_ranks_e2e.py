"""DP-rank-aware placement through real processes: simulators with ``--dp-size 2``."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import grpc
import pytest

from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import Cluster, wait_until

MODEL = "sim-model"


def start(sims: dict[str, tuple[str, int]], *cp_args: str, policy: str = "cache_aware") -> Cluster:
    """``sims``: name -> (role, dp_size); like conftest.start_cluster with dp_size in the worker spec."""
    group = ProcessGroup()
    try:
        children = {name: group.start(name, ["sim", "--role", role, "--port", "0", "--dp-size", str(dp)])
                    for name, (role, dp) in sims.items()}
        args = ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--policy", policy,
                "--health-interval", "0.2", "--metrics-interval", "0.2", *cp_args]
        for name, (role, dp) in sims.items():
            spec = f"{children[name].url},role={role},id={name},dp_size={dp}"
            if children[name].info.get("bootstrap_port"):
                spec += f",bootstrap_port={children[name].info['bootstrap_port']}"
            args += ["--worker", spec]
        cp = group.start("controlplane", args)
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address])
        return Cluster(group=group, sims=children, cp=cp, dp=dp, worker_ids={n: n for n in sims})
    except BaseException:
        group.close()
        raise


@pytest.fixture(scope="module")
def agg():
    c = start({"a": ("both", 2)})
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def parallel():
    c = start({"p": ("prefill", 2), "d": ("decode", 2)}, "--pd-flow", "parallel", "--parallel-protocol", "sglang",
              policy="least_load")
    yield c
    c.group.close()


async def test_requests_carry_the_rank_and_a_repeated_prefix_stays_on_its_rank(agg: Cluster, http):
    await agg.fresh()
    rng = random.Random(3)
    convs = {f"conv{i}": [rng.randrange(1, 30000) for _ in range(64)] for i in range(4)}
    for turn in range(3):
        for name, tokens in convs.items():
            async with http.post(agg.url + "/v1/completions", headers={"X-Request-Id": f"{name}-t{turn}"},
                                 json={"model": MODEL, "prompt": tokens, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
            tokens += [rng.randrange(1, 30000) for _ in range(32)]
    ranks: dict[str, set[int]] = {}
    for req in await agg.sim_requests("a"):
        header = int(req["headers"]["x-data-parallel-rank"])
        assert header == req["dp_rank"]             # the simulator served it on the named rank
        ranks.setdefault(req["request_id"].rsplit("-t", 1)[0], set()).add(header)
    assert len(ranks) == 4 and all(len(r) == 1 for r in ranks.values()), ranks
    assert {next(iter(r)) for r in ranks.values()} == {0, 1}, "every conversation went to one rank"
    state = await agg.sim_get("a", "/sim/state")
    assert [r["requests_total"] > 0 for r in state["dp_ranks"]] == [True, True]
    assert all(r["prefix_cache_hits_tokens"] > 0 for r in state["dp_ranks"])

    async with grpc.aio.insecure_channel(agg.cp.address) as ch:
        p = await pb_grpc.AdminStub(ch).Explain(pb.PlaceRequest(
            model=MODEL, leg=pb.LEG_ENTRY, block_hashes=[1, 2, 3], explain=True))
    assert p.decode.dp_size == 2 and "dp_rank: a rank " in p.explanation


async def test_concurrent_load_spreads_over_ranks(agg: Cluster, http):
    await agg.fresh()

    async def one(i: int) -> None:
        async with http.post(agg.url + "/v1/completions", headers={"X-Request-Id": f"load-{i}"},
                             json={"model": MODEL, "prompt": [1000 + i] * 8 + list(range(i * 100, i * 100 + 40)),
                                   "max_tokens": 40}) as r:
            assert r.status == 200
            await r.read()
    await asyncio.gather(*(one(i) for i in range(8)))
    got = Counter(req["dp_rank"] for req in await agg.sim_requests("a"))
    assert got[0] >= 2 and got[1] >= 2, got
    await wait_until(agg.all_idle, what="idle after the burst")


async def test_parallel_pd_room_selects_the_prefill_rank(parallel: Cluster, http):
    await parallel.fresh()
    for i in range(4):
        body = {"model": MODEL, "prompt": f"parallel dp {i} " * 10, "max_tokens": 4}
        async with http.post(parallel.url + "/v1/completions", json=body, headers={"X-Request-Id": f"pdp-{i}"}) as r:
            assert r.status == 200, await r.text()
    ps = {r["request_id"]: r for r in await parallel.sim_requests("p")}
    ds = {r["request_id"]: r for r in await parallel.sim_requests("d")}
    assert len(ps) == 4 and ps.keys() == ds.keys()
    for rid, p in ps.items():
        d = ds[rid]
        room = p["body"]["bootstrap_room"]
        assert room == d["body"]["bootstrap_room"] and room % 2 == p["dp_rank"]
        assert p["body"]["routed_dp_rank"] == p["dp_rank"] == int(p["headers"]["x-data-parallel-rank"])
        assert d["body"]["routed_dp_rank"] == d["dp_rank"] == int(d["headers"]["x-data-parallel-rank"])
    # Idle ranks are taken in turn: both prefill ranks served some of the four requests.
    assert {p["dp_rank"] for p in ps.values()} == {0, 1}
