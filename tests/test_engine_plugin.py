"""The vLLM engine plugin's registration agent against an in-process control plane.

A stand-in engine (aiohttp on 127.0.0.1: /health, /metrics with vLLM's metric names) plays the
engine; the agent runs on its own thread as it does inside vLLM's API server. Checked:
registration with the engine's facts (shown again in ListWorkers), heartbeats carrying the
engine's running/waiting, re-registration after a control-plane restart (known=false),
deregistration on stop, refusal of an engine whose prefix-cache hashing cannot match the
control plane's [kv_cache] (INVALID_ARGUMENT, one ERROR line), retries while no control plane
answers, several control-plane addresses, environment parsing and the plugin's process guard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import sys
import types

import grpc
import pytest
from aiohttp import web

from controlplane.config import ControlPlaneConfig
from controlplane.kvcache.manager import KVCacheConfig
from controlplane.server import ControlPlane
from engine_plugins import vllm_plugin
from engine_plugins.vllm_plugin.agent import Agent, EngineFacts, Settings, build_request, public_endpoint, read_load
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.ports import refused_port, reserved_port


class StandInEngine:
    def __init__(self) -> None:
        self.running, self.waiting, self.healthy = 3, 1, True
        self.health_checks = 0           # /health requests answered (the agent's polls)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> StandInEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def _health(self, request):
        self.health_checks += 1
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request):
        return web.Response(text=(
            "# HELP vllm:num_requests_running x\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}.0\n'))

    async def stop(self) -> None:
        await self.runner.cleanup()


def facts_for(engine: StandInEngine, **kw) -> EngineFacts:
    base = dict(host="127.0.0.1", port=engine.port, models=["tiny"], block_size=16, prefix_caching=True,
                hash_algo="sha256", hash_seed=None, kv_capacity_tokens=16 * 1000, max_batched_tokens=2048,
                kv_connector="NixlConnector", kv_role="kv_producer", engine_version="vllm test")
    base.update(kw)
    return EngineFacts(**base)


async def start_cp(port: int = 0, **config) -> ControlPlane:
    config.setdefault("http_port", 0)    # several at once: not the fixed default port
    plane = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", heartbeat_interval_s=0.2,
                                            heartbeat_ttl_s=5.0, **config))
    await plane.start()
    return plane


async def list_workers(address: str) -> list[pb.WorkerInfo]:
    async with grpc.aio.insecure_channel(address) as ch:
        return list((await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest())).workers)


@pytest.fixture
async def engine():
    eng = await StandInEngine().start()
    yield eng
    await eng.stop()


async def stop_agent(agent: Agent) -> bool:
    return await asyncio.to_thread(agent.stop)


async def test_register_heartbeat_deregister(engine):
    plane = await start_cp()
    address = f"127.0.0.1:{plane.grpc_port}"
    settings = Settings(controlplanes=[address], worker_id="eng-1", labels={"zone": "a"}, weight=2.0)
    agent = Agent(settings, facts_for(engine)).start()
    try:
        async def registered():
            return any(w.id == "eng-1" for w in await list_workers(address))
        await wait_until(registered, what="the engine registered")
        (w,) = [w for w in await list_workers(address) if w.id == "eng-1"]
        assert w.role == pb.ROLE_PREFILL                  # from kv_role kv_producer
        assert w.model == "tiny" and w.source == "registry" and w.weight == 2.0
        assert w.url == f"http://127.0.0.1:{engine.port}"
        assert w.labels["zone"] == "a"
        assert w.HasField("engine")
        assert (w.engine.block_size, w.engine.hash_algo, w.engine.hash_seed_set) == (16, "sha256", False)
        assert (w.engine.kv_capacity_tokens, w.engine.max_batched_tokens) == (16000, 2048)
        assert ((w.engine.kv_connector, w.engine.kv_role, w.engine.prefix_caching)
                == ("NixlConnector", "kv_producer", True))

        async def load_reported():
            eng = plane.registry.fleet.engine("eng-1")
            return agent.heartbeats >= 2 and eng.running == 3 and eng.waiting == 1
        await wait_until(load_reported, what="heartbeats with the engine's running/waiting")
        engine.running, engine.waiting = 5, 0

        async def load_changed():
            eng = plane.registry.fleet.engine("eng-1")
            return (eng.running, eng.waiting) == (5, 0)
        await wait_until(load_changed, what="the new load")

        assert await stop_agent(agent)
        assert not any(w.id == "eng-1" for w in await list_workers(address)), "deregistered on stop"
        assert agent.registrations == 1
    finally:
        agent.stop()
        await plane.stop()


async def test_waits_for_engine_health(engine):
    engine.healthy = False
    plane = await start_cp()
    address = f"127.0.0.1:{plane.grpc_port}"
    agent = Agent(Settings(controlplanes=[address], worker_id="late"), facts_for(engine)).start()
    try:
        # Two unhealthy answers seen by the agent, and still no registration.
        await wait_until(lambda: engine.health_checks >= 2, what="the agent's health polls")
        assert agent.registrations == 0 and not any(w.id == "late" for w in await list_workers(address))
        engine.healthy = True

        async def registered():
            return agent.registrations == 1
        await wait_until(registered, what="registration once /health answers")
    finally:
        await stop_agent(agent)
        await plane.stop()


async def test_retries_while_down_and_reregisters_after_restart(engine, caplog):
    port = reserved_port()       # the control plane comes up (twice) at an address the agent already has
    agent = Agent(Settings(controlplanes=[f"127.0.0.1:{port}"], worker_id="eng-r", rpc_timeout_s=1.0),
                  facts_for(engine, kv_role="")).start()
    plane = None
    try:
        def failed_attempts() -> int:
            return sum("register with" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
        await wait_until(lambda: failed_attempts() >= 2, what="several attempts against nothing")
        assert agent.registrations == 0 and agent.last_error
        plane = await start_cp(port)

        async def registered():
            return agent.registrations == 1 and any(w.id == "eng-r" for w in await list_workers(f"127.0.0.1:{port}"))
        await wait_until(registered, timeout=40, what="registration once the control plane is up")
        (w,) = await list_workers(f"127.0.0.1:{port}")
        assert w.role == pb.ROLE_BOTH                     # no KV connector: both

        await plane.stop()                           # restart: the new one knows nothing
        plane = await start_cp(port)

        async def reregistered():
            return agent.registrations >= 2 and any(w.id == "eng-r" for w in await list_workers(f"127.0.0.1:{port}"))
        await wait_until(reregistered, timeout=40, what="registration again after the restart")
    finally:
        await stop_agent(agent)
        if plane is not None:
            await plane.stop()


async def test_registration_backs_off_by_the_shared_retry_policy(engine):
    """No control plane answers: the pauses between Register calls are omni_runtime.retry's
    windows, 0.5 s doubling to 30 s (the draw pinned to the window's top, the waits recorded)."""
    class TopOfWindow:
        def uniform(self, low: float, high: float) -> float:
            return high
    waits: list[float] = []
    with refused_port() as nobody:
        agent = Agent(Settings(controlplanes=[f"127.0.0.1:{nobody}"], worker_id="eng-b", rpc_timeout_s=1.0),
                      facts_for(engine))
        agent.REGISTER_RETRY = dataclasses.replace(Agent.REGISTER_RETRY, rng=TopOfWindow())

        def wait(seconds: float) -> bool:   # recorded, not slept; True (stop) after eight
            waits.append(seconds)
            return len(waits) >= 8
        agent._wait = wait
        agent.start()
        try:
            assert agent._thread is not None
            await asyncio.to_thread(agent._thread.join, 20)
            assert not agent._thread.is_alive()
        finally:
            await stop_agent(agent)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0] and agent.registrations == 0


async def test_second_address_used_when_first_is_down(engine):
    plane = await start_cp()
    with refused_port() as nobody:
        agent = Agent(Settings(controlplanes=[f"127.0.0.1:{nobody}", f"127.0.0.1:{plane.grpc_port}"],
                               worker_id="eng-2", rpc_timeout_s=1.0), facts_for(engine)).start()
        try:
            async def registered():
                return agent.registrations == 1
            await wait_until(registered, timeout=20, what="registration with the second address")
        finally:
            await stop_agent(agent)
            await plane.stop()


@pytest.mark.parametrize("engine_kw, words", [
    (dict(block_size=32), "block size 32"),
    (dict(hash_algo="xxhash"), "hash algorithm xxhash"),
    (dict(hash_seed="0"), "PYTHONHASHSEED set"),
])
async def test_hashing_mismatch_refused(engine, caplog, engine_kw, words):
    plane = await start_cp(policy="cache_aware", kv_cache=KVCacheConfig(block_size=16, hash_algo="sha256"))
    address = f"127.0.0.1:{plane.grpc_port}"
    agent = Agent(Settings(controlplanes=[address], worker_id="bad"), facts_for(engine, **engine_kw),
                  refused_retry_s=60).start()
    try:
        with caplog.at_level(logging.ERROR, logger="vllm.omni_proxy"):
            async def refused():
                return bool(agent.refused)
            await wait_until(refused, what="the refusal")
        assert "INVALID_ARGUMENT" in agent.refused and words in agent.refused
        assert agent.registrations == 0 and not await list_workers(address)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "REFUSED" in errors[0] and words in errors[0]
    finally:
        await stop_agent(agent)
        await plane.stop()


async def test_matching_hashing_accepted_with_prefix_policy(engine):
    plane = await start_cp(policy="cache_aware", kv_cache=KVCacheConfig(block_size=16, hash_algo="sha256",
                                                                        hash_seed="0"))
    address = f"127.0.0.1:{plane.grpc_port}"
    agent = Agent(Settings(controlplanes=[address], worker_id="good"), facts_for(engine, hash_seed="0")).start()
    try:
        async def registered():
            return agent.registrations == 1
        await wait_until(registered, what="registration")
        (w,) = await list_workers(address)
        assert w.engine.hash_seed_set and "engine.hash_seed" not in w.labels   # the seed itself is not kept
    finally:
        await stop_agent(agent)
        await plane.stop()


async def test_token_sent_as_bearer(engine):
    plane = await start_cp()
    seen = []

    class Spy(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            seen.append(dict(details.invocation_metadata or ()).get("authorization"))
            return await continuation(details)

    server = grpc.aio.server(interceptors=[Spy()])
    pb_grpc.add_RegistryServicer_to_server(__import__("controlplane.services", fromlist=["x"]).RegistryService(
        plane.registry), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    agent = Agent(Settings(controlplanes=[f"127.0.0.1:{port}"], worker_id="tok", token="s3cret"),
                  facts_for(engine)).start()
    try:
        async def registered():
            return agent.registrations == 1
        await wait_until(registered, what="registration")
        assert seen and all(v == "Bearer s3cret" for v in seen)
    finally:
        await stop_agent(agent)
        await server.stop(None)
        await plane.stop()


def test_settings_from_env():
    assert Settings.from_env({}) is None
    s = Settings.from_env({"OMNI_CONTROLPLANE": "a:1, b:2", "OMNI_ROLE": "Decode", "OMNI_LABELS": "k=v,x=y",
                           "OMNI_WEIGHT": "3", "OMNI_KV_EVENTS": "tcp://10.0.0.1:5557"})
    assert s.controlplanes == ["a:1", "b:2"] and s.role == "decode" and s.labels == {"k": "v", "x": "y"}
    assert s.weight == 3.0 and s.kv_events == "tcp://10.0.0.1:5557" and s.kv_replay is None
    for bad in ({"OMNI_ROLE": "chef"}, {"OMNI_LABELS": "novalue"}, {"OMNI_WEIGHT": "x"}):
        with pytest.raises(ValueError):
            Settings.from_env({"OMNI_CONTROLPLANE": "a:1", **bad})


def test_request_derivation():
    facts = EngineFacts(host="0.0.0.0", port=8000, models=["m", "m-alias"], block_size=16, hash_algo="sha256",
                        kv_events="tcp://*:5557", kv_replay="tcp://*:5558", kv_role="kv_consumer", dp_size=2)
    req = build_request(Settings(controlplanes=["cp:50051"], advertise_url="http://10.1.2.3:8000"), facts)
    assert req.url == "http://10.1.2.3:8000" and req.role == pb.ROLE_DECODE and req.model == "m"
    assert req.kv_events == "tcp://10.1.2.3:5557" and req.kv_replay == "tcp://10.1.2.3:5558" and req.dp_size == 2
    assert req.labels["served_models"] == "m,m-alias"
    req = build_request(Settings(controlplanes=["cp:50051"], advertise_url="http://h:1", role="both",
                                 kv_events="none"), facts)
    assert req.role == pb.ROLE_BOTH and req.kv_events == "" and req.kv_replay == ""
    assert public_endpoint("ipc:///tmp/x", "http://h:1") == "ipc:///tmp/x"
    assert public_endpoint("tcp://10.0.0.9:5557", "http://h:1") == "tcp://10.0.0.9:5557"
    # no advertised URL and a wildcard bind: this host's address toward the control plane
    req = build_request(Settings(controlplanes=["127.0.0.1:50051"]), facts)
    assert req.url == "http://127.0.0.1:8000"


async def test_read_load(engine):
    assert await asyncio.to_thread(read_load, f"http://127.0.0.1:{engine.port}") == (3, 1)
    with refused_port() as nobody:
        assert await asyncio.to_thread(read_load, f"http://127.0.0.1:{nobody}") == (-1, -1)


def test_plugin_only_patches_the_api_server(monkeypatch):
    """No OMNI_CONTROLPLANE, or a process without vLLM's HTTP entry module: nothing happens."""
    monkeypatch.setattr(vllm_plugin, "_state", {"patched": False, "agent": None})
    monkeypatch.delenv("OMNI_CONTROLPLANE", raising=False)
    fake = types.ModuleType(vllm_plugin._ENTRY)

    async def build_and_serve(*a, **k):
        return None
    fake.build_and_serve = build_and_serve
    monkeypatch.setitem(sys.modules, vllm_plugin._ENTRY, fake)
    vllm_plugin.register()
    assert fake.build_and_serve is build_and_serve
    monkeypatch.setenv("OMNI_CONTROLPLANE", "127.0.0.1:1")
    monkeypatch.delitem(sys.modules, vllm_plugin._ENTRY)
    vllm_plugin.register()                       # engine core / worker: no entry module
    assert not vllm_plugin._state["patched"]
    monkeypatch.setitem(sys.modules, vllm_plugin._ENTRY, fake)
    vllm_plugin.register()
    vllm_plugin.register()                       # loaded again: patched once
    assert fake.build_and_serve is not build_and_serve and fake.build_and_serve._omni_proxy
    monkeypatch.setenv("OMNI_ROLE", "chef")      # bad settings: logged, never raised
    monkeypatch.setattr(vllm_plugin, "_state", {"patched": False, "agent": None})
    vllm_plugin.register()


def _vllm_config(**cache):
    ns = types.SimpleNamespace
    return ns(cache_config=ns(**{"block_size": 32, "num_gpu_blocks": 100, "enable_prefix_caching": True,
                                 "prefix_caching_hash_algo": "sha256", **cache}),
              kv_events_config=ns(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557",
                                  replay_endpoint="tcp://*:5558"),
              kv_transfer_config=ns(kv_connector="NixlConnector", kv_role="kv_consumer"),
              parallel_config=ns(data_parallel_size=2),
              scheduler_config=ns(max_num_batched_tokens=4096, max_num_seqs=128),
              model_config=ns(served_model_name="m", model="/models/m"))


def test_facts_from_vllm_config(monkeypatch):
    from engine_plugins.vllm_plugin.facts import facts_from_vllm

    monkeypatch.setenv("PYTHONHASHSEED", "7")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        facts = facts_from_vllm(_vllm_config(), types.SimpleNamespace(host="0.0.0.0", port=0, served_model_name=None),
                                sock)
        assert facts.port == sock.getsockname()[1] and facts.models == ["m"]
    finally:
        sock.close()
    assert (facts.block_size, facts.kv_capacity_tokens, facts.max_batched_tokens) == (32, 3200, 4096)
    assert (facts.hash_algo, facts.hash_seed, facts.prefix_caching) == ("sha256", "7", True)
    assert (facts.kv_events, facts.kv_replay, facts.dp_size) == ("tcp://*:5557", "tcp://*:5558", 2)
    assert (facts.kv_connector, facts.kv_role) == ("NixlConnector", "kv_consumer")
    req = build_request(Settings(controlplanes=["cp:1"], advertise_url="http://10.0.0.2:8000"), facts)
    assert req.role == pb.ROLE_DECODE and req.kv_events == "tcp://10.0.0.2:5557" and req.engine.hash_seed == "7"
    # the engine's --max-num-seqs travels as the worker's label max_num_seqs (its seats in the
    # TTFT prediction); an operator's label wins
    assert facts.max_num_seqs == 128 and req.labels["max_num_seqs"] == "128"
    req = build_request(Settings(controlplanes=["cp:1"], advertise_url="http://10.0.0.2:8000",
                                 labels={"max_num_seqs": "64"}), facts)
    assert req.labels["max_num_seqs"] == "64"
    empty = facts_from_vllm(None, types.SimpleNamespace(port=8000, served_model_name=["a", "b"]))
    assert empty.models == ["a", "b"] and empty.block_size == 0 and empty.kv_events == ""


async def test_plugin_wraps_build_and_serve(monkeypatch, engine):
    """The wrapped build_and_serve registers while the server runs; the engine client's
    shutdown (vLLM's SIGTERM path) deregisters before the real shutdown runs."""
    plane = await start_cp()
    address = f"127.0.0.1:{plane.grpc_port}"
    monkeypatch.setattr(vllm_plugin, "_state", {"patched": False, "agent": None})
    monkeypatch.setenv("OMNI_CONTROLPLANE", address)
    monkeypatch.setenv("OMNI_WORKER_ID", "wrapped")
    fake = types.ModuleType(vllm_plugin._ENTRY)
    stop_serving = asyncio.Event()
    order = []
    served = []

    async def build_and_serve(engine_client, listen_address, sock, args, peer_loads=None, **kwargs):
        served.append(peer_loads)                # the wrapper decided whether to register, and serves
        await stop_serving.wait()                 # vLLM's serves until shutdown
        return "shutdown-task"
    fake.build_and_serve = build_and_serve
    monkeypatch.setitem(sys.modules, vllm_plugin._ENTRY, fake)
    vllm_plugin.register()

    class Client:
        vllm_config = _vllm_config(block_size=16, num_gpu_blocks=10)

        def shutdown(self, timeout=None):
            order.append(("shutdown", "wrapped" in plane.registry.fleet))

    client = Client()
    client.vllm_config.kv_events_config.enable_kv_cache_events = False
    args = types.SimpleNamespace(host="127.0.0.1", port=engine.port, served_model_name=["tiny"])
    other = asyncio.ensure_future(fake.build_and_serve(client, "", None, args, ([0, 0], 1)))
    await wait_until(lambda: len(served) == 1, what="the second API server serving")
    assert vllm_plugin._state["agent"] is None, "a second API server (client index 1) does not register"
    serving = asyncio.ensure_future(fake.build_and_serve(client, "", None, args, ([0, 0], 0)))
    try:
        async def registered():
            return "wrapped" in plane.registry.fleet
        await wait_until(registered, what="registration from the wrapped build_and_serve")
        (w,) = await list_workers(address)
        assert w.engine.kv_capacity_tokens == 160 and w.role == pb.ROLE_DECODE and w.model == "tiny"
        await asyncio.to_thread(client.shutdown, timeout=0)
        assert order == [("shutdown", False)], "deregistered before the engine client's shutdown ran"
        stop_serving.set()
        assert await serving == "shutdown-task" and await other == "shutdown-task"
    finally:
        stop_serving.set()
        agent = vllm_plugin._state["agent"]
        if agent is not None:
            await stop_agent(agent)
        await plane.stop()


async def test_plugin_hooks_older_vllm_init_app_state(monkeypatch, engine):
    """vLLM before the launchers package (what vLLM-Ascend pins): init_app_state(engine_client,
    vllm_config, state, args) in vllm.entrypoints.openai.api_server is wrapped instead."""
    plane = await start_cp()
    address = f"127.0.0.1:{plane.grpc_port}"
    monkeypatch.setattr(vllm_plugin, "_state", {"patched": False, "agent": None})
    monkeypatch.setenv("OMNI_CONTROLPLANE", address)
    monkeypatch.setenv("OMNI_WORKER_ID", "legacy")
    monkeypatch.delitem(sys.modules, vllm_plugin._ENTRY, raising=False)
    legacy = types.ModuleType(vllm_plugin._LEGACY)

    async def init_app_state(engine_client, vllm_config, state, args):
        state.ready = True
    legacy.init_app_state = init_app_state
    monkeypatch.setitem(sys.modules, vllm_plugin._LEGACY, legacy)
    vllm_plugin.register()
    assert legacy.init_app_state is not init_app_state
    config = _vllm_config(block_size=16, num_gpu_blocks=4)
    config.kv_events_config.enable_kv_cache_events = False
    config.kv_transfer_config = None
    state = types.SimpleNamespace()
    await legacy.init_app_state(types.SimpleNamespace(), config, state,
                                types.SimpleNamespace(host="127.0.0.1", port=engine.port, served_model_name=None))
    try:
        assert state.ready

        async def registered():
            return "legacy" in plane.registry.fleet
        await wait_until(registered, what="registration through the older vLLM hook")
        (w,) = await list_workers(address)
        assert w.engine.kv_capacity_tokens == 64 and w.role == pb.ROLE_BOTH and w.model == "m"
    finally:
        await stop_agent(vllm_plugin._state["agent"])
        await plane.stop()


async def test_refused_by_one_address_registers_with_the_next(engine, caplog):
    bad = await start_cp(policy="cache_aware", kv_cache=KVCacheConfig(block_size=64))
    good = await start_cp()
    agent = Agent(Settings(controlplanes=[f"127.0.0.1:{bad.grpc_port}", f"127.0.0.1:{good.grpc_port}"],
                           worker_id="moved"), facts_for(engine), refused_retry_s=60).start()
    try:
        with caplog.at_level(logging.ERROR, logger="vllm.omni_proxy"):
            async def registered():
                return agent.registrations == 1
            await wait_until(registered, timeout=10, what="registration with the second address")
        assert "moved" in good.registry.fleet and "moved" not in bad.registry.fleet
        assert any("REFUSED" in r.getMessage() and "block size 16" in r.getMessage() for r in caplog.records)
    finally:
        await stop_agent(agent)
        await bad.stop()
        await good.stop()


async def test_a_second_engine_cannot_take_a_registered_id_until_the_first_lets_go(engine, caplog):
    """Two engines started with the same OMNI_WORKER_ID: the second is refused (ALREADY_EXISTS,
    retried with backoff) while the first holds the id, and registers once it deregisters."""
    caplog.set_level(logging.WARNING, logger="vllm.omni_proxy")
    plane = await start_cp()
    address = f"127.0.0.1:{plane.grpc_port}"
    first = Agent(Settings(controlplanes=[address], worker_id="same"), facts_for(engine)).start()
    second = None
    try:
        async def first_registered():
            return first.registrations == 1
        await wait_until(first_registered, what="the first engine registered")
        url = plane.fleet.get("same").url
        second = Agent(Settings(controlplanes=[address], worker_id="same", advertise_url="http://127.0.0.1:9"),
                       facts_for(engine))
        second.REGISTER_RETRY = dataclasses.replace(Agent.REGISTER_RETRY, max_s=0.5)
        second.start()

        async def second_refused():
            return "ALREADY_EXISTS" in second.last_error
        await wait_until(second_refused, what="the second engine refused")
        assert second.registrations == 0 and plane.fleet.get("same").url == url
        heartbeats = first.heartbeats

        async def first_still_beating():
            return first.heartbeats >= heartbeats + 2
        await wait_until(first_still_beating, what="the owner's heartbeats accepted")
        assert await stop_agent(first)

        async def second_registered():
            return second.registrations == 1 and plane.fleet.get("same").url == "http://127.0.0.1:9"
        await wait_until(second_registered, what="the second engine registered once the id was free")
    finally:
        await stop_agent(first)
        if second is not None:
            await stop_agent(second)
        await plane.stop()
