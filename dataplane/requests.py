"""Parse and check an incoming OpenAI request once, keeping its original bytes.

The body is decoded a single time to validate it and read the few fields routing needs;
the original bytes are what goes upstream whenever a leg does not change the body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from dataplane.errors import APIError
from protos.options import MAX_SLO_MS
from dataplane.hygiene import (
    PD_FIELD_PREFIX,
    PD_FIELDS,
    engine_request_id,
    new_id,
    sanitize_client_id,
    strip_pd_fields,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# Counts a client may ask for: the engines reject anything near this long before, and it
# keeps every count inside the control plane's int64 fields and its load arithmetic.
MAX_COUNT = 2**31 - 1


@dataclass(slots=True)   # (made per request: slots build and read faster)
class ClientRequest:
    path: str
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int          # 0 when the client did not say
    prompt_tokens: int       # an estimate until the data plane tokenizes (issue: exact ids)
    request_id: str          # what the engines see as X-Request-Id: unique per attempt
    placement_id: str        # unique per request, for the control plane's ledger
    client_id: str = ""      # the client's X-Request-Id, sanitized: a label echoed back, never a key
    num_prompts: int = 1     # completions batch size; each prompt is its own engine request
    ttft_slo_ms: float = 0.0   # the client's latency targets (X-SLO-TTFT-Ms / X-SLO-TPOT-Ms), 0 = none
    tpot_slo_ms: float = 0.0
    token_ids: list[int] | None = None   # the prompt's token ids, when known (one prompt only)
    # (those ids, their JSON) when the data plane serialized them into the body: the hashing
    # process takes the same bytes instead of a second dumps on the loop (dataplane.prefix)
    token_ids_json: tuple[list[int], bytes] | None = None
    block_hashes: list[int] = field(default_factory=list)   # vLLM hash chain, when placement wants it

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT

    @property
    def echo_id(self) -> str:
        """The X-Request-Id of our response: the client's own (sanitized), else ours."""
        return self.client_id or self.request_id


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the 400 that says what it is instead."""
    if not raw:
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def _check_type(body: dict, key: str, types: tuple[type, ...], label: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) and bool not in types:
        raise APIError(400, f"'{key}' must be {label}, not a boolean", param=key)
    if not isinstance(value, types):
        raise APIError(400, f"'{key}' must be {label}, got {type(value).__name__}", param=key)


# The fields parse_request checks, in the order their errors are reported.
_TYPED_FIELDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("model", (str,), "a string"), ("stream", (bool,), "a boolean"), ("max_tokens", (int,), "an integer"),
    ("max_completion_tokens", (int,), "an integer"), ("n", (int,), "an integer"),
    ("temperature", (int, float), "a number"), ("stream_options", (dict,), "an object"),
    ("kv_transfer_params", (dict,), "an object"))
_COUNTS = ("max_tokens", "max_completion_tokens", "n")
# Exact types each field may have when valid (bool is a subclass of int: listed only where allowed).
_VALID_TYPES: dict[str, set[type]] = {
    "model": {str}, "stream": {bool}, "max_tokens": {int}, "max_completion_tokens": {int}, "n": {int},
    "temperature": {int, float}, "stream_options": {dict}, "kv_transfer_params": {dict}}


def _plain(body: dict) -> bool:
    """The common valid request, in one pass over the body's own keys (a few): no typed field
    of the wrong type, no count out of range, no PD-internal field (``hygiene.is_pd_field``).
    False: ``parse_request`` strips what it must and ``_check_types`` says what is wrong."""
    valid = _VALID_TYPES
    for key, value in body.items():
        if key in PD_FIELDS or key.startswith(PD_FIELD_PREFIX):
            return False
        allowed = valid.get(key)
        if allowed is not None and value is not None and (
                type(value) not in allowed or (key in _COUNTS and not 1 <= value <= MAX_COUNT)):
            return False
    return True


def _check_types(body: dict) -> None:
    """400 for the first typed field of the wrong type, in their fixed order (so a body with
    several errors reports the same one), then for a count out of range."""
    for key, types, label in _TYPED_FIELDS:
        _check_type(body, key, types, label)
    for key in _COUNTS:
        if body.get(key) is not None and not 1 <= body[key] <= MAX_COUNT:
            raise APIError(400, f"'{key}' must be between 1 and {MAX_COUNT}", param=key)


def _estimate_text_tokens(text: str) -> int:
    # About four characters a token for English BPE vocabularies; a later issue replaces
    # this with the model's own tokenizer.
    return max(1, (len(text) + 3) // 4)


def _token_ids(values: list) -> bool:
    """Every item a JSON integer (not a boolean): one pass in C. A Python loop over a
    50,000-token prompt held the event loop for ~3 ms (burst benchmark); this takes ~0.8."""
    return not values or set(map(type, values)) == _INT_ONLY


_INT_ONLY = {int}


def _completions_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _estimate_text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if type(prompt[0]) is int and _token_ids(prompt):
            return len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(_estimate_text_tokens(p) for p in prompt)
        if all(isinstance(p, list) and _token_ids(p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids "
                        "or a list of token-id lists", param="prompt")


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    total = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            total += _estimate_text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += _estimate_text_tokens(part["text"])
        elif content is not None:
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts",
                           param="messages")
        total += 4  # role markers of the chat template
    return total


def slo_header(headers, name: str) -> float:
    """A latency target header in milliseconds: a finite number > 0 (400 otherwise); 0 if absent."""
    value = headers.get(name)
    if value is None:
        return 0.0
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not (0 < ms <= MAX_SLO_MS):   # also refuses nan and inf
        raise APIError(400, f"header {name} must be a number of milliseconds > 0 and <= {MAX_SLO_MS:.0f}")
    return ms


def parse_request(path: str, raw: bytes, client_request_id: str | None, *,
                  allowed_fields: frozenset[str] = frozenset()) -> ClientRequest:
    """Validate once; PD-internal fields the client set are dropped (unless ``allowed_fields``)."""
    body = json_object(raw)
    if not _plain(body):     # (rare) PD fields dropped first, then the checks
        body, raw = strip_pd_fields(body, raw, allowed_fields)
        _check_types(body)

    if path == CHAT:
        prompt_tokens = _chat_prompt_tokens(body.get("messages"))
    else:
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", param="prompt")
        prompt_tokens = _completions_prompt_tokens(body["prompt"])

    num_prompts = 1
    prompt = body.get("prompt")
    if path != CHAT and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        num_prompts = len(prompt)
    token_ids = None
    if path != CHAT and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        token_ids = prompt
    elif path != CHAT and isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        token_ids = prompt[0]
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 0
    placement_id = new_id()
    client_id = sanitize_client_id(client_request_id)
    return ClientRequest(path=path, raw=raw, body=body, model=body.get("model") or "",
                         stream=bool(body.get("stream")), max_tokens=int(max_tokens),
                         prompt_tokens=prompt_tokens, request_id=engine_request_id(client_id, placement_id),
                         placement_id=placement_id, client_id=client_id,
                         num_prompts=num_prompts, token_ids=token_ids)


# Routes whose body goes, unchanged, to one worker of its model (the aggregated flow): the
# data plane reads only "model" (and "stream", for /v1/responses) and sizes the request
# for placement from the body's length.
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
RERANK = ("/v1/rerank", "/rerank", "/v2/rerank")
PASSTHROUGH = frozenset((EMBEDDINGS, RESPONSES, *RERANK))


def parse_passthrough(path: str, raw: bytes, client_request_id: str | None, *,
                      allowed_fields: frozenset[str] = frozenset()) -> ClientRequest:
    """A body for a pass-through route: a JSON object with a string "model" (or none, where
    the deployment serves one model); every other field is the engine's to check."""
    body, raw = strip_pd_fields(json_object(raw), raw, allowed_fields)
    _check_type(body, "model", (str,), "a string")
    stream = False
    if path == RESPONSES:
        _check_type(body, "stream", (bool,), "a boolean")
        _check_type(body, "max_output_tokens", (int,), "an integer")
        stream = bool(body.get("stream"))
    max_tokens = body.get("max_output_tokens") if path == RESPONSES else 0
    if max_tokens and not 1 <= max_tokens <= MAX_COUNT:
        raise APIError(400, f"'max_output_tokens' must be between 1 and {MAX_COUNT}", param="max_output_tokens")
    placement_id = new_id()
    client_id = sanitize_client_id(client_request_id)
    return ClientRequest(path=path, raw=raw, body=body, model=body.get("model") or "", stream=stream,
                         max_tokens=int(max_tokens or 0), prompt_tokens=max(1, len(raw) // 4),
                         request_id=engine_request_id(client_id, placement_id), placement_id=placement_id,
                         client_id=client_id)
