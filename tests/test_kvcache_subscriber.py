"""KV-event subscriber against real in-process ZMQ publishers / ROUTER replay servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from controlplane.kvcache.index import PrefixIndex
from controlplane.kvcache.subscriber import END_SEQ, KVEventSource, KVEventSubscriber

TOPIC = b"kv-events"


async def until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def stored_map(hashes, parent=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [1] * 16 * len(hashes), "block_size": 16, "medium": "GPU", "group_idx": 0}


def stored_arr(hashes, parent=None):
    return ["BlockStored", hashes, parent, [1] * 16 * len(hashes), 16, None, "GPU", None, None, 0]


def batch(*events, dp=0) -> bytes:
    return msgpack.packb([time.time(), list(events), dp], use_bin_type=True)


class Publisher:
    """Stand-in for vLLM's ZmqEventPublisher (XPUB so the test can wait for the subscription)."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = TOPIC, connect_to: str | None = None) -> None:
        self.topic = topic
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if connect_to:
            self.sock.connect(connect_to)
            self.endpoint = connect_to
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.buffer: dict[int, bytes] = {}

    async def wait_subscribed(self) -> None:
        assert await self.sock.poll(5000), "subscriber never subscribed"
        msg = await self.sock.recv()
        assert msg[:1] == b"\x01"

    async def send(self, payload: bytes, *, drop: bool = False) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer[seq] = payload
        if not drop:
            await self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


class ReplayServer:
    """vLLM's ROUTER replay service: [id, b"", start] -> [id, b"", (topic)?, seq, payload]..., END."""

    def __init__(self, ctx: zmq.asyncio.Context, pub: Publisher, *, with_topic: bool, keep_from: int = 0) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.pub, self.with_topic, self.keep_from = pub, with_topic, keep_from
        self.requests: list[int] = []
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            cid, empty, start_b = await self.sock.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.requests.append(start)
            for seq in sorted(self.pub.buffer):
                if seq >= max(start, self.keep_from):
                    head = [cid, b""] + ([self.pub.topic] if self.with_topic else [])
                    await self.sock.send_multipart(head + [seq.to_bytes(8, "big"), self.pub.buffer[seq]])
            await self.sock.send_multipart([cid, b""] + ([self.pub.topic] if self.with_topic else [])
                                           + [END_SEQ, b""])

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        self.sock.close(linger=0)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[str, int | None, tuple]] = []
        self.resets: list[str] = []

    def handle(self, engine, dp, events) -> None:
        self.batches.append((engine, dp, events))

    async def reset(self, engine) -> None:   # async on purpose: both kinds must work
        self.resets.append(engine)

    def hashes(self) -> list[int]:
        return [h for _, _, evs in self.batches for ev in evs if isinstance(ev, BlockStored) for h in ev.block_hashes]


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def start_sub(ctx, pub, rec, **kw) -> KVEventSubscriber:
    src_kw = {k: kw.pop(k) for k in ("replay_endpoint",) if k in kw}
    sub = KVEventSubscriber(KVEventSource("eng-1", pub.endpoint, topic=TOPIC, **src_kw), rec.handle, rec.reset,
                            ctx=ctx, **kw)
    await sub.start()
    await pub.wait_subscribed()
    return sub


async def test_in_order_stream_both_encodings(ctx):
    pub, rec = Publisher(ctx), Recorder()
    sub = await start_sub(ctx, pub, rec)
    await pub.send(batch(stored_map([1, 2]), dp=0))
    await pub.send(batch(stored_arr([3], parent=2), ["BlockRemoved", [1], "GPU", 0], dp=1))
    await pub.send(msgpack.packb({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 0}))
    await until(lambda: len(rec.batches) == 3, "three batches")
    assert rec.hashes() == [1, 2, 3]
    assert rec.batches[1][0] == "eng-1" and rec.batches[1][1] == 1
    assert rec.batches[1][2][1] == BlockRemoved(block_hashes=(1,), medium="GPU", group_idx=0)
    assert rec.batches[2][2] == (AllBlocksCleared(),)
    c = sub.counters
    assert (c.received, c.gaps, c.resets, c.malformed, c.replayed) == (3, 0, 0, 0, 0) and not rec.resets
    await sub.stop()
    pub.close()


async def test_gap_without_replay_resets_engine(ctx):
    pub, rec = Publisher(ctx), Recorder()
    index = PrefixIndex()
    rec_handle = rec.handle

    def handle(engine, dp, events):
        rec_handle(engine, dp, events)
        index.apply(engine, dp, events)

    rec.handle = handle
    sub = KVEventSubscriber(KVEventSource("eng-1", pub.endpoint, topic=TOPIC), handle,
                            lambda e: (rec.resets.append(e), index.reset_worker(e)), ctx=ctx)
    await sub.start()
    await pub.wait_subscribed()
    await pub.send(batch(stored_map([1, 2])))
    await pub.send(batch(stored_map([3], parent=2)), drop=True)
    await pub.send(batch(stored_map([10])))
    await until(lambda: len(rec.batches) == 2, "batch after the gap")
    assert rec.resets == ["eng-1"]
    assert sub.counters.gaps == 1 and sub.counters.resets == 1 and sub.counters.replayed == 0
    assert index.match_depths([1, 2]) == {} and index.match_depths([10]) == {("eng-1", 0): 1}
    await sub.stop()
    pub.close()


@pytest.mark.parametrize("with_topic", [True, False])
async def test_gap_recovered_by_replay(ctx, with_topic):
    pub, rec = Publisher(ctx), Recorder()
    rs = ReplayServer(ctx, pub, with_topic=with_topic)
    sub = await start_sub(ctx, pub, rec, replay_endpoint=rs.endpoint)
    await pub.send(batch(stored_map([1])))
    await pub.send(batch(stored_map([2], parent=1)), drop=True)
    await pub.send(batch(stored_arr([3], parent=2)), drop=True)
    await pub.send(batch(stored_map([4], parent=3)))
    await until(lambda: len(rec.batches) == 4, "replayed and live batches")
    assert rec.hashes() == [1, 2, 3, 4]          # replayed batches are applied in order, before seq 3
    assert rs.requests == [1]
    c = sub.counters
    assert (c.gaps, c.replayed, c.resets, c.received) == (1, 2, 0, 2) and not rec.resets
    await sub.stop()
    await rs.close()
    pub.close()


async def test_replay_buffer_rolled_over_resets_then_applies_what_it_has(ctx):
    pub, rec = Publisher(ctx), Recorder()
    rs = ReplayServer(ctx, pub, with_topic=True, keep_from=2)   # seq 1 is gone from the engine's buffer
    sub = await start_sub(ctx, pub, rec, replay_endpoint=rs.endpoint)
    await pub.send(batch(stored_map([1])))
    await pub.send(batch(stored_map([2])), drop=True)
    await pub.send(batch(stored_map([3])), drop=True)
    await pub.send(batch(stored_map([4])))
    await until(lambda: len(rec.batches) == 3, "partial replay and live batch")
    assert rec.resets == ["eng-1"] and rec.hashes() == [1, 3, 4]
    assert sub.counters.resets == 1 and sub.counters.replayed == 1
    await sub.stop()
    await rs.close()
    pub.close()


async def test_replay_endpoint_silent_times_out_and_resets(ctx):
    pub, rec = Publisher(ctx), Recorder()
    dead = ctx.socket(zmq.ROUTER)            # bound but never answers
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    sub = await start_sub(ctx, pub, rec, replay_endpoint=f"tcp://127.0.0.1:{port}", replay_timeout_s=0.3)
    await pub.send(batch(stored_map([1])))
    await pub.send(batch(stored_map([2])), drop=True)
    await pub.send(batch(stored_map([3])))
    await until(lambda: len(rec.batches) == 2, "batch after the failed replay")
    assert rec.resets == ["eng-1"] and rec.hashes() == [1, 3] and sub.counters.replayed == 0
    await sub.stop()
    dead.close(linger=0)
    pub.close()


async def test_backfill_on_first_contact(ctx):
    pub, rec = Publisher(ctx), Recorder()
    rs = ReplayServer(ctx, pub, with_topic=False)
    await pub.send(batch(stored_map([1])), drop=True)       # published before we subscribed
    await pub.send(batch(stored_map([2], parent=1)), drop=True)
    sub = await start_sub(ctx, pub, rec, replay_endpoint=rs.endpoint)
    await pub.send(batch(stored_map([3], parent=2)))
    await until(lambda: len(rec.batches) == 3, "backfilled batches")
    assert rec.hashes() == [1, 2, 3] and rs.requests == [0]
    assert sub.counters.gaps == 0 and sub.counters.resets == 0 and sub.counters.replayed == 2
    await sub.stop()
    await rs.close()
    pub.close()


async def test_seq_going_back_is_an_engine_restart(ctx):
    pub, rec = Publisher(ctx), Recorder()
    sub = await start_sub(ctx, pub, rec)
    await pub.send(batch(stored_map([1])))
    await pub.send(batch(stored_map([2])))
    pub.seq = 0                                             # engine restarted
    await pub.send(batch(stored_map([7])))
    await until(lambda: len(rec.batches) == 3, "batch after restart")
    assert rec.resets == ["eng-1"] and sub.counters.resets == 1 and sub.counters.gaps == 0
    await sub.stop()
    pub.close()


async def test_malformed_frames_are_counted_not_fatal(ctx):
    pub, rec = Publisher(ctx), Recorder()
    sub = await start_sub(ctx, pub, rec)

    def boom(engine, dp, events):
        if any(isinstance(e, BlockStored) and 666 in e.block_hashes for e in events):
            raise RuntimeError("handler bug")
        rec.handle(engine, dp, events)

    sub.handler = boom
    await pub.send(b"\xc1 not msgpack")                                    # seq 0: bad payload
    await pub.send_raw([TOPIC, b"\x00\x01", batch(stored_map([5]))])      # short seq frame
    await pub.send_raw([TOPIC, b"only two frames"])
    await pub.send(msgpack.packb([1.0, [["BlockStored", ["x"], None, [], 16]]]))  # seq 1: bad hash
    await pub.send(batch(stored_map([666])))                               # seq 2: handler raises
    await pub.send(batch(stored_map([1]), {"type": "FutureEvent"}))        # seq 3: fine
    await until(lambda: len(rec.batches) == 1, "good batch after bad ones")
    c = sub.counters
    assert (c.malformed, c.handler_errors, c.gaps, c.resets, c.ignored_events) == (4, 1, 0, 0, 1)
    assert rec.hashes() == [1]
    await sub.stop()
    pub.close()


async def test_bind_mode_many_engines_keyed_by_topic(ctx):
    rec = Recorder()
    sub = KVEventSubscriber(KVEventSource("unused", "tcp://127.0.0.1:*", bind=True, topic=b"kv@",
                                          key_by_topic=True), rec.handle, rec.reset, ctx=ctx)
    await sub.start()
    assert sub.endpoint and sub.endpoint.startswith("tcp://127.0.0.1:")
    pa = Publisher(ctx, topic=b"kv@pod-a@m", connect_to=sub.endpoint)
    pb = Publisher(ctx, topic=b"kv@pod-b@m", connect_to=sub.endpoint)
    await pa.wait_subscribed()
    await pb.wait_subscribed()
    for i in range(3):                      # interleaved: independent seqs per engine, no false gaps
        await pa.send(batch(stored_map([100 + i])))
        await pb.send(batch(stored_map([200 + i])))
    await until(lambda: len(rec.batches) == 6, "six batches")
    by = {}
    for eng, _, evs in rec.batches:
        by.setdefault(eng, []).extend(evs[0].block_hashes)
    assert by == {"kv@pod-a@m": [100, 101, 102], "kv@pod-b@m": [200, 201, 202]}
    assert sub.counters.gaps == 0 and sub.counters.resets == 0
    with pytest.raises(ValueError):
        KVEventSubscriber(KVEventSource("x", "tcp://127.0.0.1:*", bind=True, key_by_topic=True,
                                        replay_endpoint="tcp://127.0.0.1:1"), rec.handle, rec.reset, ctx=ctx)
    await sub.stop()
    pa.close()
    pb.close()
