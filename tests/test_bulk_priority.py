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
from tests.conftest import child_pids, start_cluster, wait_until
from tests.data.tokenizer.fixture_dirs import build

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


BULK_NICE = 7


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build("tiny_llama", tmp_path_factory.mktemp("tok") / "tiny_llama")


@pytest.fixture(scope="module")
def lowered_cluster(tok_dir):
    c = start_cluster({"a": "both"}, policy="cache_aware",
                      dp_args=["--tokenizer", str(tok_dir), "--bulk-nice", str(BULK_NICE)])
    yield c
    c.group.close()


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


def _nice(stat_path: str) -> int:
    """The nice value field of a /proc .../stat file (the 19th; the name in parentheses may hold spaces)."""
    with open(stat_path) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])



async def test_a_data_planes_bulk_work_runs_at_its_bulk_nice(lowered_cluster, tok_dir, http):
    """A data plane started with --bulk-nice 7, after a prompt long enough for the encode
    threads and the block-hashing process: those threads and that process run at the data
    plane's nice + 7, its main (event-loop) thread at its own, and no other thread is lowered
    (the ones that run Python holding the GIL stay at the loop's priority)."""
    from bench.tracedata import block_text
    from dataplane.tokenizer import Tokenizer, default_workers

    cluster = lowered_cluster
    await wait_until(cluster.all_idle, what="idle")
    tok = Tokenizer.from_dir(tok_dir)
    text, k = "", 0
    while len(tok.encode_prompt(text)) <= (PROCESS_MIN_BLOCKS + 8) * 16:   # hashed in the process
        text += block_text(7_000_000 + k, 4000)
        k += 1
    tok.close()
    async with http.post(cluster.url + "/v1/completions",
                         json={"model": "sim-model", "prompt": text, "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()
    pid = cluster.dp.proc.pid
    base = _nice(f"/proc/{pid}/stat")
    threads = {int(t): _nice(f"/proc/{pid}/task/{t}/stat") for t in os.listdir(f"/proc/{pid}/task")}
    assert threads[pid] == base                          # the event loop's thread
    lowered = [t for t, n in threads.items() if n == min(19, base + BULK_NICE)]
    assert len(lowered) == default_workers(), threads    # the encode threads, and only they
    assert set(threads.values()) == {base, min(19, base + BULK_NICE)}, threads
    hashing = []
    for child in child_pids(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                hashing.append(child)
    assert len(hashing) == 1
    assert _nice(f"/proc/{hashing[0]}/stat") == min(19, base + BULK_NICE)
