"""What a client may not decide: the ids engines key on, and the PD-internal body fields.

Client ``X-Request-Id`` values are labels, never keys. Engines (vLLM's ``cmpl-<id>-<i>``),
the metaserver and the bootstrap rendezvous all key on the id the data plane sends, so two
clients that reuse an id, or send one that is not printable ASCII, must not collide or
break a leg. The id the engines see is the client's label, sanitized, plus the request's
unique placement id.

The PD fields (``kv_transfer_params``, SGLang's ``bootstrap_*``) tell engines where to
push or pull KV blocks. A client that sets them could make an engine send its blocks to
an address of the client's choosing, or hold a prefill engine in a rendezvous; the flows
set them, clients do not, unless an operator allows a field (``--allow-client-fields``).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import orjson

MAX_CLIENT_ID_CHARS = 64
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._:\-]+")

# Fields the flows and the metaserver set on engine requests; a client's are dropped.
PD_FIELDS = frozenset({"kv_transfer_params", "batch_kv_transfer_params"})
PD_FIELD_PREFIX = "bootstrap_"     # SGLang: bootstrap_host/_port/_room/_pair_key, ...


def sanitize_client_id(value: str | None) -> str:
    """The client's id as a safe label ([A-Za-z0-9._:-], at most 64 chars); '' for none.

    Other characters (including undecodable bytes, which the server hands over as
    surrogates) become one ``_`` per run, so the label stays recognisable in logs.
    """
    if not value:
        return ""
    label = _UNSAFE_ID_CHARS.sub("_", value.strip())[:MAX_CLIENT_ID_CHARS]
    return label if label.strip("_") else ""


class _RandomIds:
    """Random ids in ``uuid.uuid4().hex``'s form (32 hex digits, version 4, RFC 4122 variant)
    at a third of its cost: the random bytes come from ``os.urandom`` 4 KiB at a time
    instead of one system call and a ``UUID`` object per request. A forked worker
    (``--workers``) starts with bytes of its own, never its parent's; threads never share
    an id (a lock, uncontended on the event loop)."""

    __slots__ = ("_buf", "_lock", "_pos")
    _CHUNK = 4096
    _CLEAR = ~((0xF000 << 64) | (0xC000 << 48))   # version and variant bits
    _SET = (0x4000 << 64) | (0x8000 << 48)        # version 4, variant 10xx

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0
        self._lock = threading.Lock()

    def reset(self) -> None:
        self._buf = b""
        self._pos = 0
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            pos = self._pos
            buf = self._buf
            if pos >= len(buf):
                buf = self._buf = os.urandom(self._CHUNK)
                pos = 0
            self._pos = pos + 16
        return "%032x" % (int.from_bytes(buf[pos:pos + 16], "big") & self._CLEAR | self._SET)


new_id = _RandomIds()
os.register_at_fork(after_in_child=new_id.reset)


def engine_request_id(client_id: str, placement_id: str) -> str:
    """The X-Request-Id every leg of one attempt carries: unique, whatever the client sent."""
    return f"{client_id}-{placement_id}" if client_id else placement_id


def is_pd_field(key: str) -> bool:
    return key in PD_FIELDS or key.startswith(PD_FIELD_PREFIX)


def strip_pd_fields(body: dict[str, Any], raw: bytes,
                    allowed: frozenset[str] = frozenset()) -> tuple[dict[str, Any], bytes]:
    """``body`` and ``raw`` without client-set PD fields (those in ``allowed`` stay).

    The check walks the parsed object's top-level keys (a dozen at most, and immune to
    JSON escapes in key names); the body is re-encoded only when a field is really
    there, so the common request keeps its original bytes.
    """
    drop = [k for k in body if is_pd_field(k) and k not in allowed]
    if not drop:
        return body, raw
    body = {k: v for k, v in body.items() if k not in drop}
    return body, orjson.dumps(body)


def parse_field_list(text: str) -> frozenset[str]:
    """``--allow-client-fields a,b`` as a set; blanks ignored."""
    return frozenset(f.strip() for f in text.split(",") if f.strip())
