"""Validate OpenAI request bodies into what the engine needs, with vLLM's error answers.

The sim needs the prompt's token ids (the prefix cache hashes them; a text prompt goes
through the toy tokenizer, token ids are used as given), a prompt fingerprint (to make
output deterministic), how many characters a real API server would have tokenized, and the
sampling fields that change timing; everything else is accepted and ignored, like vLLM
ignores fields it does not act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from simulator.config import SimConfig
from simulator.protocol import ApiError, Kind
from simulator.tokens import chat_token_ids, fingerprint, text_token_ids


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    token_ids: list[int]
    prompt_fingerprint: int
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Characters the API server tokenizes (0 for a token-id prompt) and vLLM's cache_salt.
    text_chars: int = 0
    cache_salt: str | None = None
    # The LoRA adapter the request names, (name, path); None for the base model.
    lora: tuple[str, str] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


def parse_request(kind: Kind, body: Any, cfg: SimConfig) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    model = body.get("model")
    lora = next((m for m in cfg.lora_modules if m[0] == model), None) if model else None
    if model and model != cfg.model and lora is None:   # like vLLM: a missing, null or empty model means the served one
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    if kind == "completion":
        token_ids, fp, chars = _completion_prompt(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens")
    else:
        token_ids, fp, chars = _chat_prompt(body.get("messages"))
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
    max_tokens = _resolve_max_tokens(max_tokens, len(token_ids), cfg)
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
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return ParsedRequest(kind=kind, token_ids=token_ids, prompt_fingerprint=fp,
                         max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                         stop=_stop_list(body.get("stop")), seed=seed, kv_transfer_params=kv,
                         text_chars=chars, cache_salt=cache_salt, lora=lora)


def _completion_prompt(prompt: Any) -> tuple[list[int], int, int]:
    """(token ids, fingerprint, characters to tokenize)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = text_token_ids(prompt)
        if not ids:
            raise ApiError(400, "The prompt must not be empty.", "prompt")
        return ids, fingerprint(prompt.encode()), len(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt, fingerprint(orjson.dumps(prompt)), 0
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "The simulator serves one prompt per request; "
                            f"got a batch of {len(prompt)} prompts.", "prompt")
    raise ApiError(400, "prompt must be a string, a list with one string, a list of token ids "
                        "or a list with one list of token ids", "prompt")


def _chat_prompt(messages: Any) -> tuple[list[int], int, int]:
    """The rendered conversation's toy token ids (see ``chat_token_ids``); a chat prompt is
    always text, so every content character (and role) counts as tokenized."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    rendered: list[tuple[str, list[str]]] = []
    chars = 0
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, "each message must be an object with a string role", "messages")
        texts = _content_texts(msg.get("content"))
        rendered.append((msg["role"], texts))
        chars += len(msg["role"]) + sum(len(t) for t in texts)
    return chat_token_ids(rendered), fingerprint(orjson.dumps(messages)), chars


def _content_texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, "message content parts must be objects", "messages")
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
        return texts
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
