"""argparse types for the flags every omni-proxy command shares: ports, durations, counts,
addresses and log levels, checked when the command line is parsed.

A bad value stops the command before it starts anything, with argparse's one line naming the
flag (``omni-proxy dataplane: error: argument --port: a port from 0 to 65535, got '70000'``)
instead of a port taken modulo 65536, a traceback, or a setting that fails under traffic.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)$")


def _fail(what: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{what}, got {text!r}")


def port(text: str) -> int:
    """A TCP port to listen on: 0 (any free port) to 65535."""
    try:
        value = int(text, 10)
    except (TypeError, ValueError):
        raise _fail("a port from 0 to 65535 (0: any free port)", text) from None
    if not 0 <= value <= 65535:
        raise _fail("a port from 0 to 65535 (0: any free port)", text)
    return value


def seconds(text: str, *, allow_zero: bool = False, what: str = "") -> float:
    """A finite number of seconds, > 0 (or >= 0 where 0 means "no limit")."""
    allowed = what or ("seconds, a number >= 0 (0: no limit)" if allow_zero else "seconds, a number > 0")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise _fail(allowed, text) from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise _fail(allowed, text)
    return value


def seconds_or_zero(text: str) -> float:
    return seconds(text, allow_zero=True)


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An integer from ``lo`` to ``hi``."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise _fail(f"an integer from {lo} to {hi}", text) from None
        if not lo <= value <= hi:
            raise _fail(f"an integer from {lo} to {hi}", text)
        return value

    parse.__name__ = f"integer {lo}-{hi}"
    return parse


def number(lo: float, hi: float) -> Callable[[str], float]:
    """A finite number from ``lo`` to ``hi``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise _fail(f"a number from {lo:g} to {hi:g}", text) from None
        if not math.isfinite(value) or not lo <= value <= hi:
            raise _fail(f"a number from {lo:g} to {hi:g}", text)
        return value

    return parse


def host(text: str) -> str:
    """A host name or IP address to bind (no scheme, port or spaces; IPv6 as is or in brackets)."""
    h = text.strip()
    if ":" in h and not h.startswith("["):
        h = f"[{h}]"      # a bare IPv6 address
    if not _HOST.match(h):
        raise _fail("a host name or IP address (no scheme, port or spaces)", text)
    return text.strip()


def target(text: str) -> str:
    """A gRPC ``host:port`` to connect to (port 1-65535; IPv6 in brackets)."""
    t = text.strip()
    h, sep, p = t.rpartition(":")
    if not sep or not h or not p.isdigit() or not 1 <= int(p) <= 65535 or not _HOST.match(h):
        raise _fail("host:port with a port from 1 to 65535 (IPv6 in brackets: [::1]:50051)", text)
    return t


def targets(text: str) -> str:
    """One or more gRPC ``host:port`` addresses, comma-separated (control-plane replicas)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise _fail("host:port, or several comma-separated", text)
    for item in items:
        target(item)
    return ",".join(items)


def log_level(text: str) -> str:
    """One of Python's level names (any case)."""
    value = text.strip().upper()
    if value not in LOG_LEVELS:
        raise _fail(f"one of {', '.join(LOG_LEVELS)}", text)
    return value
