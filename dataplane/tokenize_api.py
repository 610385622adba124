"""``/tokenize`` and ``/detokenize`` from the data plane's own tokenizer (``--tokenizer``).

vLLM's request and response shapes, so a client written for one engine works here:

* ``POST /tokenize`` with ``{"model", "prompt"}`` (``add_special_tokens``, default true) or
  ``{"model", "messages"}`` (the chat template, as ``/v1/chat/completions`` applies it;
  ``add_generation_prompt`` default true) answers
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only with
  ``return_token_strs``).
* ``POST /detokenize`` with ``{"model", "tokens"}`` answers ``{"prompt"}``.

No tokenizer configured: a 400 that says so (the engines still tokenize everything else).
A model the fleet does not serve: 404, as for generation.
"""

from __future__ import annotations

from typing import Any


from dataplane.chat_template import TokenizeError
from dataplane.errors import APIError
from dataplane.requests import json_object
from dataplane.tokenizer import Tokenizer

NO_TOKENIZER = ("this data plane has no tokenizer: start it with --tokenizer DIR (a model directory with "
                "tokenizer.json) to serve {path}")


def json_body(raw: bytes) -> dict[str, Any]:
    body = json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    return body


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{key}' must be a boolean", param=key)
    return value


async def tokenize(tok: Tokenizer, body: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
    try:
        if "messages" in body:
            _flag(body, "add_generation_prompt", True)
            ids = await tok.encode_chat_request_async(body)
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt' must be a string", param="prompt")
            ids = await tok.encode_async(prompt, _flag(body, "add_special_tokens", True))
        else:
            raise APIError(400, "either 'prompt' or 'messages' is required", param="prompt")
    except TokenizeError as exc:
        raise APIError(400, f"cannot tokenize: {exc}", param="messages" if "messages" in body else "prompt") \
            from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    if _flag(body, "return_token_strs", False):
        backend = tok.backend
        out["token_strs"] = [backend.id_to_token(i) for i in ids]
    return out


def detokenize(tok: Tokenizer, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
        raise APIError(400, "'tokens' must be a list of token ids (integers)", param="tokens")
    vocab = tok.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", param="tokens")
    return {"prompt": tok.decode(tokens)}
