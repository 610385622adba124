"""Shared helpers for the trace benchmarks: find and window the Mooncake trace, turn rows
into token-id prompts, pick free ports, read the simulators' prefix-cache counters.

Each trace row has an arrival time (ms), an input length, an output length and
``hash_ids``: one id per 512-token block, equal ids meaning equal content. Every id becomes
a run of deterministic token ids, so requests that share ids share prefixes exactly as the
trace intends, and the simulators' prefix caches (vLLM block hashes) see the same reuse.
``text_prompt_for`` does the same with text: every id becomes a deterministic paragraph of
words (about 512 tokens of it), for benchmarks that go through a real tokenizer.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
TRACE_NAME = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK = 512          # tokens per hash_id in the Mooncake trace
VOCAB = 30000


class TraceMissing(FileNotFoundError):
    pass


def default_trace() -> Path | None:
    """The trace in ``shared/`` inside the repository root, or next to it (a checkout whose
    ``shared/`` directory sits beside the clone)."""
    for base in (ROOT, ROOT.parent):
        candidate = base / TRACE_NAME
        if candidate.is_file():
            return candidate
    return None


def resolve_trace(path: Path | None) -> Path:
    """``path`` if given, else the default; a clear error when neither exists."""
    if path is not None:
        if not path.is_file():
            raise TraceMissing(f"trace file not found: {path}")
        return path
    found = default_trace()
    if found is None:
        raise TraceMissing(
            f"trace not found: looked for {ROOT / TRACE_NAME} and {ROOT.parent / TRACE_NAME}; "
            "pass --trace PATH")
    return found


def load_rows(trace: Path, start: int, count: int) -> list[dict]:
    """Rows ``start .. start+count-1`` (fewer when the trace ends first)."""
    rows = []
    with trace.open() as f:
        for i, line in enumerate(f):
            if i >= start + count:
                break
            if i >= start and line.strip():
                rows.append(json.loads(line))
    return rows


def block_tokens(hash_id: int, length: int = TRACE_BLOCK) -> list[int]:
    base = (hash_id * 2654435761) % VOCAB
    return [(base + 7 * j) % VOCAB + 1 for j in range(length)]


def prompt_for(row: dict, token_scale: int = 1, max_len: int | None = None) -> list[int]:
    """The row's prompt as token ids. ``token_scale`` > 1 shrinks it: every trace block
    becomes 512/token_scale tokens and the prompt ceil(input_length/token_scale) tokens,
    so shared prefixes stay shared, block for block."""
    per_block = max(1, TRACE_BLOCK // token_scale)
    length = -(-row["input_length"] // token_scale)
    if max_len is not None:
        length = min(length, max_len)
    tokens: list[int] = []
    for h in row["hash_ids"]:
        if len(tokens) >= length:
            break
        tokens.extend(block_tokens(h, per_block))
    return tokens[:length] or [1]


# Pseudo-English words (fixed): text with a realistic share of repeated words, so the
# tokenizer's word cache helps about as much as it does on real prompts.
_WORDS: list[str] = []


def _words() -> list[str]:
    if not _WORDS:
        rng = random.Random(0)
        letters = "etaoinshrdlucmfwypvbgkjqxz"
        weights = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
        _WORDS.extend("".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(4000))
        _WORDS.extend("the of and to in is that for it as with was on be by this are at from".split() * 60)
    return _WORDS


def block_text(hash_id: int, chars: int) -> str:
    """A deterministic paragraph of about ``chars`` characters for one trace block, ending in
    a newline (so a block tokenizes the same whatever precedes it, mostly)."""
    rng = random.Random(hash_id * 2654435761 + 17)
    words = _words()
    out: list[str] = []
    size = 0
    while size < chars - 1:
        w = rng.choice(words)
        if rng.random() < 0.08:
            w += rng.choice((",", ".", ";", "?"))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:chars - 1] + "\n"


def text_prompt_for(row: dict, index: int, chars_per_token: float, min_tokens: int = 0,
                    max_tokens: int | None = None) -> str:
    """The row's prompt as text of about ``input_length`` tokens (clamped to ``min_tokens``..
    ``max_tokens``): one ``block_text`` per hash id, so rows that share ids share a text prefix;
    a row made longer than its ids gets blocks of its own (``index``: the row's number)."""
    length = max(row["input_length"], min_tokens)
    if max_tokens is not None:
        length = min(length, max_tokens)
    block_chars = max(2, round(TRACE_BLOCK * chars_per_token))
    ids = list(row["hash_ids"])
    need = -(-length // TRACE_BLOCK)
    ids += [-(index * 10_000 + k + 1) for k in range(max(0, need - len(ids)))]
    return "".join(block_text(h, block_chars) for h in ids[:need])[:max(1, round(length * chars_per_token))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def sim_state(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/sim/state") as r:
        return await r.json()


async def sim_counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[int, int]:
    """Summed prefix-cache (hit tokens, query tokens) of the simulators at ``urls``."""
    hits = queries = 0
    for url in urls:
        st = await sim_state(session, url)
        hits += st.get("prefix_cache_hits_tokens", 0)
        queries += st.get("prefix_cache_queries_tokens", 0)
    return hits, queries


def densest_window(rows: list[dict], seconds: float) -> tuple[int, int]:
    """(first row, row count) of the ``seconds``-long window of arrivals holding the most
    rows (the earliest such window); ``rows`` in trace order (timestamps ascending, ms)."""
    best = (0, 0)
    end = 0
    for i, row in enumerate(rows):
        limit = row["timestamp"] + seconds * 1000
        end = max(end, i)
        while end < len(rows) and rows[end]["timestamp"] < limit:
            end += 1
        if end - i > best[1]:
            best = (i, end - i)
    return best


def peak_rate(offsets: list[float], seconds: float = 1.0) -> float:
    """Most arrivals in any ``seconds``-long span of ``offsets`` (sorted, seconds), per second."""
    best = end = 0
    for i, t in enumerate(offsets):
        end = max(end, i)
        while end < len(offsets) and offsets[end] < t + seconds:
            end += 1
        best = max(best, end - i)
    return best / seconds
