"""The encode pool hands a call's slices to its threads and gives the caller one answer.

The caller is woken once, when the call's last slice is done (not once per slice), so the
encodings must come back in order however the slices finished; a failing slice and a pool
closed under a waiting call must still wake it. Orderings and barriers, no timings.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from dataplane.encode_pool import EncodePool

GATE_S = 10.0     # a gate that is never opened fails the test instead of hanging it


def test_slices_finished_out_of_order_come_back_in_the_calls_order():
    done: list[str] = []
    others_done = threading.Event()

    def encode_batch(texts, add_special_tokens=True):  # type: ignore[no-untyped-def]
        if texts[0] == "a":
            assert others_done.wait(GATE_S)          # the first slice ends last
        done.append(texts[0])
        if len(done) == 5:
            others_done.set()
        return [t.upper() for t in texts]

    pool = EncodePool(encode_batch, workers=2, slice_chars=1)
    try:
        assert pool.encode_batch(list("abcdef")) == list("ABCDEF")
    finally:
        pool.close()
    assert done[-1] == "a"


def test_a_failing_slice_raises_in_the_caller_and_the_pool_goes_on():
    def encode_batch(texts, add_special_tokens=True):  # type: ignore[no-untyped-def]
        if "bad" in texts:
            raise ValueError("no such piece")
        return list(texts)

    pool = EncodePool(encode_batch, workers=2, slice_chars=1)
    try:
        with pytest.raises(ValueError, match="no such piece"):
            pool.encode_batch(["x", "bad", "y"])
        assert pool.encode_batch(["p", "q"]) == ["p", "q"]
    finally:
        pool.close()


def test_closing_the_pool_wakes_a_waiting_call_with_cancelled_error():
    entered, gate = threading.Event(), threading.Event()

    def encode_batch(texts, add_special_tokens=True):  # type: ignore[no-untyped-def]
        entered.set()
        gate.wait(GATE_S)
        return list(texts)

    pool = EncodePool(encode_batch, workers=1, slice_chars=1)
    with ThreadPoolExecutor(2) as callers:
        try:
            first = callers.submit(pool.encode_batch, ["held"])
            assert entered.wait(GATE_S)
            second = callers.submit(pool.encode_batch, ["queued", "too"])
            deadline = time.monotonic() + GATE_S     # until its slices are queued behind the held one
            while len(pool._heap) < 2 and time.monotonic() < deadline:
                threading.Event().wait(0.005)
            assert len(pool._heap) == 2
            pool.close()
            with pytest.raises(CancelledError):
                second.result(GATE_S)
        finally:
            gate.set()
            pool.close()
        assert first.result(GATE_S) == ["held"]     # the slice in progress still ends
