"""Exact KV-cache-aware placement against a REAL vLLM: two engines, their ZMQ KV events.

Two aggregated vLLM CPU engines (tiny random-weight Llama, prefix caching, KV events on
ZMQ, PYTHONHASHSEED=0, sha256 block hashes, block size 32) behind our control plane with
the ``cache_aware`` policy, and a data plane that tokenizes with the model's own
tokenizer and chat template. Multi-turn chats go through the data plane, one request at
a time. Checked, per request, against the engines' own counters:
  (a) the hit tokens the router predicted equal the hits the engine reports;
  (b) every turn of a conversation runs on the same engine, and both engines get work;
  (c) after eviction (a deliberately small KV pool), BlockRemoved events take the blocks
      out of the router's index.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import grpc
import orjson
import pytest

from kvhash.hashing import BlockHashConfig, BlockHasher
from dataplane.tokenizer import Tokenizer
from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.vllm_harness.recipe import controlplane_toml, prefix_cache_args, prefix_cache_env
from tests.vllm_harness.vllm_server import (BLOCK_SIZE, SERVED_MODEL, VllmServer, cpu_slots, find_install,
                                            parse_metrics, start_server, vllm_test_marks, wait_healthy)

INSTALL = find_install()
pytestmark = vllm_test_marks()

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
DONE = 'vllm:request_success_total{finished_reason="length"}'
GPU_BLOCKS = 160     # small on purpose: a few long prompts force evictions


@dataclass
class Fleet:
    engines: dict[str, VllmServer]
    cp_address: str
    cp_http: int
    dp_url: str
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    python, model = INSTALL
    workdir = tmp_path_factory.mktemp("vllm-kv")
    engines: dict[str, VllmServer] = {}
    events: dict[str, str] = {}   # name -> ipc:// endpoint: nothing to choose, nothing to lose to a race
    group: ProcessGroup | None = None
    try:
        for name, cpu in zip(("e0", "e1"), cpu_slots(2), strict=False):
            events[name] = f"ipc://{workdir}/kv-{name}.sock"
            engines[name] = start_server(name, python=python, model=model, workdir=workdir, cpu=cpu,
                                         extra_args=(*prefix_cache_args(events[name]),
                                                     "--num-gpu-blocks-override", str(GPU_BLOCKS)),
                                         extra_env=prefix_cache_env())
        wait_healthy(list(engines.values()))
        cfg = workdir / "controlplane.toml"
        cfg.write_text(controlplane_toml(health_timeout_s=15, unhealthy_after=5))
        group = ProcessGroup(ready_timeout=60)
        args = ["controlplane", "--config", str(cfg), "--listen", "127.0.0.1:0", "--http-port", "0",
                "--health-interval", "0.5"]
        for name, server in engines.items():
            args += ["--worker", f"{server.url},id={name},kv_events={events[name]}"]
        cp = group.start("controlplane", args)
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                       "--tokenizer", str(model), "--read-timeout", "120",
                                       "--placement-timeout", "30"])
        yield Fleet(engines=engines, cp_address=cp.address, cp_http=cp.info["http_port"], dp_url=dp.url,
                    tokenizer=Tokenizer.from_dir(model))
    finally:
        if group is not None:
            group.close()
        for server in engines.values():
            server.stop()


async def _metrics(session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, dict[str, float]]:
    out = {}
    for name, server in fleet.engines.items():
        async with session.get(server.url + "/metrics") as r:
            out[name] = parse_metrics(await r.text())
    return out


async def _workers(fleet: Fleet) -> dict[str, pb.WorkerInfo]:
    async with grpc.aio.insecure_channel(fleet.cp_address) as ch:
        resp = await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=10)
    return {w.id: w for w in resp.workers}


async def _predicted(session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{fleet.cp_http}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("omni_kv_predicted_hit_blocks_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


async def _settled(fleet: Fleet, session: aiohttp.ClientSession) -> None:
    """Wait until the router's index holds what the engines cached (events are asynchronous)."""
    last = None

    async def stable() -> bool:
        nonlocal last
        now = tuple(sorted((w.id, w.cached_blocks) for w in (await _workers(fleet)).values()))
        same, last = now == last, now
        return same

    await wait_until(stable, timeout=30, interval=0.3, what="KV events to reach the router")


async def _chat(session, fleet: Fleet, messages) -> str:
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    async with session.post(fleet.dp_url + "/v1/chat/completions", json=body) as r:
        text = await r.text()
        assert r.status == 200, text
    return orjson.loads(text)["choices"][0]["message"]["content"]


async def test_predicted_hits_equal_engine_hits_and_conversations_stick(fleet: Fleet):
    topics = ["prefix caches", "disaggregated serving", "radix trees", "load balancing"]
    history = {t: [{"role": "system", "content": f"You are an expert on {t}. " * 12}] for t in topics}
    served_by: dict[str, set[str]] = {t: set() for t in topics}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for turn in range(3):
            for topic in topics:
                history[topic].append({"role": "user", "content": f"Turn {turn}: tell me more about {topic}. " * 4})
                await _settled(fleet, session)
                before = await _metrics(session, fleet)
                predicted_before = await _predicted(session, fleet)
                reply = await _chat(session, fleet, history[topic])
                history[topic].append({"role": "assistant", "content": reply})
                after = await _metrics(session, fleet)
                predicted_after = await _predicted(session, fleet)
                ran = [n for n in fleet.engines if after[n].get(DONE, 0) > before[n].get(DONE, 0)]
                assert len(ran) == 1, (ran, topic, turn)
                engine = ran[0]
                served_by[topic].add(engine)
                engine_hits = after[engine].get(HITS, 0) - before[engine].get(HITS, 0)
                predicted = (predicted_after.get(engine, 0) - predicted_before.get(engine, 0)) * BLOCK_SIZE
                assert predicted == engine_hits, (topic, turn, engine, predicted, engine_hits)
    # (b) one engine per conversation, and the conversations spread over both engines
    assert all(len(s) == 1 for s in served_by.values()), served_by
    assert {next(iter(s)) for s in served_by.values()} == set(fleet.engines), served_by
    # the later turns really hit the cache
    total_hits = sum(after[n].get(HITS, 0) for n in fleet.engines)
    assert total_hits > 0


async def test_eviction_reaches_the_router_index(fleet: Fleet):
    hasher = BlockHasher(BlockHashConfig(block_size=BLOCK_SIZE, algo="sha256", python_hash_seed="0"))
    first = [1000 + i for i in range(40 * BLOCK_SIZE + 1)]
    first_chain = hasher.event_hashes(first[:40 * BLOCK_SIZE])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def complete(prompt):
            async with session.post(fleet.dp_url + "/v1/completions",
                                    json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()

        async def explain() -> dict[str, int]:
            async with grpc.aio.insecure_channel(fleet.cp_address) as ch:
                p = await pb_grpc.AdminStub(ch).Explain(pb.PlaceRequest(
                    model=SERVED_MODEL, leg=pb.LEG_ENTRY, block_hashes=first_chain, explain=True), timeout=10)
            depths = {}
            for part in p.explanation.split("; "):
                if " match=" in part:
                    worker = part.split(" ", 1)[0].lstrip("* ")
                    depths[worker] = int(part.split(" match=", 1)[1].split("/", 1)[0])
            return depths

        await complete(first)

        async def held() -> bool:
            return max((await explain()).values(), default=0) == 40

        await wait_until(held, timeout=30, interval=0.3, what="the first prompt's 40 blocks in the index")
        # Fill both engines' small pools with other prompts until the first one is evicted.
        for k in range(12):
            await complete([5000 + 97 * k + i for i in range(50 * BLOCK_SIZE)])
        await _settled(fleet, session)

        async def evicted() -> bool:
            return max((await explain()).values(), default=0) < 40

        await wait_until(evicted, timeout=60, interval=0.5, what="BlockRemoved to reach the index")
        workers = await _workers(fleet)
        assert all(w.cached_blocks <= GPU_BLOCKS for w in workers.values()), workers
