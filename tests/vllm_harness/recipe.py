"""The command lines of a real PD fleet: one source for the real-vLLM tests and docs/real-engines.md.

``tests/test_vllm_pd_nixl.py``, ``tests/test_vllm_plugin.py`` (through ``vllm_server.start_server``)
and ``tests/test_vllm_kv_events.py`` build their vLLM, control-plane and data-plane command lines
and environments from these functions; ``docs/real-engines.md`` shows the same functions' output
for an operator's machine. Each code block of the page sits under a marker
``<!-- recipe: NAME -->`` and is exactly ``blocks()[NAME]``; ``tests/test_real_engines_doc.py``
checks that, and

    python -m tests.vllm_harness.recipe docs/real-engines.md

rewrites the blocks after a change here. Nothing here imports vLLM or starts anything.

What only the tests add (a CPU build on a shared 2-core machine: ``--enforce-eager``, a small
KV pool, CPU KV buffers, pinned cores) is in ``TEST_ONLY_*``; what only an operator adds (GPUs:
``CUDA_VISIBLE_DEVICES``, ``--tensor-parallel-size``, ...) is in ``GPU_*``, shown marked on the
page and never run by the tests.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The engines' settings the control plane must agree with ([kv_cache]); the same on the page.
BLOCK_SIZE = 32
HASH_ALGO = "sha256"
HASH_SEED = "0"                      # PYTHONHASHSEED of every engine = [kv_cache] hash_seed
MAX_MODEL_LEN = 2048
# How long P keeps a prefilled request's KV blocks for D to pull (vLLM's default is 30 s).
# On an overloaded 2-core machine D can take longer than that to get to the pull.
KV_LEASE_S = 120
KV_EVENTS_TOPIC = "kv-events"
PLUGIN = "omni_proxy"                # the vllm.general_plugins entry point (VLLM_PLUGINS)

# The tests' engines: vLLM's CPU build and a tiny model (scripts/install_vllm.sh).
SERVED_MODEL = "tiny-llama"
TEST_ONLY_ARGS = ("--enforce-eager",)          # no torch.compile: starts 2-3x faster on CPU
TEST_ONLY_KV_BUFFER_DEVICE = "cpu"             # NixlConnector's KV buffers in host memory (no GPU)

# What an operator adds on GPUs (the page marks them; the tests never run them).
GPU_ENV = ("CUDA_VISIBLE_DEVICES",)
GPU_ARGS = ("--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.85")


def serve_args(model: str, *, served_name: str, host: str, port: int | str) -> list[str]:
    """``vllm serve`` with the flags every engine here runs with."""
    return ["serve", model, "--served-model-name", served_name, "--host", host, "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE)]


def nixl_config(role: str, *, buffer_device: str | None = None) -> str:
    """--kv-transfer-config for NixlConnector: role is kv_producer (P) or kv_consumer (D). The
    plugin derives the engine's PD role from it (kv_producer: prefill, kv_consumer: decode)."""
    config: dict = {"kv_connector": "NixlConnector", "kv_role": role}
    if buffer_device:
        config["kv_buffer_device"] = buffer_device
    config["kv_connector_extra_config"] = {"kv_lease_duration": KV_LEASE_S}
    return json.dumps(config)


def nixl_args(role: str, *, buffer_device: str | None = None) -> list[str]:
    return ["--kv-transfer-config", nixl_config(role, buffer_device=buffer_device)]


def nixl_env(host: str, port: int | str) -> dict[str, str]:
    """NIXL's side channel: P hands this address to D inside kv_transfer_params, so it must be
    one D reaches (not a wildcard), and one port per engine on a host."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def kv_events_config(endpoint: str) -> str:
    """--kv-events-config: vLLM publishes its prefix cache's block events on ZMQ; the plugin
    announces the endpoint (a wildcard host replaced by the engine's address)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                       "topic": KV_EVENTS_TOPIC})


def prefix_cache_args(events_endpoint: str) -> list[str]:
    """Prefix caching with block hashes the control plane can compute (its [kv_cache])."""
    return ["--enable-prefix-caching", "--kv-events-config", kv_events_config(events_endpoint),
            "--prefix-caching-hash-algo", HASH_ALGO]


def prefix_cache_env() -> dict[str, str]:
    return {"PYTHONHASHSEED": HASH_SEED}


def plugin_env(controlplanes: str, worker_id: str, *, labels: str | None = None) -> dict[str, str]:
    """The plugin's environment: it registers the engine with these control planes."""
    env = {"VLLM_PLUGINS": PLUGIN, "OMNI_CONTROLPLANE": controlplanes, "OMNI_WORKER_ID": worker_id}
    if labels:
        env["OMNI_LABELS"] = labels
    return env


def controlplane_toml(*, policy: str | None = "cache_aware", heartbeat_interval_s: float | None = None,
                      heartbeat_ttl_s: int | None = None, health_timeout_s: int | None = None,
                      unhealthy_after: int | None = None, kv_cache: bool = True,
                      block_size: int = BLOCK_SIZE) -> str:
    """The control plane's TOML: a prefix-cache policy needs [kv_cache] equal to the engines'."""
    lines = []
    if policy:
        lines.append(f'policy = "{policy}"')
    if heartbeat_interval_s is not None:
        lines.append(f"heartbeat_interval_s = {heartbeat_interval_s}")
    if heartbeat_ttl_s is not None:
        lines.append(f"heartbeat_ttl_s = {heartbeat_ttl_s}")
    if health_timeout_s is not None or unhealthy_after is not None:
        lines.append("[health]")
        if health_timeout_s is not None:
            lines.append(f"timeout_s = {health_timeout_s}")
        if unhealthy_after is not None:
            lines.append(f"unhealthy_after = {unhealthy_after}")
    if kv_cache:
        lines += ["[kv_cache]", f"block_size = {block_size}", f'hash_algo = "{HASH_ALGO}"',
                  f'hash_seed = "{HASH_SEED}"']
    return "\n".join(lines) + "\n"


def controlplane_argv(config: str, *, listen: str, http_port: int | str | None = None,
                      extra: tuple[str, ...] = ()) -> list[str]:
    argv = ["controlplane", "--config", config, "--listen", listen]
    if http_port is not None:
        argv += ["--http-port", str(http_port)]
    return argv + list(extra)


def dataplane_argv(*, port: int | str, controlplane: str, read_timeout: int | None = None,
                   placement_timeout: int | None = None) -> list[str]:
    argv = ["dataplane", "--port", str(port), "--controlplane", controlplane]
    if read_timeout is not None:
        argv += ["--read-timeout", str(read_timeout)]
    if placement_timeout is not None:
        argv += ["--placement-timeout", str(placement_timeout)]
    return argv


# ------------------------------------------------------------------------------------------------
# The page: an operator's two GPU engines on one host (P on GPU 0, D on GPU 1), the control plane
# and the data plane beside them.

@dataclass(frozen=True)
class Operator:
    model: str = "Qwen/Qwen2.5-1.5B-Instruct"
    served_name: str = "qwen"
    controlplane: str = "127.0.0.1:50051"
    dataplane_port: int = 8000
    host: str = "127.0.0.1"             # the address P, D, the planes use for each other
    engines: dict = field(default_factory=lambda: {
        # name: (kv_role, HTTP port, NIXL side-channel port, KV-events port, GPU)
        "prefill": ("kv_producer", 8100, 5600, 5557, "0"),
        "decode": ("kv_consumer", 8200, 5601, 5558, "1"),
    })


def engine_command(op: Operator, name: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv after ``vllm``) of one of the page's engines: what the tests run
    (serve_args + nixl_args + prefix_cache_args, plugin_env + nixl_env + prefix_cache_env),
    without the TEST_ONLY_* parts."""
    role, port, side, events, _ = op.engines[name]
    env = {**prefix_cache_env(), **plugin_env(op.controlplane, f"{name}-0"), **nixl_env(op.host, side)}
    argv = [*serve_args(op.model, served_name=op.served_name, host=op.host, port=port),
            *nixl_args(role), *prefix_cache_args(f"tcp://*:{events}")]
    return env, argv


def _shell(env: dict[str, str], program: str, argv: list[str], tail: str = "") -> str:
    """A readable shell command: the environment, then one flag (and its value) per line."""
    lines = [" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\"] if env else []
    words = [program]
    i = 0
    while i < len(argv) and not argv[i].startswith("--"):
        words.append(shlex.quote(argv[i]))
        i += 1
    lines.append(" ".join(words))
    while i < len(argv):
        group = [argv[i]]
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            group.append(argv[i])
            i += 1
        lines[-1] += " \\"
        lines.append("  " + " ".join(shlex.quote(w) for w in group))
    if tail:
        lines[-1] += " \\"
        lines.append("  " + tail)
    return "\n".join(lines)


def blocks(op: Operator = Operator()) -> dict[str, tuple[str, str]]:
    """name -> (code-block language, text) of docs/real-engines.md."""
    out: dict[str, tuple[str, str]] = {}
    out["controlplane.toml"] = ("toml", controlplane_toml())
    out["controlplane"] = ("bash", _shell({}, "omni-proxy",
                                          controlplane_argv("controlplane.toml", listen=op.controlplane)))
    gpu = " ".join(shlex.quote(a) for a in GPU_ARGS)
    for name in op.engines:
        env, argv = engine_command(op, name)
        gpu_env = f"export {GPU_ENV[0]}={op.engines[name][4]}        # GPU: yours (not in the tests)\n"
        out[name] = ("bash", gpu_env + _shell(env, "vllm", argv, f"{gpu}        # GPU flags: yours (not in the tests)"))
    out["dataplane"] = ("bash", _shell({}, "omni-proxy", dataplane_argv(port=op.dataplane_port,
                                                                       controlplane=op.controlplane)))
    out["test-only"] = ("text", "\n".join([
        "vllm serve ... " + " ".join(TEST_ONLY_ARGS) + "           # no torch.compile: a CPU engine starts 2-3x faster",
        "--kv-transfer-config: \"kv_buffer_device\": \"" + TEST_ONLY_KV_BUFFER_DEVICE
        + "\"   # NIXL buffers in host memory (no GPU)",
        "--port 0 (the bound port read back), --host 127.0.0.1, a free NIXL side-channel port per run",
        "VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU  # vLLM's CPU build",
        "test_vllm_plugin.py: --num-gpu-blocks-override 160; no NIXL (one aggregated engine)",
        "test_vllm_pd_nixl.py: no plugin and no KV events (P and D listed with --prefill/--decode)",
    ]))
    return out


MARKER = re.compile(r"<!-- recipe: (?P<name>[\w.-]+) -->\n```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def render(page: str, op: Operator = Operator()) -> str:
    """``page`` with every recipe block replaced by what this module renders now."""
    wanted = blocks(op)

    def sub(m: re.Match) -> str:
        lang, text = wanted[m["name"]]
        return f"<!-- recipe: {m['name']} -->\n```{lang}\n{text.rstrip()}\n```"
    return MARKER.sub(sub, page)


def main(argv: list[str]) -> int:
    for path in map(Path, argv or ["docs/real-engines.md"]):
        path.write_text(render(path.read_text()))
        print(f"rewrote the recipe blocks of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
