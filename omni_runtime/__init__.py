"""Process plumbing shared by every omni-proxy server: event loop, ready files, signals.

Every server (control plane, data plane, engine simulator) can bind port 0 and then
announce the port it really got through a *ready file*. Launchers (the demo, the
tests, ``omni-proxy up``) wait for that file instead of guessing ports or sleeping.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # imported where used: omni_runtime.flags is read at every command's start
    from aiohttp import web


class StartupError(Exception):
    """A server could not start: a port in use, an address it cannot bind, a bad setting.

    :func:`run_main` reports it as one line on stderr and exit status 1: an operator needs the
    setting to change, not a traceback.
    """


def bind_error(exc: OSError, setting: str, host: str, port: int | str) -> StartupError:
    """One line for a failed bind, naming the setting (key or flag) that chose the address."""
    if exc.errno == errno.EADDRINUSE:
        why = "the port is already in use"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "the address is not one of this machine's"
    elif exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges)"
    else:
        why = exc.strerror or str(exc)
    return StartupError(f"{setting}: cannot listen on {host}:{port}: {why}")


def install_fast_loop() -> None:
    """Use uvloop when it is installed: it cuts per-request loop overhead noticeably."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return
    uvloop.install()


def settle_heap() -> None:
    """Once a process has started: collect, then move every object alive now (modules, classes,
    config, a tokenizer's tables, the fleet) out of the garbage collector's sight (``gc.freeze``).

    Why: a full collection walks every tracked object and holds the GIL while it does: ~50,000
    in a started control plane took 11-25 ms of its event loop on the project's 2-core machine,
    every few seconds under KV-event load, and ~33,000 in a started data plane 6 ms (20 ms CPU
    for one full collection in a tokenizing thread during a burst of long prompts,
    ``bench/burst.py``): a stall for every request behind it. What start-up built lives as long
    as the process, so scanning it finds nothing; objects made later are collected as before.
    """
    import gc

    gc.collect()
    gc.freeze()


def write_ready_file(path: str | None, **info: Any) -> None:
    """Atomically write ``info`` as JSON, so a reader never sees half a file."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    tmp.replace(target)


async def wait_for_stop_signal() -> None:
    """Return when SIGINT or SIGTERM arrives, so servers can shut down in order."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def start_http_site(
    app: web.Application, host: str, port: int, *, handler_cancellation: bool = True, reuse_port: bool = False
) -> tuple[web.AppRunner, int]:
    """Start ``app`` on host:port and return the runner and the bound port.

    ``handler_cancellation`` makes aiohttp cancel a handler when its client goes away,
    which is how a disconnect reaches the upstream legs and frees their load.
    ``reuse_port`` (SO_REUSEPORT) lets several processes listen on one port, the kernel
    spreading new connections over them.
    """
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    try:
        await site.start()
    except BaseException:
        # run the app's cleanup hooks (client sessions...) so a failed bind leaves nothing behind
        await runner.cleanup()
        raise
    # aiohttp exposes no public accessor for the bound socket (its asyncio.Server has them)
    sockets = getattr(site._server, "sockets", None)
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound


def run_main(main: Callable[[], Coroutine[Any, Any, None]], name: str = "omni-proxy") -> None:
    """Run an async entry point on the fast loop; Ctrl-C ends it quietly, and a
    :class:`StartupError` ends it with one line ``name: why`` on stderr and exit status 1."""
    install_fast_loop()
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except StartupError as exc:
        import logging

        for handler in logging.getLogger().handlers:   # log lines held in a batch go first:
            getattr(handler, "flush_now", handler.flush)()   # the error is the last line
        raise SystemExit(f"{name}: {exc}") from None


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> asyncio.Task:
    """End this process (SIGTERM to itself) once ``parent_pid`` is gone: helper processes
    of a server must not outlive it, even when it was killed without cleaning up."""
    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    return asyncio.get_running_loop().create_task(watch())


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has really stopped."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
