"""Ports for tests: the one helper, and when to use it.

Prefer port 0: start the server on port 0 and read back the port it bound (the launcher's
ready file gives ``Child.port``; an aiohttp ``AppRunner`` has ``addresses``). There is no race
then.

Only where a port must be known before its server binds it (a client configured before
the server starts, a server restarted on the same address, a ZMQ endpoint the control
plane is told, ``P`` and ``P + 1`` for two ranks, a redis-server, which has no port 0) use
:func:`reserved_port`. Choosing a port and releasing it is a race; it is kept small here:

* the port comes from outside the kernel's ephemeral range, so it cannot become the source
  port of some outgoing connection meanwhile (what a port-0 port can): only a process that
  binds that very number can take it;
* no port is handed out twice in one test run.

A server that can be restarted on a fresh port when it lost the race should be
(``redis_fixtures.RedisServer.start``, ``vllm_harness.vllm_server.wait_healthy`` do).

For an address where nothing must answer, use :func:`refused_port`: a socket bound and
never listening holds the port, so a connection there is refused and nobody else takes it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports chosen by bind(0) and outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserved_port(count: int = 1) -> int:
    """A port ``P`` (with ``P .. P + count - 1``) free on 127.0.0.1 now, outside the ephemeral
    range and not handed out before in this run. Still a bind-and-release (see the module's
    note): use port 0 wherever the server can report what it bound."""
    low, high = ephemeral_range()
    pool = range(20000, low - count) if low - 20000 >= 1000 else range(high + 1, 65536 - count)
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.choice(pool)
        ports = range(port, port + count)
        if any(p in _handed_out for p in ports) or not all(_free(p) for p in ports):
            continue
        _handed_out.update(ports)
        return port
    raise RuntimeError(f"no {count} free consecutive port(s) in {pool}")


@contextmanager
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
