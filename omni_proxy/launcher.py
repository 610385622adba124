"""Start omni-proxy servers as real child processes and wait until they are ready.

Used by ``omni-proxy demo``, ``omni-proxy up`` and the test-suite, so all three run the
system the same way an operator does: separate processes talking over loopback.

**Children never outlive their launcher.** Each child runs in its own session (its own
process group), and stopping it signals the whole group, so anything it started goes
too. A child also holds the read end of a *lifeline* pipe whose only write end stays in
the launcher process: when the launcher dies in any way, SIGKILL included, the kernel
closes that end, the child reads EOF and terminates its process group (SIGTERM, then
SIGKILL after a grace period). This works from any thread. On Linux a child started from
the main thread also sets ``PR_SET_PDEATHSIG`` (SIGTERM), which the kernel delivers even
when the child's Python code is stuck. Not from other threads: PDEATHSIG fires when the
*thread* that forked the child exits, and children are started from worker threads
(``asyncio.to_thread``, thread pools in the benchmarks), so it would kill healthy servers
as soon as that thread ended. A program that is not omni-proxy (a peer router, an engine)
gets the same through :func:`guarded`, a guardian that holds the lifeline for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path

LIFELINE_ENV = "OMNI_PROXY_LIFELINE_FD"
PDEATHSIG_ENV = "OMNI_PROXY_PDEATHSIG_PPID"   # set when the parent thread is the main thread
# After the launcher dies: how long the child's process group gets to exit on SIGTERM.
LIFELINE_GRACE_S = 5.0


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


# ---- the lifeline -----------------------------------------------------------------------

_lifeline_lock = threading.Lock()
_lifeline: tuple[int, int, int] | None = None   # (pid that made it, read fd, write fd)


def lifeline_fd() -> int:
    """The read end of this process's lifeline pipe, for ``pass_fds`` of a child.

    Both ends are non-inheritable: only children that are handed the read end get it, and
    the write end lives in this process alone, so it closes exactly when this process dies.
    """
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None or _lifeline[0] != os.getpid():   # a forked copy makes its own
            r, w = os.pipe()
            _lifeline = (os.getpid(), r, w)
        return _lifeline[1]


def lifeline_env(fd: int) -> dict[str, str]:
    """Environment that tells a child (run through :func:`child_main`) which fd to watch and,
    when this is the main thread, to set PDEATHSIG (with this pid, to detect a parent that
    died before the child could set it)."""
    env = {LIFELINE_ENV: str(fd)}
    if threading.current_thread() is threading.main_thread():
        env[PDEATHSIG_ENV] = str(os.getpid())
    return env


def set_pdeathsig(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` in this process (Linux); end now when ``parent_pid`` is
    already gone (it died before the call). False where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:   # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def _terminate_own_group(grace: float) -> None:
    """SIGTERM this process's group (this process alone when it leads none), then SIGKILL."""
    leader = os.getpgrp() == os.getpid()
    try:
        if leader:
            os.killpg(0, signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
    time.sleep(grace)
    try:
        if leader:
            os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(1)


def watch_lifeline(fd: int, *, grace: float = LIFELINE_GRACE_S) -> threading.Thread:
    """Start a daemon thread that ends this process (and its group) when ``fd`` reads EOF."""

    def watch() -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return        # not a pipe we can watch: do nothing rather than kill ourselves
            if not data:
                break
        _terminate_own_group(grace)

    thread = threading.Thread(target=watch, name="omni-lifeline", daemon=True)
    thread.start()
    return thread


def child_main(argv: list[str] | None = None) -> None:
    """Entry point of a launched child: watch the lifeline, then run ``omni-proxy ARGV``."""
    ppid = os.environ.pop(PDEATHSIG_ENV, None)
    if ppid is not None:
        try:
            set_pdeathsig(int(ppid))
        except ValueError:
            pass
    fd = os.environ.pop(LIFELINE_ENV, None)
    if fd is not None:
        try:
            fd_num = int(fd)
            os.set_inheritable(fd_num, False)   # grandchildren must not hold it
            watch_lifeline(fd_num)
        except (ValueError, OSError):
            pass
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [GUARD_FLAG]:
        _guard(args[2:] if args[1:2] == ["--"] else args[1:])
    from omni_proxy.cli import main

    main(args)


GUARD_FLAG = "--guard"


def guarded(cmd: list[str]) -> list[str]:
    """``cmd`` (any program: a peer router, an engine) behind a guardian that ends it when
    the launcher dies. Start the result with :func:`spawn`; stop it by signalling its process
    group (:class:`ProcessGroup` does), which reaches the program directly."""
    return [sys.executable, "-m", "omni_proxy.launcher", GUARD_FLAG, "--", *cmd]


def _guard(cmd: list[str]) -> None:
    """Run ``cmd`` in this process group and exit with its status. The lifeline watch (set
    up by :func:`child_main`) terminates the whole group, ``cmd`` included, when the launcher
    dies. SIGTERM/SIGINT sent to the group reach ``cmd`` directly; the guardian only waits."""
    if not cmd:
        raise SystemExit("omni_proxy.launcher --guard: no command")
    # A handler, not SIG_IGN: an ignored signal would stay ignored in ``cmd`` across exec,
    # a caught one is reset to its default there.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    proc = subprocess.Popen(cmd)
    rc = proc.wait()
    raise SystemExit(rc if rc >= 0 else 128 - rc)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's process group (it leads one: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        # the group is empty; a child still unreaped is signalled directly
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass


def spawn(cmd: list[str], *, log_path: Path, env: dict | None = None, **popen_kw) -> subprocess.Popen:
    """Popen ``cmd`` in its own session, logging to ``log_path``, holding this process's
    lifeline (only children run through :func:`child_main` watch it)."""
    fd = lifeline_fd()
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**(env if env is not None else os.environ), **lifeline_env(fd)},
                                start_new_session=True, pass_fds=(fd,), **popen_kw)


def port_in(ready_file: Path) -> Callable[[], int]:
    """A ``ready`` for :meth:`ProcessGroup.start_program`: the port a program wrote to its
    ready file as ``{"port": N}`` (0 until it has)."""
    def ready() -> int:
        try:
            return int(json.loads(ready_file.read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0
    return ready


class ProcessGroup:
    """Owns a set of child servers and a scratch directory; stops them all on close."""

    def __init__(self, workdir: str | None = None, *, ready_timeout: float = 90.0) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not workdir:
            self._tmp = tempfile.TemporaryDirectory(prefix="omni-proxy-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.ready_timeout = ready_timeout
        self.children: list[Child] = []

    def start(self, name: str, subcommand: list[str], *, env: dict | None = None) -> Child:
        """Run ``omni-proxy <subcommand> --ready-file F`` in a child and wait for F.

        The child is ``python -m omni_proxy.launcher``: ``omni-proxy`` plus the lifeline
        watch (see the module docstring)."""
        ready = self.workdir / f"{name}.ready"
        log_path = self.workdir / f"{name}.log"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "omni_proxy.launcher", *subcommand, "--ready-file", str(ready)]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = spawn(cmd, log_path=log_path, env=child_env)
        deadline = time.monotonic() + self.ready_timeout
        while not ready.exists():
            if proc.poll() is not None:
                _signal_group(proc, signal.SIGKILL)
                tail = log_path.read_text(errors="replace")[-3000:]
                raise LaunchError(f"{name} exited with {proc.returncode} before ready:\n{tail}")
            if time.monotonic() > deadline:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                tail = log_path.read_text(errors="replace")[-3000:]
                raise LaunchError(f"{name} not ready after {self.ready_timeout}s:\n{tail}")
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        child = Child(name=name, proc=proc, port=int(info["port"]), log_path=log_path, info=info)
        self.children.append(child)
        return child

    def start_program(self, name: str, cmd: list[str], ready: Callable[[], int | None], *,
                      env: dict | None = None, timeout: float = 60.0, poll_s: float = 0.05) -> Child:
        """Run any program ``cmd`` (a peer router, a mock engine) behind the guardian, so it
        dies with us, and wait until ``ready()`` returns its port (falsy: not yet)."""
        log_path = self.workdir / f"{name}.log"
        proc = spawn(guarded(cmd), log_path=log_path, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        child = Child(name=name, proc=proc, port=0, log_path=log_path, info={"cmd": cmd})
        self.children.append(child)   # stopped with the group, ready or not
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise LaunchError(f"{name} exited with {proc.returncode}:\n{child.log_tail(30)}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{name} not ready after {timeout}s:\n{child.log_tail(30)}")
            port = ready()
            if port:
                child.port = port
                return child
            time.sleep(poll_s)

    def stop(self, child: Child, *, timeout: float = 10.0) -> int | None:
        """SIGTERM the child's process group, then SIGKILL after ``timeout``; returns the
        child's exit code."""
        self._stop_all([child], timeout)
        return child.proc.returncode

    def kill(self, child: Child) -> None:
        """Kill abruptly (the whole process group), like a crashed engine."""
        _signal_group(child.proc, signal.SIGKILL)
        child.proc.wait()
        if child in self.children:
            self.children.remove(child)

    def _stop_all(self, children: list[Child], timeout: float) -> None:
        """SIGTERM every group at once, wait up to ``timeout`` in all, then SIGKILL the rest
        (and whatever is left of each group, even when its leader exited)."""
        for child in children:
            if child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in children:
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()
            if child in self.children:
                self.children.remove(child)

    def close(self) -> None:
        try:
            self._stop_all(list(reversed(self.children)), 10.0)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    child_main()
