"""Checks for values that enter the control plane from outside: config, flags, admin and registration RPCs.

Why one module: a value that is wrong should be refused where it enters, with a message that
names the field and says what is allowed, not fail later under traffic (a NaN weight silently
leaving rotation, ``interval_s = -1`` polling in a busy loop, a bad ZMQ endpoint dying in a task
nobody awaits). Config loading turns the :class:`ValueError` into one line at start-up; the gRPC
services turn it into ``INVALID_ARGUMENT``. The functions are pure and return the normalized value.

Messages never echo more than a short prefix of the offending value (a 100 KB worker id must not
end up in a log line or in gRPC error metadata).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

MAX_WEIGHT = 1e6
MAX_URL_LEN = 2048
MAX_WORKER_ID_LEN = 128
MAX_PORT = 65535
DEFAULT_MAX_SECONDS = 365 * 24 * 3600.0
# Python refuses any PYTHONHASHSEED outside "random" or [0, 4294967295] at interpreter start.
MAX_HASH_SEED = 4294967295

_WORKER_ID = re.compile(r"[A-Za-z0-9._:@/-]+")
_DIGITS = re.compile(r"[0-9]+")


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters so a huge input cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(field: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"{field} must be {allowed}, got {show(value)}")


def _is_number(value: Any) -> bool:
    # bool is an int subclass: `weight = true` is a typo, not 1.0
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any, field: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite real in [lo, hi] (or (lo, hi] with ``lo_open``), as float."""
    if not _is_number(value):
        raise _fail(field, "a number", value)
    f = float(value)
    bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
    if not math.isfinite(f) or f > hi or f < lo or (lo_open and f == lo):
        raise _fail(field, f"a finite number {bound} and <= {hi:g}", value)
    return f


def weight(value: Any, field: str = "weight") -> float:
    """A placement weight: finite, 0 (never picked) to 1e6."""
    return number(value, field, 0.0, MAX_WEIGHT)


def positive_seconds(value: Any, field: str, *, allow_zero: bool = False,
                     max_s: float = DEFAULT_MAX_SECONDS) -> float:
    """A duration in seconds: finite, > 0 (or >= 0 with ``allow_zero``), at most ``max_s``."""
    return number(value, field, 0.0, max_s, lo_open=not allow_zero)


def int_range(value: Any, field: str, lo: int, hi: int) -> int:
    """An integer (not a bool, not a float) in [lo, hi]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(field, f"an integer from {lo} to {hi}", value)
    if not lo <= value <= hi:
        raise _fail(field, f"an integer from {lo} to {hi}", value)
    return value


def choice(value: Any, field: str, allowed: Iterable[str]) -> str:
    """One of ``allowed`` (exact string match)."""
    options = tuple(allowed)
    if not isinstance(value, str) or value not in options:
        raise _fail(field, "one of " + ", ".join(options), value)
    return value


def text(value: Any, field: str, *, max_len: int = 1024) -> str:
    """A string of at most ``max_len`` characters (model names, labels)."""
    if not isinstance(value, str) or len(value) > max_len:
        raise _fail(field, f"a string of at most {max_len} characters", value)
    return value


def worker_id(value: Any, field: str = "id", *, allow_empty: bool = False) -> str:
    """1-128 characters of ``[A-Za-z0-9._:@/-]``; empty only where the caller assigns an id.

    Why so strict: ids travel in gRPC error metadata, Prometheus labels and log lines.
    """
    allowed = f"1-{MAX_WORKER_ID_LEN} characters of A-Z a-z 0-9 . _ : @ / -"
    if not isinstance(value, str):
        raise _fail(field, allowed, value)
    if value == "" and allow_empty:
        return value
    if len(value) > MAX_WORKER_ID_LEN or not _WORKER_ID.fullmatch(value):
        raise _fail(field, allowed, value)
    return value


def listen_address(value: Any, field: str = "listen") -> str:
    """``host:port`` to listen on (port 0 picks a free port); IPv6 hosts in brackets."""
    allowed = "host:port with a port from 0 to 65535 (IPv6 in brackets: [::1]:50051)"
    if not isinstance(value, str):
        raise _fail(field, allowed, value)
    host, sep, port = value.strip().rpartition(":")
    if (not sep or not host or not _DIGITS.fullmatch(port) or int(port) > MAX_PORT
            or any(c.isspace() for c in host) or (":" in host and not (host[0] == "[" and host[-1] == "]"))):
        raise _fail(field, allowed, value)
    return value.strip()


def host(value: Any, field: str) -> str:
    """A host name or address to bind or advertise: non-empty, no spaces, no scheme or port."""
    allowed = "a host name or IP address (no scheme, port or spaces)"
    if not isinstance(value, str) or not value.strip() or len(value) > 253:
        raise _fail(field, allowed, value)
    h = value.strip()
    if "/" in h or any(c.isspace() for c in h) or (h.count(":") == 1):
        raise _fail(field, allowed, value)
    return h


def _port_of(parts, field: str, value: Any, *, required: bool, allowed: str) -> int | None:
    try:
        port = parts.port  # raises ValueError when not a number or out of 0-65535
    except ValueError:
        raise _fail(field, allowed, value) from None
    if port is None:
        if required:
            raise _fail(field, allowed, value)
        return None
    if not 1 <= port <= MAX_PORT:
        raise _fail(field, allowed, value)
    return port


def url(value: Any, field: str = "url") -> str:
    """An engine base URL, normalized as ``controlplane.workers.normalize_url`` does.

    ``http://`` is added when no scheme is given and a trailing ``/`` is dropped. Allowed:
    http or https, a host, optionally a port 1-65535 and a path; no spaces, no credentials
    (they would be logged), no query or fragment, at most 2048 characters.
    """
    allowed = ("an http(s) URL with a host and an optional port 1-65535 "
               "(no spaces, credentials, query or fragment; at most 2048 characters)")
    if not isinstance(value, str):
        raise _fail(field, allowed, value)
    u = value.strip()
    if not u or len(u) > MAX_URL_LEN or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in u):
        raise _fail(field, allowed, value)
    # the scheme is looked for before dropping trailing slashes, so "http://" is no host "http"
    u = (u if "://" in u else "http://" + u).rstrip("/")
    try:
        parts = urlsplit(u)
    except ValueError:  # e.g. an unbalanced IPv6 bracket
        raise _fail(field, allowed, value) from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise _fail(field, allowed, value)
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise _fail(field, allowed, value)
    _port_of(parts, field, value, required=False, allowed=allowed)
    return u


def kv_endpoint(value: Any, field: str = "kv_events", dp_size: int = 1) -> str:
    """An engine's ZMQ KV-event (or replay) endpoint the control plane connects to.

    Empty (no events), ``tcp://host:port`` (data-parallel rank r publishes on port + r, so
    port + dp_size - 1 must stay <= 65535), or ``ipc://path`` (one rank only: ranks cannot be
    offset on a path). A ``*`` host is the engine's bind form, not an address to connect to.
    """
    if not isinstance(value, str):
        raise _fail(field, "a string: empty, tcp://host:port or ipc://path", value)
    v = value.strip()
    if not v:
        return ""
    max_port = MAX_PORT - max(dp_size, 1) + 1
    allowed = (f"empty, tcp://host:port with port 1-{max_port}"
               + (f" (dp_size {dp_size} uses port..port+{dp_size - 1})" if dp_size > 1 else "")
               + (" or ipc://path" if dp_size <= 1 else "; ipc:// only works with dp_size 1"))
    if len(v) > MAX_URL_LEN or any(c.isspace() or ord(c) < 32 for c in v):
        raise _fail(field, allowed, value)
    scheme, sep, rest = v.partition("://")
    if not sep:
        raise _fail(field, allowed, value)
    scheme = scheme.lower()
    if scheme == "ipc":
        if dp_size > 1 or not rest:
            raise _fail(field, allowed, value)
        return v
    if scheme != "tcp":
        raise _fail(field, allowed, value)
    try:
        parts = urlsplit(v)
    except ValueError:
        raise _fail(field, allowed, value) from None
    host = parts.hostname
    if (not host or host == "*" or parts.path or parts.query or parts.fragment
            or parts.username is not None or parts.password is not None):
        raise _fail(field, allowed, value)
    port = _port_of(parts, field, value, required=True, allowed=allowed)
    if port is not None and port > max_port:
        raise _fail(field, allowed, value)
    return v


def hash_seed(value: Any, field: str = "hash_seed") -> str | None:
    """The engines' ``PYTHONHASHSEED`` as the string vLLM hashes into NONE_HASH; None when unset.

    vLLM seeds its block-hash chain with ``hash_fn(os.getenv("PYTHONHASHSEED"))``: the *string*.
    So an integer ``0`` in the config means PYTHONHASHSEED=0, i.e. the seed ``"0"``. A string is
    kept exactly as written (``"007"`` and ``"7"`` hash differently in vLLM), but it must be what
    Python itself accepts: ``random`` or an integer from 0 to 4294967295.
    """
    allowed = f"an integer from 0 to {MAX_HASH_SEED} or \"random\" (as PYTHONHASHSEED); omit it when unset"
    if value is None:
        return None
    if isinstance(value, bool):
        raise _fail(field, allowed, value)
    if isinstance(value, int):
        if not 0 <= value <= MAX_HASH_SEED:
            raise _fail(field, allowed, value)
        return str(value)
    if isinstance(value, str):
        if value == "random":
            return value
        if _DIGITS.fullmatch(value) and int(value) <= MAX_HASH_SEED:
            return value
    raise _fail(field, allowed, value)


def boolean(value: Any, field: str) -> bool:
    """``true`` or ``false`` (not 0/1, not a string: those are usually typos)."""
    if not isinstance(value, bool):
        raise _fail(field, "true or false", value)
    return value
