"""Cache-aware placement through real processes (approximate mode: engines without events)."""

from __future__ import annotations

import random

import grpc
import pytest

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"a": "both", "b": "both", "c": "both"}, policy="cache_aware")
    yield c
    c.group.close()


async def test_conversations_stick_to_one_worker_and_spread_across_workers(cluster: Cluster, http):
    await wait_until(cluster.all_idle, what="idle")
    await cluster.clear_sim_requests()
    rng = random.Random(7)
    convs = {f"conv{i}": [rng.randrange(1, 30000) for _ in range(64)] for i in range(6)}
    for turn in range(3):
        for name, tokens in convs.items():
            async with http.post(cluster.url + "/v1/completions", headers={"X-Request-Id": f"{name}-t{turn}"},
                                 json={"model": MODEL, "prompt": tokens, "max_tokens": 2}) as r:
                assert r.status == 200
            tokens += [rng.randrange(1, 30000) for _ in range(32)]   # the next turn extends the prompt
    where: dict[str, set[str]] = {}
    for sim in cluster.sims:
        for req in await cluster.sim_requests(sim):
            where.setdefault(req["request_id"].rsplit("-t", 1)[0], set()).add(sim)
    assert all(len(sims) == 1 for sims in where.values()), where
    assert len({next(iter(s)) for s in where.values()}) >= 2, "every conversation went to one worker"

    async with grpc.aio.insecure_channel(cluster.cp.address) as ch:
        p = await pb_grpc.AdminStub(ch).Explain(pb.PlaceRequest(
            model=MODEL, leg=pb.LEG_ENTRY, block_hashes=[1, 2, 3], explain=True))
    assert "policy=cache_aware" in p.explanation and "match=0/3blk" in p.explanation


async def test_control_plane_exports_predicted_hits(cluster: Cluster, http):
    prompt = list(range(100, 164))
    for _ in range(2):  # the second placement is predicted to hit what the first one left
        async with http.post(cluster.url + "/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200
    async with http.get(f"http://127.0.0.1:{cluster.cp.info['http_port']}/metrics") as r:
        text = await r.text()
    lines = [ln for ln in text.splitlines() if ln.startswith("omni_kv_predicted_hit_blocks_total")]
    assert lines and sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) > 0
    assert 'omni_kv_index_blocks{source="routed"}' in text
