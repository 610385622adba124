"""Reading what an engine answered."""

from __future__ import annotations

import orjson


def upstream_message(data: bytes) -> str:
    """The engine's own error text where it gave one (OpenAI, FastAPI or plain)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:500].decode("utf-8", "replace").strip()
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if obj.get(key):
                return str(obj[key])
    return data[:500].decode("utf-8", "replace").strip()
