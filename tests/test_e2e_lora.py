"""LoRA adapters end to end: a simulator serving an adapter (vLLM's --lora-modules, listed
in /v1/models with its parent and path) behind a real control plane (exact KV events,
cache-aware placement) and data plane.

The control plane learns the adapter from /v1/models and routes requests naming it; the
data plane hashes their prompts with the adapter's key, as the engine does, so a repeated
LoRA prompt is predicted to hit the blocks the engine reported, and the base model's
chain of the same prompt matches none of them.
"""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from kvhash.hashing import BlockHashConfig, BlockHasher
from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until

ADAPTER, PATH = "sql-lora", "/adapters/sql"
PROMPT = list(range(500, 565))           # 65 tokens: 4 full blocks vLLM can reuse


def _predicted_hits(text: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("omni_kv_predicted_hit_blocks_total"))


@pytest.fixture
async def system(tmp_path):
    with ProcessGroup(str(tmp_path), ready_timeout=60) as group:
        sock = f"ipc://{tmp_path}/lora.sock"
        sim = group.start("sim", ["sim", "--port", "0", "--kv-events-endpoint", sock,
                                  "--lora-modules", f"{ADAPTER}={PATH}"])
        config = tmp_path / "cp.toml"
        config.write_text(f'[[workers]]\nid = "lora"\nurl = "{sim.url}"\nkv_events = "{sock}"\n')
        cp = group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--config",
                                str(config), "--policy", "cache_aware", "--health-interval", "0.2"])
        dp = group.start("dp", ["dataplane", "--port", "0", "--controlplane", cp.address])
        async with aiohttp.ClientSession() as http:
            yield sim, cp, dp, http


async def test_a_lora_request_is_routed_and_hashed_with_its_adapter(system):
    sim, cp, dp, http = system
    metrics_url = f"http://127.0.0.1:{cp.info['http_port']}/metrics"
    n = iter(range(1, 10_000))

    async def post(model: str, prompt: list[int]) -> int:
        async with http.post(dp.url + "/v1/completions",
                             json={"model": model, "prompt": prompt, "max_tokens": 1}) as r:
            return r.status

    async def adapter_served_and_events_flowing() -> bool:
        # The adapter is routable once a health check read /v1/models; the events SUB
        # subscribes late (PUB drops until then): fresh prompts until one was received.
        if await post(ADAPTER, [int(x) + 1000 * next(n) for x in range(20)]) != 200:
            return False
        async with http.get(metrics_url) as r:
            text = await r.text()
        return any(ln.startswith("omni_kv_events_total") and 'kind="received"' in ln
                   and float(ln.rsplit(" ", 1)[1]) > 0 for ln in text.splitlines())

    await wait_until(adapter_served_and_events_flowing, timeout=30, what="adapter routed, KV events received")

    engine = BlockHasher(BlockHashConfig(block_size=16, algo="sha256"))
    lora_chain = engine.event_hashes(PROMPT[:64], lora_name=ADAPTER, lora_path=PATH)
    base_chain = engine.event_hashes(PROMPT[:64])
    assert not set(lora_chain) & set(base_chain)
    assert await post(ADAPTER, PROMPT) == 200

    async with grpc.aio.insecure_channel(cp.address) as ch:
        admin = pb_grpc.AdminStub(ch)

        async def explain(chain: list[int], model: str) -> str:
            return (await admin.Explain(pb.PlaceRequest(model=model, leg=pb.LEG_ENTRY, block_hashes=chain,
                                                        explain=True))).explanation

        async def lora_blocks_indexed() -> bool:
            return "match=4/4blk" in await explain(lora_chain, ADAPTER)

        # The engine reported the prompt's blocks under the adapter's hashes, not the base's.
        await wait_until(lora_blocks_indexed, timeout=15, what="the LoRA request's blocks in the index")
        assert "match=0/4blk" in await explain(base_chain, "sim-model")

    async with http.get(metrics_url) as r:
        before = _predicted_hits(await r.text())
    assert await post("sim-model", PROMPT) == 200         # the base model's chain: no hit on the adapter's blocks
    async with http.get(metrics_url) as r:
        assert _predicted_hits(await r.text()) == before
    assert await post(ADAPTER, PROMPT) == 200             # the data plane's chain is the engine's: 4 blocks hit
    async with http.get(metrics_url) as r:
        assert _predicted_hits(await r.text()) == before + 4
