"""Validate OpenAI request bodies into what the engine needs, with vLLM's error answers.

The sim only needs token counts, a prompt fingerprint (to make output deterministic) and
the sampling fields that change timing; everything else is accepted and ignored, like
vLLM ignores fields it does not act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from simulator.config import SimConfig
from simulator.protocol import ApiError, Kind
from simulator.tokens import (CHAT_GENERATION_PROMPT_TOKENS, CHAT_TOKENS_PER_MESSAGE, count_text_tokens,
                              fingerprint)


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    prompt_tokens: int
    prompt_fingerprint: int
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    kv_transfer_params: dict[str, Any] | None = None


def parse_request(kind: Kind, body: Any, cfg: SimConfig) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != cfg.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    if kind == "completion":
        prompt_tokens, fp = _completion_prompt(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens")
    else:
        prompt_tokens, fp = _chat_prompt(body.get("messages"))
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
    max_tokens = _resolve_max_tokens(max_tokens, prompt_tokens, cfg)
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise ApiError(400, f"The simulator generates one choice per request (n=1); got n={n}.", "n")
    stream = _opt_bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = bool(stream and stream_options and stream_options.get("include_usage"))
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    seed = _opt_int(body, "seed")
    return ParsedRequest(kind=kind, prompt_tokens=prompt_tokens, prompt_fingerprint=fp,
                         max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                         stop=_stop_list(body.get("stop")), seed=seed, kv_transfer_params=kv)


def _completion_prompt(prompt: Any) -> tuple[int, int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        n = count_text_tokens(prompt)
        if n == 0:
            raise ApiError(400, "The prompt must not be empty.", "prompt")
        return n, fingerprint(prompt.encode())
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return len(prompt), fingerprint(orjson.dumps(prompt))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "The simulator serves one prompt per request; "
                            f"got a batch of {len(prompt)} prompts.", "prompt")
    raise ApiError(400, "prompt must be a string, a list with one string, a list of token ids "
                        "or a list with one list of token ids", "prompt")


def _chat_prompt(messages: Any) -> tuple[int, int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    total = CHAT_GENERATION_PROMPT_TOKENS
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, "each message must be an object with a string role", "messages")
        total += CHAT_TOKENS_PER_MESSAGE + _content_tokens(msg.get("content"))
    return total, fingerprint(orjson.dumps(messages))


def _content_tokens(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return count_text_tokens(content)
    if isinstance(content, list):
        n = 0
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, "message content parts must be objects", "messages")
            text = part.get("text")
            if isinstance(text, str):
                n += count_text_tokens(text)
        return n
    raise ApiError(400, "message content must be a string or a list of parts", "messages")


def _resolve_max_tokens(requested: int | None, prompt_tokens: int, cfg: SimConfig) -> int:
    """vLLM's context-length check: prompt plus completion must fit max_model_len."""
    limit = cfg.max_model_len
    if prompt_tokens >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your "
                            f"request has {prompt_tokens} input tokens. Please reduce the length of "
                            "the input messages.")
    if requested is None:
        return min(cfg.default_max_tokens, limit - prompt_tokens)
    if requested < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    if prompt_tokens + requested > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you "
                            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
                            f"messages, {requested} in the completion). Please reduce the length of "
                            "the messages or completion.")
    return requested


def _opt_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise ApiError(400, f"{name} must be an integer", name)
    return value


def _opt_bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError(400, "stop must be a string or a list of strings", "stop")
