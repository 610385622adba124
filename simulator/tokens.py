"""Toy tokenizer and text generator.

The sim needs token *counts* that are stable and cheap, and output text that is the same
for the same prompt (so a P->D pair, or a retried request, produces identical text as a
real engine at temperature 0 would). Nothing here is meant to resemble a real vocabulary.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterable

import orjson

_PIECE = re.compile(r"\w+|[^\w\s]")

# 64 words so a token index is 6 bits of the generator state; leading spaces make joined
# text readable. Their JSON encodings are precomputed: streaming a token is then a bytes concat.
VOCAB: tuple[str, ...] = tuple(" " + w for w in (
    "the of and to in a is that for it as with was on be by at this from or an are not "
    "which but have one all were they when there can more time so some what into only "
    "other new these two may first then do any like my now over such our man me even "
    "most made after also did many"
).split())
VOCAB_JSON: tuple[bytes, ...] = tuple(orjson.dumps(w) for w in VOCAB)
assert len(VOCAB) == 64

# Chat template overhead, roughly what Llama/DeepSeek templates add.
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_GENERATION_PROMPT_TOKENS = 3

_MASK64 = (1 << 64) - 1
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407


# Toy token ids, for the prefix cache's block hashes. Vocabulary words keep their index, so
# generated text fed back (a chat's next turn) tokenizes to the ids the engine generated;
# any other piece gets a stable id from its CRC, and the chat template has its own ids.
TOY_VOCAB_SIZE = 32000
_WORD_IDS: dict[str, int] = {w.strip(): i for i, w in enumerate(VOCAB)}
_SPECIAL_START, _SPECIAL_SEP, _SPECIAL_END = TOY_VOCAB_SIZE - 1, TOY_VOCAB_SIZE - 2, TOY_VOCAB_SIZE - 3
_HASHED_IDS = TOY_VOCAB_SIZE - len(VOCAB) - 3


def count_text_tokens(text: str) -> int:
    """Word pieces and punctuation marks, each one token."""
    return len(_PIECE.findall(text))


def _piece_id(piece: str, _words: dict[str, int] = _WORD_IDS, _crc=zlib.crc32) -> int:
    i = _words.get(piece)
    return i if i is not None else len(VOCAB) + _crc(piece.encode()) % _HASHED_IDS


def text_token_ids(text: str) -> list[int]:
    """The toy tokenizer: one id per word piece or punctuation mark (``count_text_tokens`` ids)."""
    return [_piece_id(p) for p in _PIECE.findall(text)]


def chat_token_ids(messages: Iterable[tuple[str, list[str]]]) -> list[int]:
    """A rendered conversation's ids: per message ``<start> role <sep> content... <end>`` (4 template
    tokens), then the generation prompt ``<start> assistant <sep>`` (3), as the counts above say.

    ``messages`` holds (role, text pieces of the content) pairs.
    """
    ids: list[int] = []
    for role, texts in messages:
        ids += (_SPECIAL_START, _piece_id(role), _SPECIAL_SEP)
        for text in texts:
            ids += text_token_ids(text)
        ids.append(_SPECIAL_END)
    ids += (_SPECIAL_START, _piece_id("assistant"), _SPECIAL_SEP)
    return ids


def fingerprint(data: bytes) -> int:
    """A 64-bit digest of the prompt that seeds the output stream."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def initial_state(seed: int, prompt_fingerprint: int) -> int:
    """Generator state for one request: same (seed, prompt) gives the same text."""
    state = (prompt_fingerprint ^ (seed * 0x9E3779B97F4A7C15)) & _MASK64
    return (state * _LCG_A + _LCG_C) & _MASK64


def next_token(state: int) -> tuple[int, int]:
    """Advance the per-request LCG; returns (new_state, vocab index). Cheap by design."""
    state = (state * _LCG_A + _LCG_C) & _MASK64
    return state, state >> 58


def stop_token_ids(stop: list[str]) -> frozenset[int]:
    """Vocab entries that end generation: a stop string matches a whole generated word."""
    wanted = {s.strip() for s in stop if s.strip()}
    return frozenset(i for i, w in enumerate(VOCAB) if w.strip() in wanted)


def detokenize(token_ids: list[int]) -> str:
    return "".join([VOCAB[t] for t in token_ids])
