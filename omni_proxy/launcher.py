"""Start omni-proxy servers as real child processes and wait until they are ready.

Used by ``omni-proxy demo``, ``omni-proxy up`` and the test-suite, so all three run the
system the same way an operator does: separate processes talking over loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class LaunchError(RuntimeError):
    """A child process died or never became ready."""


@dataclass
class Child:
    """One running server: its process, bound port and log file."""

    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    info: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ProcessGroup:
    """Owns a set of child servers and a scratch directory; stops them all on close."""

    def __init__(self, workdir: str | None = None, *, ready_timeout: float = 90.0) -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="omni-proxy-")
        self.workdir = Path(workdir or self._tmp.name)
        self.ready_timeout = ready_timeout
        self.children: list[Child] = []

    def start(self, name: str, subcommand: list[str], *, env: dict | None = None) -> Child:
        """Run ``python -m omni_proxy <subcommand> --ready-file F`` and wait for F."""
        ready = self.workdir / f"{name}.ready"
        log_path = self.workdir / f"{name}.log"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "omni_proxy", *subcommand, "--ready-file", str(ready)]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        log = open(log_path, "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.ready_timeout
        while not ready.exists():
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise LaunchError(f"{name} exited with {proc.returncode} before ready:\n{tail}")
            if time.monotonic() > deadline:
                proc.kill()
                raise LaunchError(f"{name} not ready after {self.ready_timeout}s")
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        child = Child(name=name, proc=proc, port=int(info["port"]), log_path=log_path, info=info)
        self.children.append(child)
        return child

    def stop(self, child: Child, *, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if child in self.children:
            self.children.remove(child)
        return child.proc.returncode

    def kill(self, child: Child) -> None:
        """Kill abruptly, like a crashed engine."""
        child.proc.kill()
        child.proc.wait()
        if child in self.children:
            self.children.remove(child)

    def close(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
