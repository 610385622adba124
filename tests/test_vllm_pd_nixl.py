"""PD disaggregation end to end against a REAL vLLM: omni-proxy in front of a prefill and a
decode vLLM (the CPU build) that move KV blocks with NixlConnector.

scripts/install_vllm.sh (called by scripts/test.sh) installs vLLM and a tiny random-weight
Llama outside the repository. Only two engines run, each pinned to its own core: P
(kv_producer) and D (kv_consumer). The aggregated reference is P itself, asked directly
without kv_transfer_params and with a cache_salt so that it computes the prompt afresh.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp
import grpc
import pytest

from omni_proxy.launcher import Child, ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.vllm_harness.recipe import controlplane_argv, controlplane_toml, dataplane_argv
from tests.vllm_harness.vllm_server import (SERVED_MODEL, VllmServer, cpu_slots, find_install,
                                            parse_metrics, start_server, vllm_test_marks, wait_healthy, warm_up_nixl)

INSTALL = find_install()

pytestmark = vllm_test_marks()

EXTERNAL = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
LOCAL = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
MAX_TOKENS = 8
# Generous: on a shared, overloaded 2-core machine one leg has taken minutes; no timing is asserted.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=420)


@dataclass
class Fleet:
    prefill: VllmServer
    decode: VllmServer
    cp: Child
    dp: Child
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return self.dp.url

    def logs(self) -> str:
        parts = [self.prefill.describe(40), self.decode.describe(40)]
        for child in (self.cp, self.dp):
            parts.append(f"--- {child.name} log {child.log_path}:\n{child.log_tail(30)}")
        return "\n".join(parts)

    def workers(self) -> dict[str, pb.WorkerInfo]:
        with grpc.insecure_channel(self.cp.address) as channel:
            reply = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=10)
        return {w.id: w for w in reply.workers}

    async def all_idle(self) -> bool:
        """The control plane's load ledger is back to zero: every placement was released."""
        workers = await asyncio.to_thread(self.workers)
        return all(w.load.inflight_requests == 0 and w.load.inflight_tokens == 0 for w in workers.values())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    python, model = INSTALL
    workdir = tmp_path_factory.mktemp("vllm")
    t0 = time.monotonic()
    p_cpu, d_cpu = cpu_slots(2)
    servers: list[VllmServer] = []
    group: ProcessGroup | None = None
    try:
        # Both start at once: most of the minute is imports and process spawns.
        servers.append(start_server("prefill", python=python, model=model, workdir=workdir, cpu=p_cpu,
                                    kv_role="kv_producer"))
        servers.append(start_server("decode", python=python, model=model, workdir=workdir, cpu=d_cpu,
                                    kv_role="kv_consumer"))
        wait_healthy(servers)
        prefill, decode = servers
        # D's first pull from P starts with a one-time NIXL handshake (seconds, and it can time
        # out on a starved machine); do it here so the tests see an engine pair that is ready.
        handshake_attempts = warm_up_nixl(prefill, decode)
        group = ProcessGroup(ready_timeout=60)
        # Patient settings for a shared 2-core machine: a starved engine can take seconds to answer
        # /health (that must not take it out of rotation mid-test), or minutes to answer a leg.
        config = workdir / "controlplane.toml"
        # (tests/vllm_harness/recipe.py: the command lines of docs/real-engines.md)
        config.write_text(controlplane_toml(policy=None, health_timeout_s=15, unhealthy_after=5, kv_cache=False))
        cp = group.start("controlplane", controlplane_argv(
            str(config), listen="127.0.0.1:0", http_port=0,
            extra=("--prefill", f"{prefill.url},id=p", "--decode", f"{decode.url},id=d", "--health-interval", "0.5")))
        dp = group.start("dataplane", dataplane_argv(port=0, controlplane=cp.address, read_timeout=300,
                                                     placement_timeout=30))
        fleet = Fleet(prefill=prefill, decode=decode, cp=cp, dp=dp)
        _wait_workers_healthy(fleet)
        fleet.startup_s = time.monotonic() - t0
        print(f"\nvLLM fleet ready in {fleet.startup_s:.1f}s (prefill /health after "
              f"{prefill.ready_after:.1f}s, decode after {decode.ready_after:.1f}s; "
              f"NIXL handshake took {handshake_attempts} attempt(s))")
        yield fleet
    finally:
        if group is not None:
            group.close()
        for server in servers:
            server.stop()


def _wait_workers_healthy(fleet: Fleet, timeout: float = 30.0) -> None:
    """The control plane health-checks every 0.5 s; place nothing before it saw P and D."""
    deadline = time.monotonic() + timeout
    while True:
        workers = fleet.workers()
        if all(w in workers and workers[w].status == pb.STATUS_HEALTHY for w in ("p", "d")):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"control plane did not see P and D healthy in {timeout}s: "
                                 f"{workers}\n{fleet.logs()}")
        time.sleep(0.2)


async def _metrics(session: aiohttp.ClientSession, server: VllmServer) -> dict[str, float]:
    async with session.get(server.url + "/metrics") as r:
        assert r.status == 200
        return parse_metrics(await r.text())


async def _delta(session, server, before: dict[str, float], name: str) -> float:
    return (await _metrics(session, server)).get(name, 0.0) - before.get(name, 0.0)


async def _reference(session: aiohttp.ClientSession, fleet: Fleet, prompt) -> dict:
    """The same request run aggregated on P: no kv_transfer_params; the cache_salt keeps P from
    reusing the blocks it computed for the PD request, so the prompt is computed again."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "cache_salt": f"reference-{random.random()}"}
    async with session.post(fleet.prefill.url + "/v1/completions", json=body) as r:
        text = await r.text()
        assert r.status == 200, f"{text}\n{fleet.logs()}"
    data = json.loads(text)
    assert data["kv_transfer_params"] is None
    return data


async def _check_kv_arrived_by_transfer(session, fleet: Fleet, p0, d0, prompt_tokens: int) -> None:
    """D took every prompt token from P over NIXL and computed none itself; P computed them."""
    async def counted() -> bool:
        return await _delta(session, fleet.decode, d0, EXTERNAL) >= prompt_tokens

    try:
        await wait_until(counted, timeout=10, what="D's external_kv_transfer counter", interval=0.1)
    except AssertionError:
        pass   # the assertions below say what was counted
    d1, p1 = await _metrics(session, fleet.decode), await _metrics(session, fleet.prefill)
    d_delta = {k: d1.get(k, 0.0) - d0.get(k, 0.0) for k in (EXTERNAL, LOCAL)}
    p_delta = {k: p1.get(k, 0.0) - p0.get(k, 0.0) for k in (EXTERNAL, LOCAL)}
    context = f"prompt_tokens={prompt_tokens} D delta {d_delta} P delta {p_delta}\n{fleet.logs()}"
    assert d_delta[EXTERNAL] == prompt_tokens, context
    assert d_delta[LOCAL] == 0, context
    assert p_delta[LOCAL] == prompt_tokens, context


def _assert_same_output(pd_text: str, pd_logprobs: list[float] | None, ref: dict, fleet: Fleet) -> None:
    choice = ref["choices"][0]
    context = f"PD {pd_text!r} {pd_logprobs} vs aggregated {choice['text']!r} {choice['logprobs']}\n{fleet.logs()}"
    assert pd_text == choice["text"], context
    if pd_logprobs is not None:
        assert pd_logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-3), context


async def test_pd_completion_through_nixl_matches_aggregated(fleet: Fleet):
    rng = random.Random(20261122)
    prompt = [rng.randrange(1000, 100000) for _ in range(300)]
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        p0, d0 = await _metrics(session, fleet.prefill), await _metrics(session, fleet.decode)
        async with session.post(fleet.url + "/v1/completions", json=body) as r:
            text = await r.text()
            assert r.status == 200, f"{text}\n{fleet.logs()}"
        data = json.loads(text)
        assert data["usage"]["prompt_tokens"] == len(prompt), text
        assert data["usage"]["completion_tokens"] == MAX_TOKENS, text
        await _check_kv_arrived_by_transfer(session, fleet, p0, d0, len(prompt))
        choice = data["choices"][0]
        _assert_same_output(choice["text"], choice["logprobs"]["token_logprobs"],
                            await _reference(session, fleet, prompt), fleet)
    await wait_until(fleet.all_idle, what="control plane to release the request")


async def test_pd_streaming_text_prompt_through_nixl_matches_aggregated(fleet: Fleet):
    rng = random.Random(7)
    words = ["prefill", "decode", "cache", "block", "token", "engine", "router", "stream", "latency"]
    prompt = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(120))
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        p0, d0 = await _metrics(session, fleet.prefill), await _metrics(session, fleet.decode)
        async with session.post(fleet.url + "/v1/completions", json=body) as r:
            raw = (await r.read()).decode()
            assert r.status == 200, f"{raw}\n{fleet.logs()}"
            assert r.headers["Content-Type"].startswith("text/event-stream"), raw
        events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw
        chunks = [json.loads(e) for e in events[:-1]]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] > 200, raw
        await _check_kv_arrived_by_transfer(session, fleet, p0, d0, usage["prompt_tokens"])
        _assert_same_output(streamed, None, await _reference(session, fleet, prompt), fleet)
    await wait_until(fleet.all_idle, what="control plane to release the request")
