"""Reuse the token ids of a text prefix already tokenized (issue 19: bursts of long prompts).

Multi-turn prompts resend their earlier turns, and tokenizing costs about 1 µs per token
(DeepSeek's tokenizer): a 22k-token follow-up re-encodes some 20k tokens it sent before.
This module keeps the ids of text prefixes the data plane has tokenized and encodes only the
rest of a new prompt: ``ids = head + cached ids + encode(rest) + tail``.

Exact, or not at all
====================
The result must equal encoding the whole text. That holds when the text is cut where the
tokenizer's own pipeline makes a hard boundary, and the pieces are encoded without special
tokens (the post-processor's ``head``/``tail``, e.g. BOS, are added once). :func:`cut_plan`
decides it from the tokenizer's pipeline and refuses anything it does not know:

* **Cut**: right after a ``"\\n"`` that is followed by a word character or ASCII punctuation
  (never whitespace).
* **Pre-tokenizer**: ``Split`` (``Isolated``) regexes from :data:`SAFE_SPLITS` (DeepSeek V3's
  three, Llama 3's, Qwen2's and Qwen3.5's), then ``ByteLevel`` without its own regex or prefix
  space. In each known main regex a whitespace run that holds a newline is taken whole by the
  ``\\s*[\\r\\n]+`` alternative (ahead of ``\\s+(?!\\S)``, whose look-ahead would see the end of
  the prefix), which ends at that run's last newline; nothing else matches a newline, and no
  alternative starts a match with one. So a match ends at the cut in the whole text, the
  prefix's matches are the whole text's, and the rest's scan starts where the whole text's
  resumes. GPT-2's regex (``\\s+(?!\\S)`` first) and o200k's (``[\\r\\n/]*`` would take a
  ``/`` after the cut) are not safe at this cut and are not listed.
* **Normalizer**: none, or NFC/NFKC: a newline composes with nothing, and canonical ordering
  stops at it.
* **Added tokens**: none with ``lstrip`` (it would take the newline before the cut) and none
  whose text holds a newline followed by a non-space (a match across the cut).
* **Model**: BPE without dropout (per pre-token, deterministic). No truncation or padding.
* **Post-processor**: none, ``ByteLevel``, ``TemplateProcessing`` or a ``Sequence`` of them;
  ``head``/``tail`` are read from two probes.

A start-up self-check (:func:`check`) encodes a probe text of words, spaces before newlines,
digits, punctuation, CJK, emoji, code and special tokens, cut at every cut this plan allows, and
compares with the whole encode; any difference turns reuse off (one warning).

The cache
=========
A trie of chunks: the text is cut at the first allowed cut at least ``min_chunk_chars`` after
the previous one, so two texts sharing a prefix are cut at the same places up to where they
differ. A node is one chunk; its key is its parent's number and the chunk's text (a dict lookup:
hash and full comparison, so a hit is exact, never a hash collision), and it holds that chunk's
ids (packed in ``bytes``, 4 bytes an id; the chunk's text is held too, about as much again). A lookup
walks the new text's chunks from the root: O(prompt). Nodes are evicted least recently used
when the ids held pass ``max_ids``. A walk touches its nodes deepest first, so a parent is
always more recent than its children and the least recent node is a leaf.

Out of the GC's sight: the trie is two flat dicts of plain values (node numbers, strings, bytes
and tuples of them), not an object per node (nor an ``array``, which the collector tracks). The
collector untracks such tuples once it has seen them, so a full cache adds two containers to a full
collection, not ~2 per chunk: at the default 4M ids that is ~27,000 objects fewer, ~10 ms less
of every full collection on the 2-core test machine, which holds the GIL (the event loop's
included) throughout; the data plane freezes its start-up objects likewise
(``omni_runtime.settle_heap``).

The text after the last cut (the part the next turn usually extends) is encoded but not kept.
Callers run :meth:`PrefixIds.encode` off the event loop for long texts (the tokenizer's
threads); the trie's bookkeeping holds a lock, the encode does not.

Pieces: the rest in one batch
=============================
What is not cached (all of a text no earlier prompt had) is encoded as its chunks, the same
safe cuts, in ONE ``encode_batch`` call, and the ids are joined (the data plane's tokenizer
passes :class:`dataplane.encode_pool.EncodePool`'s: slices of the pieces on its threads, the
smallest call first, rayon off); ``max_ids=0`` keeps no
cache but still encodes in pieces (``--tokenizer-prefix-cache 0``). Two gains, measured with
``bench/tokenize_cost.py --pieces`` (2 cores, lines of pseudo-English, prompts of 10k-70k tokens,
three runs at host loads 5-13):

* **Less CPU: 0.67-0.88x a whole encode**, for pieces of at least 512 to 8,192 characters
  alike (no size wins consistently; 1,024, the cache's chunk, is kept). On one thread
  (``TOKENIZERS_PARALLELISM=false``) it is 0.77-0.87x, so the saving is the piece's, not the
  threads'. It is not the BPE word cache (both ways share it and hit the same words) nor the
  offsets (``encode_batch_fast`` skips them both ways; ``encode()`` with offsets costs ~1.3x
  more again). It is the allocator: ``perf`` on one thread (a 192k-character text whole
  against 1k-character pieces) puts ~70 % of the extra in glibc's ``malloc_consolidate``,
  ``unlink_chunk`` and ``_int_free`` and ~25 % in ``NormalizedString::slice``/
  ``transform_range``. Until a text is done the pipeline keeps one ``NormalizedString`` per
  pre-token alive (its ``String`` and an alignments ``Vec`` of 16 bytes per byte): for a long
  text tens of thousands of small blocks, megabytes past the core's L2, freed together at the
  end and consolidated into glibc's bins; a 1k-character piece's few hundred are freed before
  the next piece starts, which then reuses the same hot blocks. With jemalloc preloaded the
  whole encode itself costs ~0.6x glibc's, and pieces then save only ~0.88x.
* **Every core for one prompt**: a batch's items run in parallel, so one 70k-token prompt is
  encoded on both cores while the calling thread waits with the GIL released (wall 0.40-0.76x
  a whole encode at load 5, measured with the Rust tokenizer's rayon threads). With rayon on,
  one ``encode_batch_fast`` call per piece handed each piece to the pool separately and cost
  0.82-1.11x a whole encode's CPU, no gain; the encode pool's slices run with rayon off, each
  on one thread, one slice after another.

A text under ``async_threshold_chars`` (2,000) is encoded whole, inline: no cut, no books.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

log = logging.getLogger(__name__)

# Ids held by default (about 4 bytes an id plus the chunk's text, ~4 chars a token: ~30 MB).
DEFAULT_MAX_IDS = 4_000_000
# A chunk is at least this many characters (about 250-450 tokens): fewer nodes, and a new
# turn re-encodes at most about one chunk of the prefix it shares.
DEFAULT_MIN_CHUNK_CHARS = 1024

# Right after a newline followed by a word character or ASCII punctuation (never whitespace,
# in Python's sense or the tokenizer's).
CUT = re.compile(r"\n(?=[^\W]|[!-/:-@\[-`{-~])")

# Split regexes (as in tokenizer.json) for which the cut above is a hard boundary; see the module
# docstring for why each main regex qualifies. Digit groups and CJK runs never hold a newline.
_MAIN_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_MAIN_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_MAIN_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_MAIN_DEEPSEEK = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                  r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SAFE_SPLITS = frozenset({
    _MAIN_LLAMA3, _MAIN_QWEN2, _MAIN_QWEN35, _MAIN_DEEPSEEK,
    r"\p{N}{1,3}", r"\p{N}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",      # DeepSeek V3: CJK runs
})
_SAFE_NORMALIZERS = frozenset({"NFC", "NFKC"})
_SAFE_PROCESSORS = frozenset({"ByteLevel", "TemplateProcessing"})

# Runs of a realistic prompt for the self-check: every one ends where the next may be cut.
_PROBE_PARTS = (
    "The quick brown fox, it's said, jumps over 1234567 lazy dogs.\n",
    "def f(x):\n    return x**2  # square\n", "  \n", "\n\n", "\r\n", "\t\n", " \n\n",
    "Résumé naïve café\u0301 — “quoted” text…\n", "数据平面的分词器。日本語のテキスト、カタカナ。\n",
    "emoji 😀🎉 and symbols ±§¶ 2+2=4\n", "[1, 2, 3]\n", "{\"key\": \"value\"}\n", "/path/to/file.txt\n",
    "<｜User｜>Hello<｜Assistant｜>Hi there.<｜end▁of▁sentence｜>\n", "<|im_start|>user\n",
    "'s 're 've\n", "__init__\n", "#include <stdio.h>\n", "- item one\n- item two\n", "1. first\n2. second\n",
    "\u00a0nbsp\u3000ideographic space\n", "x\n", ".\n", "?!\n", "42\n",
)


@dataclass(frozen=True)
class CutPlan:
    """How a tokenizer's text may be cut: ``head``/``tail`` are the ids its post-processor puts
    around a text when asked for special tokens (e.g. ``(bos,)`` and ``()``)."""

    head: tuple[int, ...]
    tail: tuple[int, ...]


EncodeBatch = Callable[..., Sequence[Any]]   # tokenizers' encode_batch_fast: (texts, add_special_tokens=)


def _state(component: Any) -> dict[str, Any] | None:
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _escaped(regex: str | None) -> str | None:
    """A regex with its literal CR and LF written as escapes (DeepSeek's file has them literal)."""
    return regex.replace("\r", r"\r").replace("\n", r"\n") if regex is not None else None


def _steps(state: dict | None, key: str) -> list[dict]:
    """A pipeline component's steps: those of a ``Sequence`` (under ``key``), the component
    itself, or none."""
    if not state:
        return []
    return state.get(key, []) if state.get("type") == "Sequence" else [state]


def _why_not(backend: Any) -> str | None:
    """Why the cut is not safe for this tokenizer, or None when it is."""
    if getattr(backend, "truncation", None) or getattr(backend, "padding", None):
        return "truncation or padding is set"
    model = backend.model
    if type(model).__name__ != "BPE" or getattr(model, "dropout", None):
        return f"model {type(model).__name__} (only BPE without dropout)"
    for n in _steps(_state(backend.normalizer), "normalizers"):
        if n.get("type") not in _SAFE_NORMALIZERS:
            return f"normalizer {n.get('type')}"
    pre = _state(backend.pre_tokenizer)
    if pre is None:
        return "no pre-tokenizer"
    steps = _steps(pre, "pretokenizers")
    for i, step in enumerate(steps):
        kind = step.get("type")
        if kind == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if step.get("behavior") != "Isolated" or step.get("invert") or _escaped(regex) not in SAFE_SPLITS:
                return f"pre-tokenizer Split {regex or step.get('pattern')!r} is not a known safe one"
        elif kind == "ByteLevel":
            if step.get("use_regex") or step.get("add_prefix_space") or i != len(steps) - 1:
                return "pre-tokenizer ByteLevel with its own regex or prefix space"
        else:
            return f"pre-tokenizer {kind}"
    for p in _steps(_state(backend.post_processor), "processors"):
        if p.get("type") not in _SAFE_PROCESSORS:
            return f"post-processor {p.get('type')}"
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or re.search(r"[\r\n]\S", token.content):
            return f"added token {token.content!r} (lstrip, or a newline inside)"
    return None


def _head_tail(encode_batch: EncodeBatch) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The post-processor's ids around a text, if it only adds fixed ids before and after."""
    found = set()
    for probe in ("hello world", "Another probe, 42.\nx"):
        bare, full = (encode_batch([probe], add_special_tokens=s)[0].ids for s in (False, True))
        for k in range(len(full) - len(bare) + 1):
            if full[k:k + len(bare)] == bare:
                found.add((tuple(full[:k]), tuple(full[k + len(bare):])))
                break
        else:
            return None
    return found.pop() if len(found) == 1 else None


def cut_plan(backend: Any, encode_batch: EncodeBatch, name: str = "") -> CutPlan | None:
    """The plan for ``backend`` (a ``tokenizers.Tokenizer``), or None (logged once: info for a
    pipeline this module does not know, a warning when the self-check fails)."""
    reason = _why_not(backend)
    if reason is None and (ht := _head_tail(encode_batch)) is not None:
        plan = CutPlan(*ht)
        if check(plan, encode_batch):
            return plan
        log.warning("tokenizer %s: prefix ids not reused: the self-check failed (a probe text cut at "
                    "newlines did not give the whole text's ids)", name)
        return None
    log.info("tokenizer %s: prefix ids not reused: %s", name,
             reason or "the post-processor does more than add fixed ids around the text")
    return None


def cuts(text: str, min_chunk_chars: int, start: int = 0) -> list[int]:
    """The chunk ends: the first cut at least ``min_chunk_chars`` after the previous one."""
    out: list[int] = []
    pos = start
    search = CUT.search
    while True:
        m = search(text, pos + max(min_chunk_chars - 1, 0))
        if m is None:
            return out
        pos = m.end()
        out.append(pos)


def check(plan: CutPlan, encode_batch: EncodeBatch) -> bool:
    """The probe text cut at every allowed cut, against its whole encode (both special-token modes)."""
    parts = _PROBE_PARTS
    probe = "".join(parts[(i * 7) % len(parts)] + parts[i % len(parts)] for i in range(3 * len(parts)))
    bounds = [0, *cuts(probe, 1), len(probe)]
    pieces = [probe[a:b] for a, b in pairwise(bounds)]
    ids = [i for enc in encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
    for special in (False, True):
        whole = encode_batch([probe], add_special_tokens=special)[0].ids
        if whole != ([*plan.head, *ids, *plan.tail] if special else ids):
            return False
    return len(pieces) > 10


@dataclass
class ReuseStats:
    """Counters since start: texts looked up, and ids taken from the cache or encoded."""

    texts: int = 0
    hits: int = 0          # texts that reused at least one chunk
    ids_reused: int = 0
    ids_encoded: int = 0


class PrefixIds:
    """The cache of a tokenizer whose :class:`CutPlan` is known (``max_ids=0``: no cache, the
    text still encoded in pieces); see the module docstring."""

    def __init__(self, plan: CutPlan, encode_batch: EncodeBatch, *, max_ids: int = DEFAULT_MAX_IDS,
                 min_chunk_chars: int = DEFAULT_MIN_CHUNK_CHARS) -> None:
        self.plan = plan
        self._encode_batch = encode_batch
        self.max_ids = max_ids
        self.min_chunk_chars = min_chunk_chars
        # The trie as flat maps of plain values (see "Out of the GC's sight" above): node ids are
        # ints from a counter, never reused; 0 is the root.
        self._child: dict[tuple[int, str], int] = {}                  # (parent, chunk) -> node
        self._node: dict[int, tuple[tuple[int, str], bytes]] = {}      # node -> (its key, its ids)
        self._next = 1
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self.ids_held = 0
        self.stats = ReuseStats()

    @property
    def nodes(self) -> int:
        return len(self._lru)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids, equal to the whole encode's, from the longest cached prefix on; the
        rest in pieces (the chunks), in one batch."""
        bounds = cuts(text, self.min_chunk_chars)
        path: list[int] = []
        found: list[bytes] = []
        if self.max_ids > 0:
            with self._lock:
                node = 0
                child, nodes = self._child, self._node
                for start, end in pairwise([0, *bounds]):
                    nxt = child.get((node, text[start:end]))
                    if nxt is None:
                        break
                    path.append(nxt)
                    found.append(nodes[nxt][1])
                    node = nxt
        done = len(path)
        start = bounds[done - 1] if done else 0
        # the chunks not found, then the tail after the last cut (never empty: a cut needs a character after it)
        rest = [text[a:b] for a, b in pairwise([start, *bounds[done:], len(text)])]
        encoded = [enc.ids for enc in self._encode_batch(rest, add_special_tokens=False)] if rest else []
        ids: list[int] = list(self.plan.head) if add_special_tokens else []
        for chunk_ids in found:
            ids += memoryview(chunk_ids).cast("I")
        reused = len(ids)
        for piece in encoded:
            ids += piece
        if add_special_tokens:
            ids += self.plan.tail
            reused -= len(self.plan.head)
        self._remember(path, rest[:len(bounds) - done], encoded, reused, len(ids) - reused)
        return ids

    def _remember(self, path: list[int], chunks: list[str], encoded: list[list[int]], reused: int,
                  fresh: int) -> None:
        """Adds the newly encoded whole chunks under the matched path, touches the path deepest
        first, and evicts least recently used leaves past ``max_ids``."""
        with self._lock:
            st = self.stats
            st.texts += 1
            st.hits += reused > 0
            st.ids_reused += reused
            st.ids_encoded += fresh
            if self.max_ids <= 0:
                return               # pieces only: nothing is kept
            nodes = self._node
            node = path[-1] if path else 0
            if node and node not in nodes:
                chunks = []          # the matched path was evicted meanwhile: keep nothing new
            for chunk, ids in zip(chunks, encoded, strict=False):   # the tail is not kept
                key = (node, chunk)
                child = self._child.get(key)
                if child is None:
                    child = self._next
                    self._next += 1
                    held = array("I", ids).tobytes()
                    self._child[key] = child
                    nodes[child] = (key, held)
                    self.ids_held += len(ids)
                path.append(child)
                node = child
            lru = self._lru
            for n in reversed(path):
                if n in nodes:          # not evicted by another thread meanwhile
                    lru[n] = None
                    lru.move_to_end(n)
            while self.ids_held > self.max_ids and lru:
                old, _ = lru.popitem(last=False)
                self._drop(old)

    def _drop(self, node: int) -> None:
        """Forgets a node (a leaf, by the LRU order). Were it not one, its children would only
        become unreachable from the root: still held, and evicted in their own LRU turn."""
        key, ids = self._node.pop(node)
        if self._child.get(key) == node:
            del self._child[key]
        self.ids_held -= len(ids) // 4
