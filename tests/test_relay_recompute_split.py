"""The PD relay's recompute watch: whole events only go out, a "recomputed" marker split
across two reads is still found before any of its event reaches the client, and what a
continuation needs is kept as text, not as the stream's chunks."""

from __future__ import annotations

import asyncio
import json

import pytest

from dataplane.flows import recompute as rc_mod
from dataplane.flows.recompute import Recomputed, StreamText, generated_from_stream
from dataplane.flows.relay import relay_stream


def event(text: str, stop: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": None}
    if stop:
        choice["stop_reason"] = stop
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


class _Resp:
    """An engine answer read as ``engine_api.client.EngineResponse`` is: its chunks, in order."""

    def __init__(self, chunks):
        self._chunks = iter(chunks)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self):
        pass


class _Out:
    def __init__(self):
        self.data = b""

    async def write(self, data):
        self.data += data

    async def write_eof(self):
        pass


class _Tracker:
    completion_tokens = 0
    cached_tokens = -1

    def first_token(self):
        pass

    def stream_ended(self):
        pass

    def finished(self, n):
        self.completion_tokens = n


class _Req:
    is_chat = False


class _Ctx:
    def __init__(self, watch=True):
        self.out = _Out()
        self.tracker = _Tracker()
        self.watch_recompute = watch
        self.req = _Req()
        self.prior_tokens = 0


def split_everywhere(data: bytes, cut: int) -> list[bytes]:
    return [data[:cut], data[cut:]]


def test_marker_split_across_reads_is_found_before_its_event_goes_out():
    good = event("a") + event("b")
    bad = event("", stop="recomputed")
    stream = good + bad
    marker_at = stream.find(b'"recomputed"')
    for cut in range(len(good) + 1, marker_at + len(b'"recomputed"')):
        ctx = _Ctx()
        with pytest.raises(Recomputed) as info:
            asyncio.run(relay_stream(ctx, _Resp(split_everywhere(stream, cut)), "d"))
        assert ctx.out.data == good, cut          # nothing of the recomputed event went out
        assert generated_from_stream(info.value.forwarded) == ("ab", 2)


def test_event_split_across_reads_goes_out_whole_and_in_order():
    stream = event("x") + event("y") + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        ctx = _Ctx()
        asyncio.run(relay_stream(ctx, _Resp(split_everywhere(stream, cut)), "d"))
        assert ctx.out.data == stream
        assert ctx.tracker.completion_tokens == 2


def test_unwatched_stream_is_relayed_byte_for_byte():
    stream = event("x") + b"data: [DONE]\n\n"
    ctx = _Ctx(watch=False)
    asyncio.run(relay_stream(ctx, _Resp([stream[:5], stream[5:]]), "d"))
    assert ctx.out.data == stream


def test_stream_text_keeps_text_not_chunks(monkeypatch):
    monkeypatch.setattr(StreamText, "FOLD_BYTES", 200)
    st = StreamText()
    for i in range(100):
        st.add(event(str(i % 10)))
    assert st._size < 200 + len(event("0"))       # folded as it went
    text, tokens = st.result()
    assert text == "".join(str(i % 10) for i in range(100)) and tokens == 100
    assert rc_mod.generated_from_stream(event("q")) == ("q", 1)
