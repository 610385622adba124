"""Request bodies for each leg, re-encoding only what a leg really changes."""

from __future__ import annotations

from typing import Any

import orjson

from dataplane.requests import ClientRequest

def with_fields(req: ClientRequest, fields: dict[str, Any]) -> bytes:
    """The client's original bytes plus ``fields``, appended without re-encoding the rest.

    A JSON object's last key wins in the engines' parsers, but to stay unambiguous the
    splice is only used when none of the keys is already present.
    """
    raw = req.raw.rstrip()
    if req.body and raw.endswith(b"}") and not any(k in req.body for k in fields):
        extra = b"".join(b"," + orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in fields.items())
        return raw[:-1] + extra + b"}"
    return orjson.dumps({**req.body, **fields})
