"""Request bodies for each leg, re-encoding only what a leg really changes."""

from __future__ import annotations

from typing import Any

import orjson

from dataplane.requests import ClientRequest

# The vLLM NIXL / Mooncake "pull" request to P (vllm-protocols.md 3.1, 4.1).
PULL_PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(client_body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> bytes:
    """P computes the prompt and one token, and never streams (pull and push flows alike)."""
    body = dict(client_body)
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = 1
    body["min_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = kv_transfer_params
    return orjson.dumps(body)


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
