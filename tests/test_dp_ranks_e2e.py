"""DP-rank-aware placement through real processes: simulators with ``--dp-size 2``."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import grpc
import pytest

from kvhash.hashing import BlockHashConfig, BlockHasher
from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import Cluster, wait_until
from tests.ports import reserved_port

MODEL = "sim-model"


def start(sims: dict[str, tuple[str, int]], *cp_args: str, policy: str = "cache_aware",
          kv_events: dict[str, str] | None = None) -> Cluster:
    """``sims``: name -> (role, dp_size); like conftest.start_cluster with dp_size in the worker spec
    (and ``kv_events``: name -> endpoint, for the sim and its worker spec)."""
    kv_events = kv_events or {}
    group = ProcessGroup()
    try:
        children = {name: group.start(name, ["sim", "--role", role, "--port", "0", "--dp-size", str(dp),
                                             *(["--kv-events-endpoint", kv_events[name].replace("127.0.0.1", "*")]
                                               if name in kv_events else [])])
                    for name, (role, dp) in sims.items()}
        args = ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--policy", policy,
                "--health-interval", "0.2", "--metrics-interval", "0.2", *cp_args]
        for name, (role, dp) in sims.items():
            spec = f"{children[name].url},role={role},id={name},dp_size={dp}"
            if name in kv_events:
                spec += f",kv_events={kv_events[name]}"
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
def exact():
    c = start({"e": ("both", 2)}, kv_events={"e": f"tcp://127.0.0.1:{reserved_port(2)}"})   # rank r publishes on P + r
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


async def test_exact_mode_follows_each_ranks_events(exact: Cluster, http):
    """Rank 1 of the sim caches a prompt (sent to it directly); its events arrive on port + 1
    with the rank; the proxy then sends that prompt to rank 1 every time."""
    await exact.fresh()
    prompts = [list(range(5000 + 100 * n, 5064 + 100 * n)) for n in range(200)]
    metrics_url = f"http://127.0.0.1:{exact.cp.info['http_port']}/metrics"

    async def indexed() -> bool:
        # PUB drops messages until the subscription has arrived: fresh prompts until the index has one.
        async with http.post(exact.sims["e"].url + "/v1/completions", headers={"X-data-parallel-rank": "1"},
                             json={"model": MODEL, "prompt": prompts.pop(), "max_tokens": 1}) as r:
            assert r.status == 200
        async with http.get(metrics_url) as r:
            text = await r.text()
        line = next((ln for ln in text.splitlines() if ln.startswith('omni_kv_index_blocks{source="events"}')), "")
        return bool(line) and float(line.rsplit(" ", 1)[1]) >= 4
    await wait_until(indexed, what="rank 1's events in the index", interval=0.2)
    prompt = list(range(5000 + 100 * len(prompts), 5064 + 100 * len(prompts)))   # the last one sent
    chain = BlockHasher(BlockHashConfig(block_size=16, algo="sha256")).event_hashes(prompt)

    async def last_prompt_indexed() -> bool:
        # The last prompt's own blocks (not just some prompt's) reached the index.
        async with grpc.aio.insecure_channel(exact.cp.address) as ch:
            p = await pb_grpc.AdminStub(ch).Explain(pb.PlaceRequest(model=MODEL, leg=pb.LEG_ENTRY,
                                                                    block_hashes=chain, explain=True))
        return f"match={len(chain)}/{len(chain)}blk" in p.explanation
    await wait_until(last_prompt_indexed, what="the last prompt's blocks in the index")
    await exact.clear_sim_requests()
    for i in range(4):
        async with http.post(exact.url + "/v1/completions", headers={"X-Request-Id": f"ex-{i}"},
                             json={"model": MODEL, "prompt": prompt + [9000 + i], "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
    reqs = await exact.sim_requests("e")
    assert [r["dp_rank"] for r in reqs] == [1, 1, 1, 1], [(r["request_id"], r["dp_rank"]) for r in reqs]
    state = await exact.sim_get("e", "/sim/state")
    assert state["dp_ranks"][1]["kv_events_port"] == state["dp_ranks"][0]["kv_events_port"] + 1


@pytest.fixture(scope="module")
def sequential():
    c = start({"p": ("prefill", 2), "d": ("decode", 2)}, policy="least_load")
    yield c
    c.group.close()


async def test_sequential_pd_sends_each_leg_to_its_rank(sequential: Cluster, http):
    await sequential.fresh()
    for i in range(4):
        async with http.post(sequential.url + "/v1/completions", headers={"X-Request-Id": f"seq-{i}"},
                             json={"model": MODEL, "prompt": f"sequential dp {i} " * 10, "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
    for name in ("p", "d"):
        reqs = await sequential.sim_requests(name)
        assert len(reqs) == 4
        assert all(int(r["headers"]["x-data-parallel-rank"]) == r["dp_rank"] for r in reqs)
        assert {r["dp_rank"] for r in reqs} == {0, 1}
    state = await sequential.sim_get("d", "/sim/state")
    assert state["prompt_tokens_external"] > 0    # D pulled the KV from P's rank


@pytest.fixture(scope="module")
def layerwise():
    c = start({"p": ("prefill", 2), "d": ("decode", 2)}, "--pd-flow", "layerwise", "--metaserver-host", "127.0.0.1",
              policy="least_load")
    yield c
    c.group.close()


async def test_layerwise_metaserver_sends_the_prefill_to_its_rank(layerwise: Cluster, http):
    await layerwise.fresh()
    for i in range(2):
        async with http.post(layerwise.url + "/v1/completions", headers={"X-Request-Id": f"lw-{i}"},
                             json={"model": MODEL, "prompt": f"layerwise dp {i} " * 10, "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
    for name in ("p", "d"):
        reqs = await layerwise.sim_requests(name)
        assert len(reqs) == 2, name
        assert all(int(r["headers"]["x-data-parallel-rank"]) == r["dp_rank"] for r in reqs)
