"""The vLLM engine plugin in a REAL vLLM (the CPU build): the engine joins by itself.

``scripts/install_vllm.sh`` registers the plugin in the vLLM venv under vLLM's
``vllm.general_plugins`` entry point (``omni_proxy``, as installing the omni-proxy or
omni-proxy-vllm-plugin wheel does); the engine gets this checkout on its
PYTHONPATH and the OMNI_* variables, nothing else: no
``--worker`` on the control plane. One engine (tiny random-weight Llama, block size 32, a
160-block KV pool, prefix caching with sha256 and PYTHONHASHSEED=0, KV events on ipc://)
behind a control plane whose cache_aware policy uses the prefix cache with the same
hashing, and a data plane. Checked:
  * a control plane listed first whose [kv_cache] block size differs refuses the engine, which
    logs why (one ERROR line) and registers with the next address;
  * the engine registers: ListWorkers and ``omni-ctl workers`` show it with the role,
    model, block size, hashing, KV capacity (160 x 32 tokens) and max batched tokens it runs
    with, source ``registry``, its KV-event endpoint, and its heartbeats carry its load;
  * a request through the data plane runs on it;
  * ``omni-ctl drain`` stops placements on it (the data plane answers 503);
  * SIGTERM to the engine's API server (what Kubernetes sends) deregisters it: it leaves
    the control plane at once, long before the heartbeat TTL (120 s here) would expire it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc

from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.vllm_harness.recipe import (controlplane_argv, controlplane_toml, dataplane_argv, plugin_env,
                                      prefix_cache_args, prefix_cache_env)
from tests.vllm_harness.vllm_server import (BLOCK_SIZE, SERVED_MODEL, cpu_slots, find_install, start_server,
                                            vllm_test_marks, wait_healthy)

INSTALL = find_install()
pytestmark = vllm_test_marks()
ROOT = Path(__file__).resolve().parent.parent
GPU_BLOCKS = 160
WORKER_ID = "vllm-plugin-0"


async def _workers(address: str) -> dict[str, pb.WorkerInfo]:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=10)
    return {w.id: w for w in resp.workers}


def _ctl(address: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", address, *argv],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})


async def test_vllm_registers_serves_drains_and_deregisters(tmp_path):
    python, model = INSTALL
    cfg = tmp_path / "controlplane.toml"
    # docs/real-engines.md's control plane and engine settings (tests/vllm_harness/recipe.py)
    timing = dict(heartbeat_interval_s=1.0, heartbeat_ttl_s=120, health_timeout_s=15, unhealthy_after=5)
    cfg.write_text(controlplane_toml(**timing))
    group = ProcessGroup(ready_timeout=60)
    server = None
    try:
        cp = group.start("controlplane", controlplane_argv(str(cfg), listen="127.0.0.1:0", http_port=0,
                                                           extra=("--health-interval", "0.5")))
        # Listed first: a control plane whose [kv_cache] block size differs. It refuses the
        # engine, which logs why and registers with the next address.
        bad_cfg = tmp_path / "controlplane-bad.toml"
        bad_cfg.write_text(controlplane_toml(**timing, block_size=16))
        bad = group.start("controlplane-bad", controlplane_argv(str(bad_cfg), listen="127.0.0.1:0", http_port=0))
        dp = group.start("dataplane", dataplane_argv(port=0, controlplane=cp.address, read_timeout=120,
                                                     placement_timeout=30))
        events = f"ipc://{tmp_path}/kv-events.sock"
        server = start_server("plugin", python=python, model=model, workdir=tmp_path, cpu=cpu_slots(1)[0],
                              extra_args=(*prefix_cache_args(events), "--num-gpu-blocks-override", str(GPU_BLOCKS)),
                              extra_env={**prefix_cache_env(), "PYTHONPATH": str(ROOT),
                                         **plugin_env(f"{bad.address},{cp.address}", WORKER_ID,
                                                      labels="test=vllm-plugin")})
        await asyncio.to_thread(wait_healthy, [server])
        started = time.monotonic()

        async def registered() -> bool:
            w = (await _workers(cp.address)).get(WORKER_ID)
            return w is not None and w.status == pb.STATUS_HEALTHY and w.load.engine_running >= 0
        await wait_until(registered, timeout=60, interval=0.5,
                         what=f"the engine registered, healthy, heart-beating\n{server.describe()}")
        w = (await _workers(cp.address))[WORKER_ID]
        assert (w.role, w.model, w.source) == (pb.ROLE_BOTH, SERVED_MODEL, "registry"), w
        assert w.url == server.url and w.labels["test"] == "vllm-plugin" and w.kv_events == events
        e = w.engine
        assert (e.block_size, e.hash_algo, e.hash_seed_set, e.prefix_caching) == (BLOCK_SIZE, "sha256", True, True), e
        assert e.kv_capacity_tokens == GPU_BLOCKS * BLOCK_SIZE, e
        assert e.max_batched_tokens > 0 and e.kv_connector == "" and e.engine_version.startswith("vllm"), e
        print(f"registered {time.monotonic() - started:.1f} s after /health; engine facts: {e}".replace("\n", " "))

        out = _ctl(cp.address, "workers")
        assert out.returncode == 0, out.stderr
        assert WORKER_ID in out.stdout and f"blk {BLOCK_SIZE}" in out.stdout, out.stdout
        assert f"KV {GPU_BLOCKS * BLOCK_SIZE} tok" in out.stdout and "registry" in out.stdout, out.stdout

        timeout = aiohttp.ClientTimeout(total=180)
        body = {"model": SERVED_MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(dp.url + "/v1/completions", json=body) as r:
                text = await r.text()
                assert r.status == 200, text
            assert (await _workers(cp.address))[WORKER_ID].placements_total >= 1

            out = _ctl(cp.address, "drain", WORKER_ID)
            assert out.returncode == 0, out.stderr
            async with session.post(dp.url + "/v1/completions", json=body) as r:
                assert r.status == 503, await r.text()

        # What Kubernetes does: SIGTERM to the API server (the container's main process).
        os.kill(server.proc.pid, signal.SIGTERM)
        stopped = time.monotonic()

        async def gone() -> bool:
            return WORKER_ID not in await _workers(cp.address)
        await wait_until(gone, timeout=60, interval=0.2, what=f"the engine deregistered\n{server.describe()}")
        print(f"deregistered {time.monotonic() - stopped:.1f} s after SIGTERM")
        assert time.monotonic() - stopped < 60           # far less than heartbeat_ttl_s (120 s)
        await asyncio.to_thread(server.proc.wait, 60)
        log = server.log_path.read_text(errors="replace")
        assert "omni-proxy: registered with" in log and "omni-proxy: deregistered worker" in log, server.describe()
        refusal = next(line for line in log.splitlines() if "REFUSED this engine" in line)
        assert bad.address in refusal and "block size 32 (control plane [kv_cache] block_size = 16)" in refusal
        print(refusal)
    finally:
        group.close()
        if server is not None:
            server.stop()
