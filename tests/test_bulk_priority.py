"""Bulk work runs below the event loop's CPU priority (issue 19: the loop waited for a core behind it).

The encode pool's threads and the block-hashing process lower themselves (a nice increment or
SCHED_IDLE); the thread that hands them work, like the data plane's loop, keeps its priority.
Read from the kernel (``os.getpriority`` / ``os.sched_getscheduler`` on each thread's id).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import pytest

from dataplane import bulk_priority
from dataplane.encode_pool import EncodePool
from dataplane.prefix import PROCESS_MIN_BLOCKS, PrefixHasher
from protos import omni_proxy_pb2 as pb

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def echo(texts, **_kw):  # type: ignore[no-untyped-def]
    return list(texts)


def test_the_encode_threads_run_at_a_lower_nice_and_the_caller_does_not():
    me = threading.get_native_id()
    base = nice_of(me)
    pool = EncodePool(echo, 2, slice_chars=10, priority=7)
    try:
        assert pool.encode_batch(["a" * 20, "b" * 20, "c"]) == ["a" * 20, "b" * 20, "c"]
        assert len(pool._threads) == 2
        assert [nice_of(t.native_id) for t in pool._threads] == [min(19, base + 7)] * 2   # type: ignore[arg-type]
        assert nice_of(me) == base
    finally:
        pool.close()


def test_idle_puts_the_encode_threads_in_sched_idle():
    pool = EncodePool(echo, 1, priority=bulk_priority.IDLE)
    try:
        pool.encode_batch(["x"])
        assert os.sched_getscheduler(pool._threads[0].native_id) == os.SCHED_IDLE   # type: ignore[arg-type]
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
    finally:
        pool.close()


def test_zero_leaves_the_encode_threads_at_the_callers_priority():
    base = nice_of(threading.get_native_id())
    pool = EncodePool(echo, 1, priority=0)
    try:
        pool.encode_batch(["x"])
        assert nice_of(pool._threads[0].native_id) == base   # type: ignore[arg-type]
    finally:
        pool.close()


async def test_the_hashing_process_runs_at_a_lower_nice():
    base = nice_of(os.getpid())
    hasher = PrefixHasher(priority=5)
    try:
        cfg = pb.KVHashConfig(enabled=True, block_size=16, algo="sha256", seed="0", seed_set=True)
        ids = list(range((PROCESS_MIN_BLOCKS + 4) * 16 + 1))
        chain = await hasher.chain(cfg, ids, None)
        assert len(chain) == PROCESS_MIN_BLOCKS + 4
        pool = hasher.process._pool
        assert pool is not None, "the chain was not hashed in the process"
        pids = list(pool._processes)   # type: ignore[attr-defined]
        assert len(pids) == 1
        assert nice_of(pids[0]) == min(19, base + 5)
        assert nice_of(os.getpid()) == base
    finally:
        hasher.close()


@pytest.mark.parametrize("text", ["20", "-1", "low", "", "1.5"])
def test_a_bad_value_is_refused_naming_what_is_allowed(text):
    with pytest.raises(argparse.ArgumentTypeError, match="0 to 19, or 'idle'"):
        bulk_priority.parse(text)


def test_good_values_parse():
    assert bulk_priority.parse("0") == 0
    assert bulk_priority.parse("19") == 19
    assert bulk_priority.parse("IDLE") == bulk_priority.IDLE
