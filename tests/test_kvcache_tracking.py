"""When a worker's KV events cannot be trusted, the control plane says so and stops using them.

* a sequence gap too wide to replay resets the worker at once, without building the gap in memory
  (defect 10: a jump of 2*10^7 once cost ~700 MB and a 0.6 s stall);
* a subscriber whose receive loop dies is logged with its exception and the worker falls back to
  approximate tracking (no "Task exception was never retrieved");
* a malformed kv_events endpoint never raises out of ``watch`` (it runs in a background task);
* events whose ``block_size`` differs from ``[kv_cache] block_size`` are refused, loudly: checked
  end to end with simulated engines that publish real KV events.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import tracemalloc
from types import SimpleNamespace

import aiohttp
import pytest
import zmq
import zmq.asyncio

from controlplane.kvcache.events import BlockStored
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.kvcache.subscriber import KVEventSource, KVEventSubscriber
from omni_proxy.launcher import ProcessGroup
from tests.test_kvcache_subscriber import TOPIC, Publisher, Recorder, ReplayServer, batch, stored_map, until


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def _capture_loop_errors(seen: list[dict]) -> None:
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: seen.append(context))


# ---------------------------------------------------------------------------------------- defect 10

async def test_huge_sequence_jump_resets_without_replaying_or_allocating(ctx):
    pub, rec = Publisher(ctx), Recorder()
    rs = ReplayServer(ctx, pub, with_topic=True)
    sub = KVEventSubscriber(KVEventSource("eng-1", pub.endpoint, topic=TOPIC, replay_endpoint=rs.endpoint),
                            rec.handle, rec.reset, ctx=ctx)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await pub.send(batch(stored_map([1])))
        await until(lambda: len(rec.batches) == 1, "first batch")
        tracemalloc.start()
        try:
            pub.seq = 20_000_000                       # the engine's counter jumped by 2*10^7
            await pub.send(batch(stored_map([2])))
            await until(lambda: len(rec.batches) == 2, "the batch after the jump")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * 2**20, f"handling the jump allocated {peak / 2**20:.0f} MiB"
        assert rec.resets == ["eng-1"] and rec.hashes() == [1, 2]
        assert sub.counters.gaps == 1 and sub.counters.gaps_too_large == 1 and sub.counters.resets == 1
        assert rs.requests == [], "a gap no engine buffer can hold must not be asked for"
    finally:
        await sub.stop()
        await rs.close()
        pub.close()


async def test_gap_over_the_limit_resets_and_under_it_replays(ctx):
    pub, rec = Publisher(ctx), Recorder()
    rs = ReplayServer(ctx, pub, with_topic=False)
    sub = KVEventSubscriber(KVEventSource("eng-1", pub.endpoint, topic=TOPIC, replay_endpoint=rs.endpoint),
                            rec.handle, rec.reset, ctx=ctx, max_replay_gap=3)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await pub.send(batch(stored_map([1])))                 # seq 0
        for h in (2, 3):                                         # seqs 1-2 lost: a gap of 2, replayed
            await pub.send(batch(stored_map([h])), drop=True)
        await pub.send(batch(stored_map([4])))                 # seq 3
        await until(lambda: len(rec.batches) == 4, "replayed gap and live batch")
        assert rec.hashes() == [1, 2, 3, 4] and rec.resets == [] and rs.requests == [1]
        for h in (5, 6, 7, 8):                                   # seqs 4-7 lost: a gap of 4 > 3
            await pub.send(batch(stored_map([h])), drop=True)
        await pub.send(batch(stored_map([9])))                 # seq 8
        await until(lambda: len(rec.batches) == 5, "live batch after the reset")
        assert rec.hashes()[-1] == 9 and rec.resets == ["eng-1"] and rs.requests == [1]
        assert sub.counters.gaps == 2 and sub.counters.gaps_too_large == 1 and sub.counters.replayed == 2
    finally:
        await sub.stop()
        await rs.close()
        pub.close()


async def test_backfill_on_first_contact_is_bounded(ctx):
    pub, rec = Publisher(ctx), Recorder()
    rs = ReplayServer(ctx, pub, with_topic=False)
    for h in range(1, 11):                                       # seqs 0-9 before we subscribed
        await pub.send(batch(stored_map([h])), drop=True)
    sub = KVEventSubscriber(KVEventSource("eng-1", pub.endpoint, topic=TOPIC, replay_endpoint=rs.endpoint),
                            rec.handle, rec.reset, ctx=ctx, max_replay_gap=4)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await pub.send(batch(stored_map([11])))                # seq 10
        await until(lambda: len(rec.batches) == 5, "the last 4 batches and the live one")
        assert rs.requests == [6] and rec.hashes() == [7, 8, 9, 10, 11] and rec.resets == []
    finally:
        await sub.stop()
        await rs.close()
        pub.close()


# ---------------------------------------------------------------------------------------- defect 11

class _BrokenSocket:
    """Stands in for the SUB socket once the first message is in: every receive fails."""

    def __init__(self, real) -> None:
        self.real = real

    async def recv_multipart(self):
        raise zmq.ZMQError(zmq.ENOTSOCK)

    def close(self, linger: int = 0) -> None:
        self.real.close(linger=linger)


def _worker(wid: str, kv_events: str, dp_size: int = 1, kv_replay: str = ""):
    return SimpleNamespace(id=wid, kv_events=kv_events, kv_replay=kv_replay, dp_size=dp_size)


async def test_dead_subscriber_is_logged_and_worker_falls_back_to_approximate(ctx, caplog):
    seen: list[dict] = []
    _capture_loop_errors(seen)
    pub = Publisher(ctx)
    kv = KVCache(KVCacheConfig())
    worker = _worker("w-1", pub.endpoint)
    # the subscriber uses the process-wide zmq context; subscribe through the test's publisher
    await kv.watch(worker)
    try:
        await pub.wait_subscribed()
        (sub,) = kv._subscribers["w-1"]
        await pub.send(batch(stored_map([11, 12])))
        await until(lambda: kv.exact.blocks_by_worker().get("w-1") == 2, "first events applied")
        assert kv.match([11, 12], [worker]) == {"w-1": 2}

        sub._sub = _BrokenSocket(sub._sub)   # the next receive raises inside the task
        with caplog.at_level(logging.ERROR, logger="controlplane.kvcache"):
            await pub.send(batch(stored_map([13])))
            await until(lambda: not sub.running, "the subscriber task to end")
            await until(lambda: "w-1" in kv.untracked, "the worker to be marked untracked")
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("subscriber stopped" in r.getMessage() and r.exc_info for r in errors), caplog.text
        assert any("w-1" in r.getMessage() and "approximately" in r.getMessage() for r in errors), caplog.text
        assert kv.counters()["w-1"]["failed"] == 1
        assert not kv.tracked_exactly(worker) and "w-1" not in kv.exact.blocks_by_worker()
        kv.placed(worker, [21, 22, 23], 0)                     # routing-based tracking took over
        assert kv.match([21, 22, 23], [worker]) == {"w-1": 3}
    finally:
        await kv.stop()
        pub.close()
    gc.collect()
    await asyncio.sleep(0)
    assert not [c for c in seen if "exception" in c], seen


async def test_worker_registered_again_on_another_endpoint_is_followed_there(ctx):
    """An engine restarted on another address under the same id: its events are followed at the
    new endpoint, and what the old one said is gone (the restarted engine's cache is empty).
    Registering again with the same endpoints keeps the subscription and the index."""
    old, new = Publisher(ctx), Publisher(ctx)
    kv = KVCache(KVCacheConfig())
    try:
        await kv.watch(_worker("w-1", old.endpoint))
        await old.wait_subscribed()
        await old.send(batch(stored_map([11, 12])))
        await until(lambda: kv.exact.blocks_by_worker().get("w-1") == 2, "the old endpoint's events applied")
        (first,) = kv._subscribers["w-1"]

        await kv.watch(_worker("w-1", old.endpoint))          # the same endpoints: nothing changes
        assert kv._subscribers["w-1"] == [first] and kv.exact.blocks_by_worker().get("w-1") == 2

        await kv.watch(_worker("w-1", new.endpoint))
        assert not first.running
        assert "w-1" not in kv.exact.blocks_by_worker()
        await new.wait_subscribed()
        await new.send(batch(stored_map([31])))
        await until(lambda: kv.exact.blocks_by_worker().get("w-1") == 1, "the new endpoint's events applied")
        assert kv.match([31], [_worker("w-1", new.endpoint)]) == {"w-1": 1}

        await kv.watch(_worker("w-1", ""))                     # registered again without events
        assert "w-1" not in kv._subscribers and "w-1" not in kv.exact.blocks_by_worker()
    finally:
        await kv.stop()
        old.close()
        new.close()


@pytest.mark.parametrize("kv_events, dp_size", [("tcp://127.0.0.1", 1), ("ipc:///tmp/omni-kv-test", 2),
                                                ("tcp://127.0.0.1:65535", 2), ("http://127.0.0.1:5557", 1)])
async def test_malformed_endpoint_never_raises_from_watch(kv_events, dp_size, caplog):
    kv = KVCache(KVCacheConfig())
    worker = _worker("w-bad", kv_events, dp_size)
    with caplog.at_level(logging.ERROR, logger="controlplane.kvcache"):
        await kv.watch(worker)
    try:
        assert "w-bad" in kv.untracked and "w-bad" not in kv._subscribers
        assert kv.counters()["w-bad"]["subscribe_failed"] == 1
        assert any("w-bad" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        kv.placed(worker, [1, 2], 0)
        assert kv.match([1, 2], [worker]) == {"w-bad": 2}
    finally:
        await kv.stop()


def test_block_size_mismatch_refuses_events_until_they_match(caplog):
    kv = KVCache(KVCacheConfig(block_size=16))
    worker = _worker("w-1", "tcp://127.0.0.1:5557")
    wrong = BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=tuple(range(64)), block_size=32)
    right = BlockStored(block_hashes=(3,), parent_block_hash=None, token_ids=tuple(range(16)), block_size=16)
    with caplog.at_level(logging.ERROR, logger="controlplane.kvcache"):
        for _ in range(3):
            kv._on_events("w-1", 0, (wrong,))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "w-1" in lines[0] and "32" in lines[0] and "16" in lines[0], lines
    assert kv.counters()["w-1"]["block_size_mismatch"] == 3
    assert kv.exact.blocks_by_worker() == {} and not kv.tracked_exactly(worker)
    kv._on_events("w-1", 0, (right,))              # the engine restarted with the right size
    assert kv.tracked_exactly(worker) and kv.exact.blocks_by_worker() == {"w-1": 1}


# --------------------------------------------------------------------------- end to end, simulator

def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_engine_block_size_mismatch_is_refused_loudly(tmp_path):
    """One sim publishes events with block_size 32, one with 16; the control plane expects 16."""
    with ProcessGroup(str(tmp_path), ready_timeout=60) as group:
        sims = {}
        for name, block_size in (("sim32", 32), ("sim16", 16)):
            sims[name] = group.start(name, ["sim", "--port", "0", "--block-size", str(block_size),
                                            "--kv-events-endpoint", f"ipc://{tmp_path}/{name}.sock"])
        config = tmp_path / "cp.toml"
        config.write_text("[kv_cache]\nblock_size = 16\n" + "".join(
            f'[[workers]]\nid = "{name}"\nurl = "{sim.url}"\nkv_events = "ipc://{tmp_path}/{name}.sock"\n'
            for name, sim in sims.items()))
        cp = group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--config",
                                str(config)])
        metrics_url = f"http://127.0.0.1:{cp.info['http_port']}/metrics"
        async with aiohttp.ClientSession() as http:
            async def both_reported() -> bool:
                # PUB drops messages until the subscription has arrived: keep sending fresh prompts
                for sim in sims.values():
                    prompt = [int(x) for x in range(both_reported.n * 100, both_reported.n * 100 + 64)]
                    async with http.post(sim.url + "/v1/completions",
                                         json={"model": "sim-model", "prompt": prompt, "max_tokens": 1}) as r:
                        assert r.status == 200
                both_reported.n += 1
                async with http.get(metrics_url) as r:
                    text = await r.text()
                return (_metric(text, "omni_kv_events_total", worker="sim32", kind="block_size_mismatch") > 0
                        and _metric(text, "omni_kv_events_total", worker="sim16", kind="received") > 0)
            both_reported.n = 1

            deadline = asyncio.get_running_loop().time() + 30
            while not await both_reported():
                assert asyncio.get_running_loop().time() < deadline, cp.log_tail()
            async with http.get(metrics_url) as r:
                text = await r.text()
        assert _metric(text, "omni_kv_index_blocks", source="events") > 0      # sim16's events are used
        log = cp.log_path.read_text()
        errors = [ln for ln in log.splitlines() if " ERROR " in ln and "block_size" in ln]
        assert len(errors) == 1, log
        assert re.search(r"sim32\b.*block_size 32\b.*block_size is 16\b", errors[0]), errors[0]
        assert "sim16" not in errors[0] and "Traceback" not in log
