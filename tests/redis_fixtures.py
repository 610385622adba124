"""A real redis-server for tests, on a unix socket in a temporary directory (no port races).

``scripts/install_services.sh`` (sourced by ``scripts/test.sh``) installs redis-server
from the OS packages when it is missing. tests/conftest.py registers this module as a plugin
(``pytest_plugins``), so a test asks for the ``redis_server``/``redis_persistent`` fixtures by
name, without importing them (an imported fixture shadowed by the parameter is a lint finding).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from omni_proxy.launcher import guarded, spawn
from tests.ports import reserved_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """One redis-server process; ``stop``/``start`` again to simulate an outage, ``pause``
    and ``resume`` for a hung one.

    Listens only on ``<dir>/redis.sock`` (``--port 0`` turns TCP off), or on 127.0.0.1 with
    ``tcp=True`` (a port from tests.ports.reserved_port, retried if another process takes it first).
    With ``appendonly`` it persists every write (``appendfsync always``) in its directory,
    so a restart keeps the data; without it a restart starts empty.
    """

    def __init__(self, *, appendonly: bool = False, tcp: bool = False) -> None:
        # unix socket paths are limited to ~107 bytes: a short directory under /tmp
        self.dir = Path(tempfile.mkdtemp(prefix="omni-redis-", dir="/tmp"))
        self.sock = self.dir / "redis.sock"
        self.appendonly = appendonly
        self.tcp = tcp
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0" if self.tcp else f"unix://{self.sock}"

    def _args(self) -> list[str]:
        args = [REDIS_SERVER, "--dir", str(self.dir), "--save", "", "--daemonize", "no",
                "--logfile", str(self.log), "--protected-mode", "no",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always"]
        if self.tcp:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        else:
            args += ["--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700"]
        return args

    def start(self, timeout: float = 15.0) -> RedisServer:
        if not os.path.exists(REDIS_SERVER):
            pytest.fail("redis-server is not installed: run scripts/install_services.sh (scripts/test.sh does)")
        for _attempt in range(5):
            if self.tcp and not self.port:
                self.port = reserved_port()   # redis-server has no port 0; restarted below if it lost the race
            # Behind the launcher's guardian: it dies with the test run even when pytest is
            # killed (a plain Popen outlived a run stopped by `timeout`).
            self.proc = spawn(guarded(self._args()), log_path=self.dir / "guard.log")
            if self._wait_ready(timeout):
                return self
            self.stop()
            if not self.tcp:
                break
            self.port = 0   # the port was taken meanwhile: another one
        tail = self.log.read_text()[-2000:] if self.log.exists() else ""
        raise RuntimeError(f"redis-server did not answer PING within {timeout}s:\n{tail}")

    def _wait_ready(self, timeout: float) -> bool:
        """Poll with PING until it answers PONG (or the process exits)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.ping():
                return True
            time.sleep(0.01)
        return False

    def ping(self) -> bool:
        try:
            if self.tcp:
                conn = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            else:
                conn = socket.socket(socket.AF_UNIX)
                conn.settimeout(1)
                conn.connect(str(self.sock))
            with conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)   # redis flushes its AOF on SIGTERM
            except ProcessLookupError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: a hung Redis (connections accepted and kept, nothing answered)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause`` (call it in a ``finally``)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        try:
            self.resume()   # a stopped process would not take SIGTERM
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_server():
    """One redis-server per test module; tests keep apart by key prefix."""
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def redis_persistent():
    """A redis-server of its own, persisting every write (for restart tests)."""
    server = RedisServer(appendonly=True)
    try:
        yield server.start()
    finally:
        server.close()


@contextlib.asynccontextmanager
async def redis_replicas(redis_url: str, key_prefix: str, count: int = 2, **config):
    """``count`` in-process control planes sharing one Redis state (``key_prefix`` keeps the
    test's keys apart), on any free ports; stopped on the way out, even when one failed to
    start."""
    from controlplane.config import ControlPlaneConfig, StateConfig
    from controlplane.server import ControlPlane

    planes = []
    try:
        for _ in range(count):
            cp = ControlPlane(ControlPlaneConfig(
                listen="127.0.0.1:0", http_port=0,
                state=StateConfig(backend="redis", redis_url=redis_url, key_prefix=key_prefix), **config))
            await cp.start()
            planes.append(cp)
        yield planes
    finally:
        for cp in planes:
            await cp.stop()
