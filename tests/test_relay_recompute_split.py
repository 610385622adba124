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

    async def pipe(self, sink, drain):
        """``EngineResponse.pipe``: each chunk to ``sink``; ``drain()`` when it asks."""
        for chunk in self._chunks:
            if sink(chunk):
                await drain()

    def close(self):
        pass


class _Out:
    def __init__(self):
        self.data = b""

    async def write(self, data):
        self.data += data

    def write_nowait(self, data) -> bool:
        """The relay's per-chunk write (``StreamResponse.write_nowait``): never paused here."""
        self.data += data
        return False

    async def drain(self):
        pass

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


def test_recompute_loop_replaces_and_ends_a_non_streamed_answer_by_length(monkeypatch):
    """dataplane.flows.recompute.run_recomputing (the loop that lived in app.py): D gives the
    request back twice; each continuation is re-hashed and placed again; when the earlier
    attempts already produced max_tokens the answer ends there, an OpenAI completion object
    finished by length with every attempt's text and token count."""
    import orjson
    from dataplane.requests import ClientRequest
    from protos import omni_proxy_pb2 as pb

    req = ClientRequest(path="/v1/completions", raw=b"", body={"prompt": "p", "max_tokens": 4}, model="m",
                        stream=False, max_tokens=4, request_id="r0", placement_id="p0", client_id="client-id",
                        prompt_tokens=3)
    placed, hashed = [], []

    class Tracker(_Tracker):
        def continue_as(self, nxt, tokens):
            pass

    class Counter:
        def inc(self):
            self.n = getattr(self, "n", 0) + 1

    metrics = type("M", (), {"recomputes": Counter()})()
    ctx = type("Ctx", (), {})()
    ctx.req, ctx.tracker, ctx.metrics, ctx.out, ctx.placements = req, Tracker(), metrics, None, object()
    ctx.prior_text, ctx.prior_tokens = "", 0
    answers = iter([("ab", 2), ("cd", 2)])

    async def flow(c, placement):
        text, n = next(answers)
        raise Recomputed(response={"choices": [{"text": text}], "usage": {"completion_tokens": n}})

    async def fake_place(placements, nxt, leg):
        placed.append(nxt)
        return pb.Placement(flow=pb.FLOW_SEQUENTIAL)

    async def rehash(nxt):
        hashed.append(nxt)

    monkeypatch.setattr(rc_mod, "place", fake_place)
    resp = asyncio.run(rc_mod.run_recomputing(ctx, pb.Placement(flow=pb.FLOW_SEQUENTIAL), flow,
                                              flows={pb.FLOW_SEQUENTIAL: ("sequential", flow)},
                                              rehash=rehash, encoder=lambda: None))
    assert metrics.recomputes.n == 2 and len(placed) == 1 and hashed == placed
    assert placed[0].body["prompt"] == "pab" and placed[0].max_tokens == 2
    body = orjson.loads(resp.body)
    assert body["object"] == "text_completion" and body["id"] == placed[0].request_id, body
    assert body["choices"] == [{"index": 0, "text": "abcd", "finish_reason": "length"}], body
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, body
    assert ctx.tracker.completion_tokens == 4 and resp.headers["X-Request-Id"] == "client-id"
    assert req.body["prompt"] == "p" and req.max_tokens == 4   # the client's request is not changed in place
