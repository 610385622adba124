"""Engine-exact tokenization in the data plane (HF ``tokenizers`` + the model's chat template).

Goal: the token ids computed here equal the ``prompt_token_ids`` a vLLM 0.32 OpenAI server computes
for the same request, so that KV-cache-aware placement can hash exactly the blocks the engine will
hold. ``tests/test_tokenizer.py`` checks this against ids produced by vLLM's own renderer code.

API
===

Loading::

    tok = Tokenizer.from_dir("/models/llama")   # tokenizer.json (+ tokenizer_config.json,
                                                # chat_template.jinja, additional_chat_templates/,
                                                # special_tokens_map.json when present)
    tok = Tokenizer.from_files("tokenizer.json", tokenizer_config={...} | "tokenizer_config.json",
                               chat_template=None)

    Options (both constructors): ``chat_template`` (the server's ``--chat-template``: text or a
    file path), ``default_chat_template_kwargs`` (``--default-chat-template-kwargs``),
    ``exclude_tools_when_tool_choice_none`` and ``chat_template_content_format`` (same flags),
    ``async_threshold_chars`` (default 2000),
    ``workers`` (threads that encode long prompts' slices; default: one per CPU core, at most 4),
    ``executor`` (for :meth:`encode_async` and friends, instead of those threads),
    ``bulk_priority`` (those threads' nice increment, or ``"idle"``; default 0, unchanged),
    ``prefix_cache_ids`` (ids of text prefixes kept for reuse, default 4,000,000; 0 = none:
    a text of ``async_threshold_chars`` or more encodes only what follows the longest prefix
    tokenized before, with the same ids as a whole encode, and that rest in ~1k-character
    pieces in one batch: ~0.7-0.9x the CPU, and one prompt on every core; 0 keeps the pieces;
    see :mod:`dataplane.prefix_ids`).

Encoding (synchronous; all return ``list[int]``)::

    tok.encode_prompt("text", add_special_tokens=True)   # /v1/completions text prompt (BOS etc. from
                                                          # tokenizer.json's post-processor)
    tok.encode_prompt([1, 2, 3])                          # token-id prompt: passed through
    tok.encode_prompts(body["prompt"])                    # any CompletionRequest.prompt shape ->
                                                          # list of id lists (one per prompt)
    tok.encode_chat(messages, add_generation_prompt=True, tools=None, **template_kwargs)
    tok.render_chat(messages, ...) -> str                 # the prompt text, without tokenizing

    Request-level helpers that read every tokenization-relevant field of an OpenAI body the way
    vLLM does (``add_special_tokens``, ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template``, ``chat_template_kwargs``, ``documents``, ``reasoning_effort``, ``tools``,
    ``tool_choice``)::

    tok.encode_chat_request(body) -> list[int]
    tok.encode_completion_request(body) -> list[list[int]]

Async (off the event loop above ``async_threshold_chars``)::

    await tok.encode_async("text" | [ids], add_special_tokens=True)
    await tok.encode_chat_async(messages, ...)       # renders on the loop, encodes like a prompt
    await tok.encode_chat_request_async(body)
    await tok.encode_completion_request_async(body)

    Short inputs are encoded inline: the executor hop costs more than encoding a short prompt
    (see ``bench/tokenize_cost.py``). Long inputs go to the tokenizer's own threads through
    ``encode_batch_fast``/``encode_batch``, which release the GIL while the Rust code runs
    (``Tokenizer.encode`` does not: from a thread it would still stall the loop), so a burst of
    long prompts is tokenized in parallel while the loop serves everything else. A long prompt's
    Python bookkeeping runs on one of ``WAITING_THREADS`` threads, which waits while its pieces
    are encoded in ~8k-character slices on ``workers`` threads, one per core, the smallest
    prompt's slices first (:mod:`dataplane.encode_pool`; the Rust tokenizer's rayon threads are
    off): a short prompt of a burst starts within a slice, not after every long one before it.
    One encoding thread per core, not the loop's default executor (6 threads on 2
    cores, shared with hashing and start-up work): a burst of 18 prompts time-shared over more
    threads than cores finished every prompt late instead of the first ones early, and stalled
    the loop longer. A process pool was measured as the alternative (``bench/tokenize_cost.py
    --burst``): no faster on this 2-core machine, and it would copy the prompt and the ids
    between processes and keep a tokenizer (and its chat templates) in each; threads it is.
    The encoding threads can run below the loop's CPU priority (``bulk_priority``, the data
    plane's ``--bulk-nice``; :mod:`dataplane.bulk_priority`); only they, since they hold the GIL
    for microseconds per slice, while the waiting threads run Python (the ids' lists, the cache).
    It is off by default: nice +10 made tokenized latency, placement p99 and the loop's stall
    worse in ``bench/burst.py --prompts text`` on this 2-core host (as nice +5 on every
    tokenizing thread did before). ``close()`` stops the threads.

``tok.engine_renderer``: ``"hf"``, or the vLLM tokenizer mode that ``from_dir`` expects vLLM to pick
instead (``deepseek_v32``/``deepseek_v4``/``deepseek_v41``/``kimi_k3``/``kimi_audio``/``inkling`` from
``config.json`` architectures, ``mistral`` when ``tekken.json``/``tokenizer.model.v*`` exist). For those
vLLM does not use the jinja template and this module's chat ids are not the engine's.

Errors: :class:`~dataplane.chat_template.TokenizeError` (a ``ValueError``) for inputs this module cannot turn into the
engine's ids; :class:`~dataplane.chat_template.UnsupportedContent` (a subclass) for multimodal
content; :class:`~dataplane.chat_template.ChatTemplateError` (a subclass) when no template is
available or the template rejects the request (``raise_exception``). Callers should treat any of
them as "route without token ids", not as a client error: the engine decides what is valid.

Engine semantics reproduced (vLLM 0.32 with transformers 5, ``--tokenizer-mode auto``)
=====================================================================================

* Completions: ``add_special_tokens`` defaults to **True**; chat: **False** (the template writes
  BOS itself). The flag only toggles the post-processor of ``tokenizer.json`` (e.g. Llama 3's
  ``TemplateProcessing`` BOS); ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json``
  are ignored when ``tokenizer.json`` exists (transformers 5 drops them).
* Special tokens from ``tokenizer_config.json`` (plain strings or ``{"__type": "AddedToken", ...}``
  dicts) that ``tokenizer.json`` lacks are added as special tokens, as transformers does;
  ``split_special_tokens`` is honoured.
* Template variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
  special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ... and any other
  ``*_token`` string in the config), then the request's ``chat_template_kwargs`` (which override
  them). Chat-level details (content format, developer role, tool-call arguments, tools shape):
  see :mod:`dataplane.chat_template`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, cast

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from dataplane.chat_template import (
    ChatTemplateError,
    ContentFormat,
    TokenizeError,
    UnsupportedContent,
    detect_content_format,
    merge_kwargs,
    normalize_messages,
    normalize_tools,
    render,
    select_template,
    supports_developer_role,
)
from dataplane.bulk_priority import BulkPriority
from dataplane.encode_pool import EncodePool, rayon_off
from dataplane.prefix_ids import DEFAULT_MAX_IDS, PrefixIds, cut_plan

__all__ = ["ChatTemplateError", "TokenizeError", "Tokenizer", "UnsupportedContent", "DEFAULT_ASYNC_THRESHOLD_CHARS"]

DEFAULT_ASYNC_THRESHOLD_CHARS = 2000


def default_workers() -> int:
    """Encoding threads: one per core (the encode is CPU-bound Rust), at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


# Threads that take long prompts off the loop: each does a prompt's Python bookkeeping and waits
# (GIL released) for its slices (dataplane.encode_pool); so many that a prompt of a burst never
# waits for one to start.
WAITING_THREADS = 16


_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=True)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        # transformers builds AddedToken(**dict) (normalized defaults to "not special"), then marks it special.
        normalized = value.get("normalized", not value.get("special", False))
        return AddedToken(value["content"], single_word=bool(value.get("single_word", False)),
                          lstrip=bool(value.get("lstrip", False)), rstrip=bool(value.get("rstrip", False)),
                          normalized=bool(normalized), special=True)
    return None


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_template_arg(value: str | None) -> str | None:
    """The server's ``--chat-template``: a file path or the template text itself."""
    if value is None:
        return None
    if "{" not in value and len(value) < 4096 and os.path.isfile(value):
        return Path(value).read_text(encoding="utf-8")
    return value


# Architectures for which vLLM 0.32 (tokenizer_mode auto) renders chats with its own Python code, not
# the jinja template (vllm/config/model.py), and files that make it use mistral_common.
_NON_HF_ARCHS = {"MoonshotKimiaForCausalLM": "kimi_audio", "KimiK3ForConditionalGeneration": "kimi_k3",
                 "DeepseekV32ForCausalLM": "deepseek_v32", "DeepseekV4ForCausalLM": "deepseek_v4",
                 "DeepseekV4ForConditionalGeneration": "deepseek_v4", "DeepseekV41ForCausalLM": "deepseek_v41",
                 "InklingForCausalLM": "inkling", "InklingForConditionalGeneration": "inkling"}


def _vllm_renderer_mode(d: Path) -> str:
    """vLLM's tokenizer mode for a model dir: "hf" is the only one this module reproduces."""
    try:
        archs = _read_json(d / "config.json").get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []
    for arch in archs:
        if arch in _NON_HF_ARCHS:
            return _NON_HF_ARCHS[arch]
    if (d / "tekken.json").is_file() or any(d.glob("tokenizer.model.v*")):
        return "mistral"   # vLLM uses mistral_common when the repo is a Mistral one (not checked here)
    return "hf"


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


class Tokenizer:
    """A model's tokenizer and chat template(s); see the module docstring for the API."""

    def __init__(self, backend: _HFTokenizer, config: Mapping[str, Any] | None = None, *,
                 chat_templates: str | Mapping[str, str] | None = None, chat_template: str | None = None,
                 default_chat_template_kwargs: Mapping[str, Any] | None = None,
                 exclude_tools_when_tool_choice_none: bool = False,
                 chat_template_content_format: str = "auto",
                 async_threshold_chars: int = DEFAULT_ASYNC_THRESHOLD_CHARS,
                 executor: Executor | None = None, workers: int = 0, name: str = "",
                 prefix_cache_ids: int = DEFAULT_MAX_IDS, bulk_priority: BulkPriority = 0) -> None:
        self._tok = backend
        # "hf" unless from_dir found a model vLLM renders with other code (deepseek_v4, mistral, ...):
        # then chat ids here may differ from the engine's, and callers should not use them.
        self.engine_renderer = "hf"
        self.config: dict[str, Any] = dict(config or {})
        self.name = name
        self.async_threshold_chars = async_threshold_chars
        self.executor = executor        # None: the tokenizer's own threads (started on first use)
        self.workers = workers or default_workers()
        self._pool: ThreadPoolExecutor | None = None
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError("chat_template_content_format must be 'auto', 'string' or 'openai'")
        self.chat_template_content_format = chat_template_content_format
        # Model templates: tokenizer_config's chat_template (str, or list of {name, template}).
        if chat_templates is None:
            raw = self.config.get("chat_template")
            if isinstance(raw, list):
                chat_templates = {t["name"]: t["template"] for t in raw}
            else:
                chat_templates = raw
        self.chat_templates = chat_templates
        self.server_chat_template = _load_template_arg(chat_template)

        # Template variables from special tokens (HF special_tokens_map: named ones + custom *_token).
        self.special_tokens: dict[str, str] = {}
        for key, value in self.config.items():
            if key in _NAMED_SPECIAL or (key.endswith("_token") and _token_content(value) is not None):
                content = _token_content(value)
                if content is not None:
                    self.special_tokens[key] = content
        extra = self.config.get("extra_special_tokens")
        if isinstance(extra, dict):
            for key, value in extra.items():
                content = _token_content(value)
                if content is not None:
                    self.special_tokens[key] = content

        # Special tokens that tokenizer.json lacks are added, as transformers does on load.
        known = {t.content for t in backend.get_added_tokens_decoder().values()}
        to_add: list[AddedToken] = []
        candidates = [self.config.get(k) for k in self.config
                      if k in _NAMED_SPECIAL or (k.endswith("_token") and _token_content(self.config[k]))]
        extras = self.config.get("extra_special_tokens") or self.config.get("additional_special_tokens")
        if isinstance(extras, dict):
            candidates += list(extras.values())
        elif isinstance(extras, list):
            candidates += extras
        for value in candidates:
            at = _added_token(value)
            if at is not None and at.content not in known:
                known.add(at.content)
                to_add.append(at)
        if to_add:
            backend.add_special_tokens(to_add)
        backend.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        # encode_batch_fast (tokenizers >= 0.21) skips offsets; both release the GIL.
        self._encode_batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        # Long texts' pieces on the tokenizer's own threads, smallest prompt first, rayon off.
        rayon_off()
        self._slices = EncodePool(lambda texts, **kw: self._encode_batch(texts, **kw), self.workers,
                                  priority=bulk_priority)
        # Ids of text prefixes tokenized before (dataplane.prefix_ids), and the rest encoded in
        # pieces in one batch, for texts of async_threshold_chars or more, when this tokenizer's
        # pipeline can be cut exactly (prefix_cache_ids=0: pieces, no cache).
        self.prefix_ids: PrefixIds | None = None
        plan = cut_plan(backend, self._encode_batch, name)
        if plan is not None:
            self.prefix_ids = PrefixIds(plan, self._slices.encode_batch, max_ids=prefix_cache_ids)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_files(cls, tokenizer_json: str | os.PathLike[str],
                   tokenizer_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                   **kwargs: Any) -> Tokenizer:
        backend = _HFTokenizer.from_file(str(tokenizer_json))
        if tokenizer_config is None or isinstance(tokenizer_config, Mapping):
            config = dict(tokenizer_config or {})
        else:
            config = _read_json(Path(tokenizer_config))
        return cls(backend, config, **kwargs)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], **kwargs: Any) -> Tokenizer:
        """Load a model (or tokenizer) directory as transformers 5 would for a fast tokenizer."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} not found (only tokenizer.json-based tokenizers are supported)")
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            config = _read_json(d / "tokenizer_config.json")
        # Legacy special_tokens_map.json: read only when the config has no added_tokens_decoder,
        # and then its values win (transformers 5 _from_pretrained).
        stm = d / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and stm.is_file():
            for key, value in _read_json(stm).items():
                if key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                    prev = list(config.get("extra_special_tokens") or config.get("additional_special_tokens") or [])
                    config["extra_special_tokens"] = prev + [v for v in value if v not in prev]
                else:
                    config[key] = value
        # chat_template.jinja / additional_chat_templates/*.jinja take priority over the config.
        templates: dict[str, str] = {}
        if (d / "chat_template.jinja").is_file():
            templates["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
        extra_dir = d / "additional_chat_templates"
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
        if templates:
            kwargs.setdefault("chat_templates", templates["default"] if list(templates) == ["default"]
                              else templates)
        kwargs.setdefault("name", str(d))
        backend = _HFTokenizer.from_file(str(tj))
        tok = cls(backend, config, **kwargs)
        tok.engine_renderer = _vllm_renderer_mode(d)
        return tok

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_templates is not None or self.server_chat_template is not None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ text prompts

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A completion prompt (``str``) -> ids; a token-id prompt (``list[int]``) is returned as is."""
        if isinstance(prompt, str):
            return self._encode_ids_nogil(prompt, add_special_tokens)
        if _is_token_ids(prompt):
            return list(prompt)
        raise TokenizeError("prompt must be a string or a list of token ids")

    def encode_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        """``CompletionRequest.prompt`` (str | list[str] | list[int] | list[list[int]]) -> one id list per prompt."""
        if prompt == "":
            raise TokenizeError("empty prompt")  # vLLM rejects it (a [""] list is accepted, though)
        if isinstance(prompt, str) or _is_token_ids(prompt) and prompt:
            return [self.encode_prompt(prompt, add_special_tokens)]
        if isinstance(prompt, list) and prompt:
            return [self.encode_prompt(p, add_special_tokens) for p in prompt]
        raise TokenizeError("prompt must be a non-empty string, list of strings or list(s) of token ids")

    # ------------------------------------------------------------------ chat

    def _template_for(self, requested: str | None, tools: Any) -> str:
        if requested is not None:
            # A request template may name one of the model's templates.
            return select_template(self.chat_templates, requested, tools)
        if self.server_chat_template is not None:
            return select_template(self.chat_templates, self.server_chat_template, tools)
        return select_template(self.chat_templates, None, tools)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, *, documents: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    **template_kwargs: Any) -> str:
        """The chat prompt text, as vLLM renders it (``apply_chat_template(tokenize=False)``).

        ``tools`` are normalised like vLLM's pydantic model (pass what the client sent).
        ``template_kwargs`` are the request's ``chat_template_kwargs`` (e.g. ``enable_thinking``).
        """
        tool_dicts = normalize_tools(tools)
        source = self._template_for(chat_template, tool_dicts)
        fmt = self.chat_template_content_format
        conversation = normalize_messages(messages,
                                          detect_content_format(source) if fmt == "auto"
                                          else cast(ContentFormat, fmt),   # checked in __init__
                                          developer_role=supports_developer_role(source))
        variables = {**self.special_tokens, **template_kwargs}
        return render(source, conversation, tools=tool_dicts, documents=documents,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, variables=variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, *, documents: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    add_special_tokens: bool = False, **template_kwargs: Any) -> list[int]:
        """Chat messages -> the engine's prompt ids (render, then encode with ``add_special_tokens=False``)."""
        text = self.render_chat(messages, add_generation_prompt, tools, documents=documents,
                                continue_final_message=continue_final_message, chat_template=chat_template,
                                **template_kwargs)
        return self._encode_ids_nogil(text, add_special_tokens)

    # ------------------------------------------------------------------ OpenAI request bodies

    def chat_request_args(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The :meth:`encode_chat` arguments vLLM derives from a ``/v1/chat/completions`` body."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizeError("messages must be a non-empty list")
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final_message = body.get("continue_final_message", False)
        user_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(user_kwargs, Mapping):
            raise TokenizeError("chat_template_kwargs must be an object")
        extra = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                 "documents": body.get("documents"), "reasoning_effort": body.get("reasoning_effort")}
        if body.get("reasoning_effort") is not None and "enable_thinking" not in user_kwargs:
            extra["enable_thinking"] = body["reasoning_effort"] != "none"
        tools = body.get("tools")
        if tools is not None and body.get("tool_choice") == "none" and self.exclude_tools_when_tool_choice_none:
            tools = None
        # vLLM: request kwargs over server defaults over {tools}; None and "auto" never override.
        kw = merge_kwargs(merge_kwargs(self.default_chat_template_kwargs, {"tools": tools}),
                          merge_kwargs(user_kwargs, extra))
        kw.pop("tokenize", None)
        # Template: the request's, else the server's --chat-template, else one in chat_template_kwargs.
        template = body.get("chat_template")
        kw_template = kw.pop("chat_template", None)
        if template is None and self.server_chat_template is None:
            template = kw_template
        return {"messages": messages, "add_generation_prompt": kw.pop("add_generation_prompt", False),
                "tools": kw.pop("tools", None), "documents": kw.pop("documents", None),
                "continue_final_message": kw.pop("continue_final_message", False), "chat_template": template,
                "add_special_tokens": bool(body.get("add_special_tokens", False)), **kw}

    def encode_chat_request(self, body: Mapping[str, Any]) -> list[int]:
        return self.encode_chat(**self.chat_request_args(body))

    def encode_completion_request(self, body: Mapping[str, Any]) -> list[list[int]]:
        """``/v1/completions`` body -> one id list per prompt (``suffix``/``prompt_embeds`` unsupported)."""
        if body.get("suffix") is not None or body.get("prompt_embeds") is not None:
            raise UnsupportedContent("suffix (FIM) and prompt_embeds are not supported")
        return self.encode_prompts(body.get("prompt"), bool(body.get("add_special_tokens", True)))

    # ------------------------------------------------------------------ async

    def _encode_ids_nogil(self, text: str, add_special_tokens: bool) -> list[int]:
        # Same ids as backend.encode(), but releases the GIL and (batch_fast) skips offsets: ~15-20%
        # cheaper on this machine, so it is used inline too. A long text reuses the ids of a
        # prefix tokenized before and encodes the rest in pieces, one batch (same ids:
        # dataplane.prefix_ids); a short one is encoded whole and keeps no books.
        if len(text) < self.async_threshold_chars:
            return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        reuse = self.prefix_ids
        if reuse is not None:
            return reuse.encode(text, add_special_tokens)
        return self._slices.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _threads(self) -> Executor:
        if self.executor is not None:
            return self.executor
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=WAITING_THREADS, thread_name_prefix="omni-tokenize")
        return self._pool

    def close(self) -> None:
        """Stop the tokenizing threads (an ``executor`` passed in is the caller's to close); the
        synchronous calls still work, on the calling thread."""
        self._slices.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads(), partial(fn, *args))

    async def encode_async(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode_prompt`, off the event loop when ``len(prompt) >= async_threshold_chars``."""
        if isinstance(prompt, str) and len(prompt) >= self.async_threshold_chars:
            return await self._off_loop(self._encode_ids_nogil, prompt, add_special_tokens)
        return self.encode_prompt(prompt, add_special_tokens)

    async def encode_chat_async(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """:meth:`encode_chat`: the template rendered here, on the loop (tens of µs even for a
        100k-character chat: string joins), and the text encoded like a completion prompt, off
        the loop when long. Rendering in the tokenizing threads would run Python there, holding
        the GIL that the loop waits for, for no gain."""
        add_special_tokens = kwargs.pop("add_special_tokens", False)
        text = self.render_chat(messages, add_generation_prompt, tools, **kwargs)
        return await self.encode_async(text, add_special_tokens)

    async def encode_chat_request_async(self, body: Mapping[str, Any]) -> list[int]:
        return await self.encode_chat_async(**self.chat_request_args(body))

    async def encode_completion_request_async(self, body: Mapping[str, Any]) -> list[list[int]]:
        if body.get("suffix") is not None or body.get("prompt_embeds") is not None:
            raise UnsupportedContent("suffix (FIM) and prompt_embeds are not supported")
        prompt = body.get("prompt")
        add = bool(body.get("add_special_tokens", True))
        if prompt == "":
            raise TokenizeError("empty prompt")
        if isinstance(prompt, str) or _is_token_ids(prompt) and prompt:
            return [await self.encode_async(prompt, add)]
        if isinstance(prompt, list) and prompt:
            return [await self.encode_async(p, add) if isinstance(p, str) or _is_token_ids(p)
                    else self.encode_prompt(p, add) for p in prompt]
        raise TokenizeError("prompt must be a non-empty string, list of strings or list(s) of token ids")
