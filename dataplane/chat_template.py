"""Chat templates rendered the way vLLM 0.32 (HF transformers 5 underneath) renders them.

This is the text half of :mod:`dataplane.tokenizer`: it turns OpenAI chat ``messages`` into the
prompt string that the engine tokenizes. Everything here is pure Python (jinja2), no transformers.

What vLLM's OpenAI server does for ``POST /v1/chat/completions`` with an HF tokenizer
(``vllm/renderers/hf.py``, ``vllm/renderers/chat_utils.py``, ``transformers/utils/chat_template_utils.py``),
and what this module reproduces for text-only requests:

1. **Template choice** (:func:`select_template`): the request's ``chat_template`` (a template, or the
   name of one), else the model's. A model may have several named templates: ``"tool_use"`` is
   picked when ``tools`` are given, else ``"default"``.
2. **Content format** (:func:`detect_content_format`): vLLM parses the template and looks for a loop
   over ``message['content']``. If there is one the format is ``"openai"`` (content stays a list of
   ``{"type": "text", "text": ...}`` parts, and a plain string becomes a one-part list); otherwise it
   is ``"string"`` (text parts are joined with ``"\\n"``).
3. **Message normalisation** (:func:`normalize_messages`): only ``role``, ``content`` and a few known
   fields survive (``tool_calls``, ``reasoning``, ``tool_call_id``, ``name``, ...); assistant tool-call
   ``arguments`` strings are parsed into dicts; tool-message text parts are always joined; a
   ``developer`` role becomes ``system`` when the template never mentions ``"developer"``.
4. **Tools** (:func:`normalize_tools`): the shape pydantic's ``model_dump()`` gives vLLM
   (``description``/``parameters`` default to ``None``, unknown keys dropped).
5. **Rendering** (:func:`render`): a sandboxed jinja2 environment configured exactly like HF's
   (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` tag,
   ``raise_exception``, ``strftime_now`` and HF's ``tojson`` that does not HTML-escape and keeps
   non-ASCII), with ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
   tokens (``bos_token``, ...) and the extra template kwargs as variables; ``continue_final_message``
   is handled the HF way (cut the rendered text right after the final message's content).

Multimodal parts (images, audio, video, embeddings) are not supported: :class:`UnsupportedContent`
is raised so the caller can fall back to not tokenizing the request.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]

__all__ = [
    "ChatTemplateError",
    "TokenizeError",
    "UnsupportedContent",
    "compile_template",
    "detect_content_format",
    "merge_kwargs",
    "normalize_messages",
    "normalize_tools",
    "render",
    "select_template",
    "supports_developer_role",
    "template_variables",
]


class TokenizeError(ValueError):
    """The request cannot be turned into the engine's token ids here (route it without ids)."""


class ChatTemplateError(TokenizeError):
    """No usable template, or the template rejected the request (``raise_exception``, bad syntax)."""


class UnsupportedContent(TokenizeError):
    """The messages hold something this module does not render (images, audio, ...)."""


# --------------------------------------------------------------------------- jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` (assistant-mask tracking): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(lineno)

    def _passthrough(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF overrides jinja's tojson: no HTML escaping, non-ASCII kept, indent/separators exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile (cached by source text) in the HF-compatible environment."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error: {e}") from e


@lru_cache(maxsize=64)
def _parse(source: str) -> jinja2.nodes.Template:
    return _ENV.parse(source)


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """Variables the template reads but never sets (what vLLM filters request kwargs with)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_parse(source)))


@lru_cache(maxsize=64)
def supports_developer_role(source: str) -> bool:
    return '"developer"' in source or "'developer'" in source


# --------------------------------------------------------------------------- content format detection
# Same algorithm as vLLM's ``_detect_content_format`` (renderers/hf.py): find a for-loop over a
# message's ``content`` (directly, through variables assigned from ``messages``, or through a
# macro parameter that receives ``message.content``). No full data-flow analysis, like vLLM.


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_derived_from(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    yield name
    todo = deque([name])
    while todo:
        cur = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, cur) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != cur:
                    todo.append(assign.target.name)


def _message_loop_vars(root: jinja2.nodes.Node) -> list[str]:
    names = list(_names_derived_from(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_is_var_or_elems(loop.iter, n) for n in names):
            out.append(loop.target.name)
    return out


def _has_content_loop(root: jinja2.nodes.Node) -> bool:
    message_vars = _message_loop_vars(root)

    def is_content_of_message(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems(node, v, "content") for v in message_vars)

    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        arg_names = {a.name for a in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and is_content_of_message(arg):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if isinstance(kw, jinja2.nodes.Keyword) and kw.key in arg_names and is_content_of_message(kw.value):
                    content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params_by_loop[id(loop)] = content_params

    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if is_content_of_message(loop.iter):
            return True
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=64)
def detect_content_format(source: str) -> ContentFormat:
    """``"openai"`` if the template loops over message content parts, else ``"string"`` (vLLM's rule)."""
    try:
        return "openai" if _has_content_loop(_parse(source)) else "string"
    except Exception:  # unparsable template: vLLM falls back to "string" too
        return "string"


# --------------------------------------------------------------------------- template choice


def select_template(templates: str | Mapping[str, str] | None, requested: str | None = None,
                    tools: Any = None) -> str:
    """The template text to use (HF ``get_chat_template``; vLLM resolves the request's template through it)."""
    if isinstance(templates, Mapping):
        if requested is not None:
            return templates.get(requested, requested)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatTemplateError(f"the model has several chat templates and none is 'default': {sorted(templates)}")
    if requested is not None:
        return requested
    if templates is None:
        raise ChatTemplateError("the tokenizer has no chat template and the request gives none")
    return templates


# --------------------------------------------------------------------------- messages and tools

_TEXT_PART_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}
# Keys of vLLM's content-part TypedDicts; other keys of a text part are kept in "openai" format.
_KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
    "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
    "video_embeds", "video_url"})
_MEDIA_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
               "audio_url", "input_audio", "video_url")
_CLAUDE_BILLING_HEADER = "x-anthropic-billing-header"


def _text_parts(role: str, content: Any, wrap: bool) -> list[Any]:
    if content is None:
        parts: Iterable[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise UnsupportedContent(f"unsupported message content of type {type(content).__name__}")
    if role == "system":
        parts = _strip_billing_header(parts)
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            if wrap or part:
                out.append({"type": "text", "text": part} if wrap else part)
            continue
        if not isinstance(part, dict):
            raise UnsupportedContent(f"unsupported content part {type(part).__name__}")
        ptype = part.get("type")
        if ptype in _TEXT_PART_FIELD and part.get("uuid") is None:
            text = part.get(_TEXT_PART_FIELD[ptype])
            if text is None:
                if ptype in ("text", "refusal"):
                    continue  # vLLM skips (with a warning) text parts without text
                raise UnsupportedContent(f"content part {ptype!r} without text")
            if not isinstance(text, str):
                raise UnsupportedContent(f"content part {ptype!r} with non-string text")
            if wrap:
                item = {"type": "text", "text": text}
                item.update({k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS})
                out.append(item)
            elif text:  # vLLM drops falsy parsed parts: "" never reaches the "\n" join
                out.append(text)
        elif ptype == "tool_reference" and part.get("uuid") is None:
            name = part.get("name")
            if name is None:
                raise UnsupportedContent("tool_reference part without name")
            if wrap or name:
                out.append({"type": "tool_reference", "name": name} if wrap else name)
        else:
            raise UnsupportedContent(f"content part type {ptype!r} is not text")
    return out


def _strip_billing_header(parts: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(_CLAUDE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_arguments(message: dict[str, Any]) -> None:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return
    if not calls:
        message.pop("tool_calls", None)
        return
    for call in calls:
        if not isinstance(call, dict):
            raise UnsupportedContent("assistant tool_calls entries must be objects")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise UnsupportedContent("only tool_calls of type 'function' are supported")
        args = fn.get("arguments")
        if not args:
            fn["arguments"] = {}
        elif not isinstance(args, dict):
            parsed: Any = None
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = None
            else:
                parsed = args
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}


def _copy_tool_call(call: Any) -> Any:
    # vLLM's pydantic validation rebuilds tool calls in its TypedDict field order (id, function, type),
    # and the function as (arguments, name); unknown keys are kept after those.
    if not isinstance(call, dict):
        return call
    out: dict[str, Any] = {}
    for k in ("id", "function", "type"):
        if k in call:
            out[k] = call[k]
    for k, v in call.items():
        if k not in out:
            out[k] = v
    fn = out.get("function")
    if isinstance(fn, dict):
        f2 = {k: fn[k] for k in ("arguments", "name") if k in fn}
        f2.update({k: v for k, v in fn.items() if k not in f2})
        out["function"] = f2
    return out


def normalize_messages(messages: list[dict[str, Any]], content_format: ContentFormat,
                       *, developer_role: bool = True) -> list[dict[str, Any]]:
    """OpenAI request messages -> the conversation vLLM hands to the template (text only).

    ``developer_role=False`` (template never mentions ``"developer"``) turns developer messages into
    system ones and merges all system messages into one at the front, as vLLM does.
    """
    if not isinstance(messages, list):
        raise UnsupportedContent("messages must be a list")
    wrap = content_format == "openai"
    conv: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise UnsupportedContent("each message must be an object with a string role")
        role = msg["role"]
        parts = _text_parts(role, msg.get("content"), wrap)
        out: dict[str, Any] = {"role": role, "content": parts if wrap else "\n".join(parts)}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                out["tool_calls"] = [_copy_tool_call(c) for c in deepcopy(msg["tool_calls"])]
            # vLLM's request model renames the deprecated "reasoning_content" to "reasoning" first.
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            content = out["content"]
            if isinstance(content, list) and not any(isinstance(p, dict) and p.get("type") != "text"
                                                     for p in content):
                texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                out["content"] = "\n".join(texts) if texts else ""
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        if isinstance(msg.get("task"), str):
            out["task"] = msg["task"]
        if role == "developer":
            out["tools"] = msg.get("tools")
        conv.append(out)
    for m in conv:
        if m["role"] == "assistant" and "tool_calls" in m:
            _parse_tool_arguments(m)
    if not developer_role and any(m["role"] == "developer" for m in conv):
        conv = _consolidate_system(_developer_to_system(conv))
    return conv


def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in conv:
        if m["role"] == "developer":
            m = dict(m)
            m["role"] = "system"
            m.pop("tools", None)
        out.append(m)
    return out


def _consolidate_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    needed = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or systems:
            needed = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            systems.append(content)
    if not needed:
        return conv
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


def normalize_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI ``tools`` -> what vLLM passes to the template (``ChatCompletionToolsParam.model_dump()``)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise UnsupportedContent("each tool must be an object with a 'function' object")
        if tool.get("type", "function") != "function":
            raise UnsupportedContent("only tools of type 'function' are supported")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise UnsupportedContent("tool function without a name")
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        if fn.get("strict") is not None:
            f["strict"] = fn["strict"]
        defer = fn.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")
        if defer is not None:
            f["defer_loading"] = defer
        t: dict[str, Any] = {"type": "function", "function": f}
        if tool.get("defer_loading") is not None:
            t["defer_loading"] = tool["defer_loading"]
        out.append(t)
    return out


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: overrides win, except values that are ``None`` or ``"auto"``."""
    return {**(defaults or {}), **{k: v for k, v in (overrides or {}).items() if v is not None and v != "auto"}}


# --------------------------------------------------------------------------- rendering

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template's own parameters: consumed there, never template variables.
_APPLY_PARAMS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                           "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                           "truncation", "max_length", "return_tensors", "return_dict",
                           "return_assistant_tokens_mask", "tokenizer_kwargs"})


def render(source: str, conversation: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
           documents: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
           continue_final_message: bool | str = False, variables: Mapping[str, Any] | None = None) -> str:
    """HF ``apply_chat_template(..., tokenize=False)`` for one conversation.

    ``variables``: the special tokens (``bos_token``...) and the extra template kwargs; keys that are
    ``apply_chat_template`` parameters (``max_length``...) are ignored as HF does.
    """
    if not conversation:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise ChatTemplateError("documents must be a list of objects")
    template = compile_template(source)
    extra = {k: v for k, v in (variables or {}).items() if k not in _APPLY_PARAMS}
    chat = conversation
    final_text: str = ""
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        chat = deepcopy(conversation)
        final = chat[-1].get(field)
        if final is None:
            raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}"')
        if field not in source:
            raise ChatTemplateError(f'continue_final_message field "{field}" is not used by the chat template')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatTemplateError("continue_final_message is set but the final message has no text")
        else:
            final_text = final
            chat[-1][field] = final + _CONTINUE_TAG
    try:
        text = template.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    if continue_final_message:
        if final_text.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError("continue_final_message: the final message does not appear in the rendered chat")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
