"""Request bodies the KV-transfer protocols need (vllm-protocols.md 3.1, 4.1)."""

from __future__ import annotations

from typing import Any

import orjson

# The vLLM NIXL / Mooncake "pull" request to P.
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
