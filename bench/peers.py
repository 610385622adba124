"""The public routers the SLO benchmark compares against: vllm-router and smg (PyPI).

They are installed with pip, once, into their own virtualenv under
``${OMNI_PROXY_CACHE:-~/.cache/omni-proxy}/bench-peers`` (never by the test suite or CI),
and started as child processes of a ``ProcessGroup`` so they stop with the run. Every
address they bind is 127.0.0.1 (smg binds 0.0.0.0 unless told otherwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from omni_proxy.launcher import Child, LaunchError, ProcessGroup

PEER_PACKAGES = {"vllm-router": "vllm-router==0.1.17", "smg": "smg==1.13.0"}
PEER_POLICIES = ("cache_aware", "round_robin")
# Peers that take only string prompts (smg 1.13 refuses token ids): benchmarks send them the
# same prompts as text (bench/slo_replay.py ``as_text``).
TEXT_ONLY = frozenset({"smg"})


def cache_dir() -> Path:
    return Path(os.environ.get("OMNI_PROXY_CACHE") or Path.home() / ".cache" / "omni-proxy") / "bench-peers"


def venv_bin() -> Path:
    return cache_dir() / "venv" / "bin"


def ensure_installed(peers: list[str], log=print) -> dict[str, str]:
    """Install the named peers into the cached venv (pip only); returns peer -> error for
    those that could not be installed."""
    errors: dict[str, str] = {}
    venv = cache_dir() / "venv"
    if not (venv / "bin" / "python").exists():
        log(f"creating peer venv {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for peer in peers:
        if (venv / "bin" / peer).exists() and _installed_version(peer) == PEER_PACKAGES[peer].split("==")[1]:
            continue
        log(f"pip install {PEER_PACKAGES[peer]} into {venv}")
        res = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PEER_PACKAGES[peer]],
                             capture_output=True, text=True)
        if res.returncode != 0 or not (venv / "bin" / peer).exists():
            errors[peer] = f"pip install failed: {(res.stderr or res.stdout)[-500:]}"
    return errors


def _installed_version(peer: str) -> str | None:
    res = subprocess.run([str(venv_bin() / "python"), "-m", "pip", "show", peer], capture_output=True, text=True)
    for line in res.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


@dataclass
class Engines:
    """The engines a router fronts: URLs by role, plus each prefill's bootstrap port."""

    both: list[str]
    prefill: list[str]
    decode: list[str]
    bootstrap_ports: dict[str, int]


def peer_command(peer: str, policy: str, mode: str, engines: Engines, port: int, prom_port: int) -> list[str]:
    """The command line that starts ``peer`` with ``policy`` in ``mode`` (agg | pd)."""
    exe = str(venv_bin() / peer)
    if peer == "vllm-router":
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
               "--worker-startup-check-interval", "1", "--log-level", "warning"]
        if mode == "agg":
            cmd += ["--worker-urls", *engines.both]
        else:
            # vLLM PD: P gets max_tokens=1 + kv_transfer_params(do_remote_decode), D gets P's
            # kv_transfer_params (NixlConnector, pull), the protocol our simulators speak.
            cmd += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
            for url in engines.prefill:
                cmd += ["--prefill", url]
            for url in engines.decode:
                cmd += ["--decode", url]
        return cmd
    if peer == "smg":
        cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
               "--disable-tokenizer-autoload", "--worker-startup-check-interval", "1",
               "--log-level", "warn"]
        if mode == "agg":
            cmd += ["--worker-urls", *engines.both]
        else:
            # SGLang PD: P and D get the request at once with bootstrap_host/port/room.
            cmd += ["--pd-disaggregation"]
            for url in engines.prefill:
                cmd += ["--prefill", url, str(engines.bootstrap_ports[url])]
            for url in engines.decode:
                cmd += ["--decode", url]
        return cmd
    raise ValueError(f"unknown peer {peer!r}")


def start_peer(group: ProcessGroup, peer: str, policy: str, mode: str, engines: Engines,
               port: int, prom_port: int, timeout: float = 60.0) -> Child:
    """Start the router as a child of ``group`` and wait until it answers and sees its
    workers. Raises LaunchError with the log tail when it does not."""
    cmd = peer_command(peer, policy, mode, engines, port, prom_port)
    url = f"http://127.0.0.1:{port}"
    child = group.start_program(f"{peer}-{policy}-{mode}", cmd, lambda: port if _ready(url) else 0,
                                env={"RUST_LOG": os.environ.get("RUST_LOG", "warn")}, timeout=timeout, poll_s=0.2)
    problem = probe(child.url, "t1 t2 t3" if peer in TEXT_ONLY else [1, 2, 3])
    if problem:
        raise LaunchError(f"{child.name} cannot serve the benchmark's requests: {problem}")
    return child


def probe(url: str, prompt: str | list[int] = [1, 2, 3]) -> str | None:   # noqa: B006 - never mutated
    """One tiny streaming completion, the request shape the benchmark sends (token ids, or
    text for :data:`TEXT_ONLY` peers); the error text if the router refuses it."""
    import json
    body = json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 1, "stream": True,
                       "user": "probe"}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "X-Request-Id": "probe"})
    for _ in range(20):   # bounded: workers may need a moment to be marked healthy
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                return None
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")[:300]
            # smg answers 404 "No worker available for model" until it has read its workers'
            # model: not yet ready, not a refusal of the request's shape
            if exc.code < 500 and not (exc.code == 404 and "No worker available" in text):
                return f"HTTP {exc.code}: {text}"
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return "no successful answer to a probe request"


def _ready(url: str) -> bool:
    for path in ("/readiness", "/health", "/v1/models"):
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            continue
    return False
