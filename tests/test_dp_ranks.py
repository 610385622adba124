"""DP-rank-aware placement in process: rank choice by prefix depth then load, the ledger per
rank, endpoints and explanations naming the rank, parallel PD rooms, the simulator's ranks."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.fleet import Fleet
from controlplane.kvcache.events import BlockStored
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.lifecycle import Lifecycle
from controlplane.placement import PlacementStats, Placer, rank_key
from controlplane.scheduling import build_profile
from controlplane.state import MemoryStore
from controlplane.workers import Health, HealthState, Role, WorkerSpec
from dataplane.flows.parallel import new_room
from protos import omni_proxy_pb2 as pb


def spec(wid, role=Role.BOTH, **kw):
    return WorkerSpec(id=wid, url=f"http://{wid}", role=role, model="m", **kw)


async def placer_of(*specs, policy="cache_aware", flow="sequential", store=None):
    store, fleet = store or MemoryStore(), Fleet()
    for s in specs:
        await store.put_spec(s)
        fleet.put(s)
        fleet.set_state(s.id, HealthState(health=Health.HEALTHY))
    stats = PlacementStats.new()
    placer = Placer(store, fleet, build_profile(policy), pd_flow=flow, stats=stats)
    placer.kv = KVCache(KVCacheConfig(approx_ttl_s=60))
    return placer, store, Lifecycle(store, fleet, stats)


def entry(rid, chain=(), tokens=64, **kw):
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=tokens,
                           block_hashes=list(chain), **kw)


async def rank_loads(store, wid, n):
    loads = await store.loads([rank_key(wid, r) for r in range(n)])
    return [loads[rank_key(wid, r)].requests for r in range(n)]


async def test_single_rank_workers_are_unchanged():
    placer, store, _ = await placer_of(spec("a"))
    p = await placer.place(entry("r1"))
    assert p.decode.dp_size == 0 and p.decode.dp_rank == 0
    assert [c.worker_id for c in (await store.get("r1")).charges] == ["a"]


async def test_concurrent_requests_spread_over_ranks_and_release_with_the_worker():
    placer, store, life = await placer_of(spec("a", dp_size=4), policy="least_load")
    got = Counter()
    for i in range(8):
        p = await placer.place(entry(f"r{i}"))
        assert p.decode.dp_size == 4
        got[p.decode.dp_rank] += 1
    assert got == {0: 2, 1: 2, 2: 2, 3: 2}
    assert await rank_loads(store, "a", 4) == [2, 2, 2, 2]
    assert (await store.loads(["a"]))["a"].requests == 8   # the worker's totals are kept as before
    await life.report(pb.LifecycleEvent(request_id="r0", kind=pb.EVENT_FINISHED))
    assert await rank_loads(store, "a", 4) == [1, 2, 2, 2]
    # A failed leg releases the worker's charge and its rank's with it.
    await life.report(pb.LifecycleEvent(request_id="r1", kind=pb.EVENT_LEG_FAILED, worker_id="a"))
    assert await rank_loads(store, "a", 4) == [1, 1, 2, 2]
    assert (await store.loads(["a"]))["a"].requests == 6
    # The next request goes to a least-loaded rank.
    assert (await placer.place(entry("r9"))).decode.dp_rank == 0


async def test_repeated_prefix_goes_to_the_same_rank_routed_mode():
    placer, store, _ = await placer_of(spec("a", dp_size=2))
    chain = [11, 12, 13, 14]
    first = (await placer.place(entry("c1", chain))).decode.dp_rank
    # A conversation's turns, each extending the last: the prefix wins over load.
    turns = list(chain)
    for i in range(3):
        turns.append(100 + i)
        p = await placer.place(entry(f"c{i + 2}", turns))
        assert p.decode.dp_rank == first
    other = (await placer.place(entry("x", [99, 98]))).decode.dp_rank
    assert other == 1 - first    # no match anywhere: the least-loaded rank
    assert placer.kv.rank_depths(chain, spec("a", dp_size=2)) == {first: 4}
    # New prompts continuing the conversation's first turn differently: once several have,
    # that turn is a prefix different prompts share (a system prompt), which prefers no rank:
    # load decides (the first ones still followed it, so its rank is the busier one).
    for i in range(placer.profile.shared.branches - 1):
        assert (await placer.place(entry(f"branch{i}", chain + [300 + i]))).decode.dp_rank == first
    assert (await placer.place(entry("new", chain + [200]))).decode.dp_rank == 1 - first


async def test_a_system_prompt_on_every_prompt_does_not_pin_every_conversation_to_one_rank():
    """Every prompt starts with the same 32 blocks; 16 conversations of 3 turns, each request
    finished before the next. Conversations keep their rank; every rank gets a fair part."""
    placer, store, lifecycle = await placer_of(spec("a", dp_size=4))
    system = list(range(1000, 1032))
    convs = {c: list(system) for c in range(16)}
    rank_of: dict[int, set[int]] = {}
    got = Counter()
    n = 0
    for turn in range(3):
        for c, chain in convs.items():
            chain += [(c + 1) * 10_000 + turn * 100 + i for i in range(8)]
            n += 1
            p = await placer.place(entry(f"r{n}", chain, tokens=16 * len(chain)))
            got[p.decode.dp_rank] += 1
            rank_of.setdefault(c, set()).add(p.decode.dp_rank)
            await lifecycle.report(pb.LifecycleEvent(request_id=f"r{n}", kind=pb.EVENT_FINISHED))
    assert all(len(ranks) == 1 for ranks in rank_of.values()), rank_of
    assert min(got[r] for r in range(4)) >= 48 / 4 / 2, got


async def test_exact_events_per_rank_choose_the_deepest_rank():
    a = spec("a", dp_size=2, kv_events="tcp://x:5557")
    placer, store, _ = await placer_of(a)
    placer.kv.exact.apply("a", 1, [BlockStored(block_hashes=(1, 2, 3), parent_block_hash=None,
                                               token_ids=(), block_size=16)])
    placer.kv.exact.apply("a", 0, [BlockStored(block_hashes=(1,), parent_block_hash=None,
                                               token_ids=(), block_size=16)])
    p = await placer.place(entry("r1", [1, 2, 3, 4], explain=True))
    assert p.decode.dp_rank == 1
    assert "| dp_rank: a rank 1 of 2 (prefix 3 blocks" in p.explanation
    # Ties on depth go to the least-loaded rank (r1's whole prompt is pending on rank 1, but
    # this one's fourth block differs: both ranks hold 3 blocks).
    placer.kv.exact.apply("a", 0, [BlockStored(block_hashes=(2, 3), parent_block_hash=1,
                                               token_ids=(), block_size=16)])
    assert (await placer.place(entry("r2", [1, 2, 3, 5]))).decode.dp_rank == 0
    assert await rank_loads(store, "a", 2) == [1, 1]
    # The same prompt again follows r1 to rank 1: it is pending there, not yet in any event.
    assert placer.kv.rank_depths([1, 2, 3, 4], a) == {0: 3, 1: 4}
    assert (await placer.place(entry("r3", [1, 2, 3, 4]))).decode.dp_rank == 1


async def test_parallel_pd_endpoints_carry_each_sides_rank():
    p_spec, d_spec = spec("p", Role.PREFILL, dp_size=4), spec("d", Role.DECODE, dp_size=2)
    placer, store, _ = await placer_of(p_spec, d_spec, policy="least_load", flow="parallel")
    seen = set()
    for i in range(4):
        out = await placer.place(entry(f"r{i}"))
        assert out.prefill.worker_id == "p" and out.prefill.dp_size == 4 and out.decode.dp_size == 2
        seen.add((out.prefill.dp_rank, out.decode.dp_rank))
    assert {r for r, _ in seen} == {0, 1, 2, 3} and {r for _, r in seen} == {0, 1}
    assert await rank_loads(store, "p", 4) == [1, 1, 1, 1]


def test_rooms_select_the_prefill_rank():
    for size in (2, 3, 8):
        for rank in range(size):
            for _ in range(50):
                room = new_room(size, rank)
                assert 0 <= room < 2 ** 63 and room % size == rank


def test_parallel_bodies_name_ranks_and_room():
    import orjson

    from dataplane.flows.parallel import bodies
    from dataplane.requests import ClientRequest

    raw = b'{"model":"m","prompt":"hi"}'
    req = ClientRequest(path="/v1/completions", raw=raw, body=orjson.loads(raw), model="m", stream=False,
                        max_tokens=0, prompt_tokens=1, request_id="x", placement_id="x")

    class Ctx:
        pass
    Ctx.req = req
    p = pb.Endpoint(worker_id="p", url="http://10.0.0.1:8000", bootstrap_port=8998, dp_size=4, dp_rank=3)
    d = pb.Endpoint(worker_id="d", url="http://10.0.0.2:8000", dp_size=2, dp_rank=1)
    p_body, d_body = bodies(Ctx, p, "sglang", d)
    pj, dj = orjson.loads(p_body), orjson.loads(d_body)
    assert pj["routed_dp_rank"] == 3 and dj["routed_dp_rank"] == 1
    assert pj["bootstrap_room"] == dj["bootstrap_room"] and pj["bootstrap_room"] % 4 == 3
    assert p_body.startswith(raw[:-1])   # appended, not re-encoded
    # Without data parallelism: one body, no rank field, as before.
    p1, d1 = bodies(Ctx, pb.Endpoint(worker_id="p", url="http://h:1"), "sglang", pb.Endpoint(worker_id="d"))
    assert p1 == d1 and "routed_dp_rank" not in orjson.loads(p1)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_stores_release_rank_charges_with_the_worker(kind, redis_server):
    from controlplane.state import Charge, RequestRecord
    from controlplane.state.redis import RedisStore

    store = MemoryStore() if kind == "memory" else RedisStore(redis_server.url, key_prefix=f"dp{id(kind)}:")
    try:
        rec = RequestRecord(request_id="r", model="m", prompt_tokens=10, max_tokens=5, session="s")
        await store.reserve(rec, (Charge("p", "prefill", 10, 10), Charge("p#2", "prefill", 10, 10),
                                  Charge("d", "decode", 15), Charge("d#1", "decode", 15)))
        loads = await store.loads(["p", "p#2", "d", "d#1"])
        assert [loads[k].requests for k in ("p", "p#2", "d", "d#1")] == [1, 1, 1, 1]
        await store.release("r", worker_id="p")
        loads = await store.loads(["p", "p#2", "d", "d#1", "p#"])
        assert [loads[k].requests for k in ("p", "p#2", "d", "d#1")] == [0, 0, 1, 1]
        await store.end("r")
        loads = await store.loads(["d", "d#1"])
        assert loads["d"].requests == 0 and loads["d#1"].requests == 0 and loads["d#1"].tokens == 0
    finally:
        if kind != "memory":
            await store.close()


async def test_omni_ctl_explain_shows_the_rank(capsys):
    import json

    from omni_proxy.ctl import parse_explanation, print_explain

    placer, _, _ = await placer_of(spec("a", dp_size=2))
    p = await placer.place(entry("", [5, 6], explain=True), dry_run=True)
    stages = parse_explanation(p.explanation)
    assert stages[0]["candidates"][0]["worker_id"] == "a"
    print_explain(p, stages, 32, [5, 6], "given", 16, as_json=False)
    out = capsys.readouterr().out
    assert f"decode a (dp rank {p.decode.dp_rank})" in out and "dp rank: a rank" in out
    print_explain(p, stages, 32, [5, 6], "given", 16, as_json=True)
    assert json.loads(capsys.readouterr().out)["dp_ranks"] == {"decode": p.decode.dp_rank}
