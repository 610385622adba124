"""The tokenizer's encoding threads: a long prompt's pieces in slices, the earliest expected end first.

A burst of long prompts (issue 19) used to go to the Rust tokenizer's rayon pool one
``encode_batch_fast`` call per prompt. Rayon's workers finish the work they have split before
they take a new call, so a 10k-token prompt that arrived during a 70k-token one waited for all
of it (~35 ms of two idle cores), and a third prompt waited in line behind both. Here the
pieces of each call (``dataplane.prefix_ids`` cuts a text at exact boundaries) are grouped into
slices of about ``slice_chars`` and queued by the call's expected end if it ran alone: when it
came plus its size times ``s_per_char`` (about one core's encode time). Each slice runs on one
of ``workers`` threads (one per core) with rayon off (``TOKENIZERS_PARALLELISM=false``: the
encode runs in the calling thread, GIL released). A short prompt that comes while a long one
is encoded thus starts as soon as a slice ends (~2-3 ms of CPU at 8k characters), and one
long prompt alone still gets every core, slice by slice. Shortest first by size alone starved
the long prompts while a loaded host kept shorter ones coming (``bench/burst.py`` at 2x, host
load 10: tokenized p99 2.5-4.0 s against 0.8-1.0 s first come, first served); with the arrival
time in the key a prompt is passed only by prompts that came less than its own expected encode
time after it.

The threads can run below the event loop's CPU priority (``priority``, the data plane's
``--bulk-nice``; :mod:`dataplane.bulk_priority`, off by default: measured, it did not pay).

The caller waits (not holding the GIL) and gets the encodings in order, as one batch call would
give them; it reads their ids itself. Pieces stay whole, so the ids are exactly the batch's.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

from dataplane.bulk_priority import BulkPriority, lower_this_thread

# About 3,500 tokens of English-like text: a slice is ~2-3 ms of one core's CPU, the longest
# a short prompt waits for a thread in a burst. Each slice costs a thread wake-up and a GIL
# acquisition; 4,096 cost the data plane 0.3-1.2 ms more CPU per request at 2x (bench/burst.py,
# docs/benchmarks/burst_text.md) with no clear gain in latency.
DEFAULT_SLICE_CHARS = 8192
# The key's weight of a character: ~0.5 µs, one core's encode of DeepSeek's tokenizer (about
# 1 µs a token, 2.3 characters a token, pieces 0.7x).
DEFAULT_S_PER_CHAR = 0.5e-6

EncodeBatch = Callable[..., Sequence[Any]]   # tokenizers' encode_batch_fast: (texts, add_special_tokens=)


def rayon_off() -> None:
    """The threads here are the parallelism: each encode runs on its caller, not on rayon's
    pool as well (which would take one call's work at a time again). An operator's explicit
    ``TOKENIZERS_PARALLELISM`` is kept."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def slices(texts: Sequence[str], slice_chars: int) -> list[list[str]]:
    """Consecutive texts grouped into slices of at least ``slice_chars`` (the last may be less)."""
    out: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= slice_chars:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


class _Call:
    """One ``encode_batch`` call's slices: their encodings by index, and one event set when the
    last is done (or one failed, or the pool closed). The caller wakes once per call, not once
    per slice: each wake is a thread switch and a GIL acquisition, and a 70k-token prompt has
    ~20 slices."""

    __slots__ = ("results", "left", "error", "done")

    def __init__(self, slices: int) -> None:
        self.results: list[Sequence[Any] | None] = [None] * slices
        self.left = slices
        self.error: BaseException | None = None
        self.done = threading.Event()


class EncodePool:
    """``workers`` threads (started on first use) that encode slices, the call with the
    earliest expected end (arrival + size x ``s_per_char``) first; the threads run at
    ``priority`` (a nice increment or ``"idle"``, :mod:`dataplane.bulk_priority`)."""

    def __init__(self, encode_batch: EncodeBatch, workers: int, *,
                 slice_chars: int = DEFAULT_SLICE_CHARS, s_per_char: float = DEFAULT_S_PER_CHAR,
                 clock: Callable[[], float] = time.monotonic, priority: BulkPriority = 0) -> None:
        self._encode_batch = encode_batch
        self.priority = priority
        self.workers = workers
        self.slice_chars = slice_chars
        self.s_per_char = s_per_char
        self._clock = clock
        self._heap: list[tuple[float, int, list[str], bool, _Call, int]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[Any]:
        """``encode_batch(texts)``'s encodings, in order; this thread waits (GIL released)."""
        groups = slices(texts, self.slice_chars)
        key = self._clock() + sum(map(len, texts)) * self.s_per_char
        call = _Call(len(groups))
        with self._cv:
            if self._closed:
                return list(self._encode_batch(list(texts), add_special_tokens=add_special_tokens))
            self._start()
            for i, group in enumerate(groups):
                heapq.heappush(self._heap, (key, next(self._seq), group, add_special_tokens, call, i))
            self._cv.notify(len(groups))
        call.done.wait()
        if call.error is not None:
            raise call.error
        out: list[Any] = []
        for part in call.results:
            out += part   # type: ignore[arg-type]   # every slice is done
        return out

    def close(self) -> None:
        """Stop the threads; calls with slices not started get CancelledError."""
        with self._cv:
            self._closed = True
            for *_, call, _i in self._heap:
                if call.error is None:
                    call.error = CancelledError()
                call.done.set()
            self._heap.clear()
            self._cv.notify_all()

    def _start(self) -> None:
        while len(self._threads) < self.workers:
            t = threading.Thread(target=self._run, name=f"omni-encode_{len(self._threads)}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self) -> None:
        lower_this_thread(self.priority)
        finished: _Call | None = None      # counted down under the lock taken for the next slice
        while True:
            with self._cv:
                if finished is not None:
                    finished.left -= 1
                    if finished.left == 0:
                        finished.done.set()
                    finished = None
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                _, _, group, special, call, i = heapq.heappop(self._heap)
            if call.done.is_set():      # another slice of the call failed: skip the rest
                continue
            try:
                call.results[i] = self._encode_batch(group, add_special_tokens=special)
            except BaseException as exc:   # noqa: BLE001 - the caller gets it, as from the batch call
                call.error = exc
                call.done.set()
                continue
            finished = call
