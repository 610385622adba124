"""omni_proxy.launcher: children never outlive the process that launched them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from omni_proxy.launcher import Child, ProcessGroup, guarded, spawn

ROOT = Path(__file__).resolve().parent.parent


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive after {timeout}s"
        time.sleep(0.05)


def wait_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, f"helper exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"{path} not written after {timeout}s"
        time.sleep(0.05)
    return path.read_text().strip()


HELPER = textwrap.dedent("""
    import sys, threading, time
    from omni_proxy.launcher import ProcessGroup

    group = ProcessGroup()
    box = {}
    start = lambda: box.update(child=group.start("sim", ["sim", "--port", "0"]))
    if sys.argv[2] == "thread":
        # a worker thread that then ends: PR_SET_PDEATHSIG would kill the child when that
        # thread exits; the child must live on until the process dies
        t = threading.Thread(target=start)
        t.start(); t.join()
    else:
        start()
    open(sys.argv[1] + ".tmp", "w").write(str(box["child"].proc.pid))
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipes and process groups as on Linux")
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_children_die_when_the_launcher_is_sigkilled(tmp_path, started_from):
    pid_file = tmp_path / "child.pid"
    helper = subprocess.Popen([sys.executable, "-c", HELPER, str(pid_file), started_from], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    child_pid = None
    try:
        child_pid = int(wait_file(pid_file, helper))
        # the child outlives the thread that started it
        time.sleep(0.5)
        assert alive(child_pid), "the child died with the thread that started it"
        helper.send_signal(signal.SIGKILL)
        helper.wait()
        wait_gone(child_pid, timeout=30)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        if child_pid and alive(child_pid):
            os.killpg(child_pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups as on Linux")
@pytest.mark.parametrize("how", ["stop", "kill", "close"])
def test_stopping_a_child_takes_its_own_children_down(tmp_path, how):
    """A child that started processes of its own: stop, kill and close end them all."""
    grandchild_file = tmp_path / "grandchild.pid"
    script = textwrap.dedent(f"""
        import subprocess, sys, time, os
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(grandchild_file)!r} + ".tmp", "w").write(str(p.pid))
        os.replace({str(grandchild_file)!r} + ".tmp", {str(grandchild_file)!r})
        time.sleep(600)
    """)
    group = ProcessGroup()
    try:
        proc = spawn([sys.executable, "-c", script], log_path=group.workdir / "c.log")
        child = Child(name="c", proc=proc, port=0, log_path=group.workdir / "c.log")
        group.children.append(child)
        grandchild = int(wait_file(grandchild_file, proc))
        if how == "stop":
            group.stop(child, timeout=5)
        elif how == "kill":
            group.kill(child)
        else:
            group.close()
        assert proc.poll() is not None
        assert group.children == []
        wait_gone(grandchild, timeout=10)
    finally:
        group.close()


def test_close_stops_every_child_and_is_idempotent():
    group = ProcessGroup()
    try:
        a = group.start("a", ["sim", "--port", "0"])
        b = group.start("b", ["sim", "--port", "0"])
    except BaseException:
        group.close()
        raise
    group.close()
    assert a.proc.returncode is not None and b.proc.returncode is not None
    assert not alive(a.proc.pid) and not alive(b.proc.pid)
    group.close()


GUARDED_HELPER = textwrap.dedent("""
    import sys, time
    from omni_proxy.launcher import Child, ProcessGroup, guarded, spawn

    group = ProcessGroup()
    program = [sys.executable, "-c", "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
               "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)", sys.argv[1]]
    spawn(guarded(program), log_path=group.workdir / "p.log")
    time.sleep(600)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipes and process groups as on Linux")
def test_a_guarded_foreign_program_dies_with_the_launcher(tmp_path):
    """Programs that are not omni-proxy (peer routers, engines) run behind a guardian."""
    pid_file = tmp_path / "program.pid"
    helper = subprocess.Popen([sys.executable, "-c", GUARDED_HELPER, str(pid_file)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    program = None
    try:
        program = int(wait_file(pid_file, helper))
        helper.kill()
        helper.wait()
        wait_gone(program, timeout=30)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        if program and alive(program):
            os.kill(program, signal.SIGKILL)


def test_a_guarded_program_stops_with_its_group_and_keeps_its_exit_status(tmp_path):
    group = ProcessGroup()
    try:
        ok = spawn(guarded([sys.executable, "-c", "raise SystemExit(3)"]), log_path=tmp_path / "ok.log")
        assert ok.wait(30) == 3
        ready = tmp_path / "started"
        slow = spawn(guarded([sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').write('1'); "
                              "time.sleep(600)", str(ready)]), log_path=tmp_path / "s.log")
        child = Child(name="slow", proc=slow, port=0, log_path=tmp_path / "s.log")
        group.children.append(child)
        wait_file(ready, slow)     # the program runs behind its guardian
        started = time.monotonic()
        group.stop(child, timeout=10)
        # SIGTERM reached the program itself (no SIGKILL after the timeout was needed)
        assert time.monotonic() - started < 5 and slow.returncode == 128 + signal.SIGTERM
    finally:
        group.close()
