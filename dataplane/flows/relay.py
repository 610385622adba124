"""Relaying an engine's answer to the client: the per-chunk hot path.

Chunks go out as they arrive, byte for byte: no parsing, no re-encoding, no buffering
of the stream, and no per-chunk logging or allocation beyond what the engine client does.
"""

from __future__ import annotations

import asyncio
import re

import orjson

from dataplane.errors import sse_error_event
from dataplane.flows.context import FlowContext
from dataplane.flows.recompute import (RECOMPUTED, Recomputed, StreamText, is_recomputed, merge_prior,
                                       prefix_before_recompute)
from dataplane.messages import Response, StreamResponse
from dataplane.upstream import UpstreamError, read_body
from engine_api.client import EngineClientError, EngineResponse

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_USAGE = b'"usage"'
_EVENT_END = b"\n\n"


def _headers(resp: EngineResponse, ctx: FlowContext, content_type: str,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our response's headers. Engines are asked for identity encoding; one that encodes
    anyway has its Content-Encoding passed on, so the bytes are never mislabelled."""
    content, encoding = resp.content_headers()
    headers = {"Content-Type": content if content is not None else content_type, "X-Request-Id": ctx.req.echo_id}
    if encoding:
        headers["Content-Encoding"] = encoding
    if extra:
        headers.update(extra)
    return headers


async def relay_stream(ctx: FlowContext, resp: EngineResponse, worker_id: str, *,
                       on_first_chunk=None) -> StreamResponse:
    """Stream ``resp`` (SSE) to the client; report first token, end, and failures."""
    out = ctx.out
    tracker = ctx.tracker
    events = 0
    first = True
    watch = ctx.watch_recompute
    sent = StreamText() if watch else None   # what a recompute's continuation needs (None: not watching)
    tail = b""                               # watching: an event not yet whole, held back
    last = before_last = b""
    fresh = out is None
    if out is None:  # a recompute continuation keeps writing to the same response
        out = ctx.out = StreamResponse(status=200, headers=_headers(resp, ctx, "text/event-stream", {
            "Cache-Control": "no-cache"}))
    try:
        if fresh:
            await out.prepare(ctx.http)
        if sent is None and on_first_chunk is None:
            # Not watching for a recompute (aggregated): each chunk is written from the engine
            # connection's callback as it is parsed (EngineResponse.pipe), not by this
            # coroutine woken once per chunk (a future, a task step and __anext__ each).
            piped = _Piped(out, tracker)
            try:
                await resp.pipe(piped, piped.drain)
            finally:   # (a stream broken off reads what was written last)
                events, last, before_last = piped.events, piped.last, piped.before_last
        else:
            async for chunk in resp:
                if first:
                    first = False
                    tracker.first_token()
                    if on_first_chunk is not None:
                        on_first_chunk()
                if sent is not None:   # watching for a recompute
                    # Only whole events go out, so a "recomputed" marker split across two reads
                    # is found whole in the next one, before any of its event was sent.
                    if tail:
                        chunk, tail = tail + chunk, b""
                    events += chunk.count(_EVENT_END)
                    if RECOMPUTED in chunk:
                        before = prefix_before_recompute(chunk)
                        if before:
                            await out.write(before)
                            sent.add(before)
                        raise Recomputed(sent)
                    end = chunk.rfind(_EVENT_END)
                    end = end + 2 if end >= 0 else 0
                    if end < len(chunk):
                        chunk, tail = chunk[:end], chunk[end:]
                        if not chunk:
                            continue
                    sent.add(chunk)
                else:
                    events += chunk.count(_EVENT_END)
                if out.write_nowait(chunk):      # (no coroutine per chunk)
                    await out.drain()
                before_last, last = last, chunk
        if tail:   # the engine ended without a blank line after its last event
            await out.write(tail)
            before_last, last = last, tail
    except (TimeoutError, EngineClientError, ConnectionResetError) as exc:
        if isinstance(exc, ConnectionResetError) or ctx.http.transport is None or ctx.http.transport.is_closing():
            tracker.cancelled()
            ctx.metrics.cancelled.inc()
            return out
        timed_out = isinstance(exc, asyncio.TimeoutError)
        message = ctx.abort_reason or (f"worker {worker_id} timed out mid-stream: {exc}" if timed_out else
                                       f"worker {worker_id} broke off the stream: {type(exc).__name__} {exc}".strip())
        # 502, not 0: the engine answered and then broke off, which is a failed request (the
        # circuit breaker counts it), not proof that it is unreachable; a timeout is 504. The
        # client's error event and the control plane's report carry the same status.
        status = 504 if timed_out else 502
        tracker.failed(worker_id, message, status)
        ctx.metrics.upstream_errors.labels(worker_id, "stream").inc()
        try:
            # An engine cut mid-event left a partial line: end it, so the error is an event of its own.
            cut = b"" if not last or last.endswith(_EVENT_END) else _EVENT_END
            await out.write(cut + sse_error_event(status, message))
        except ConnectionResetError:
            pass
        return out
    finally:
        resp.close()
    tracker.stream_ended()
    # Every event but the final [DONE] (and, in chat, the first, role-only one) carries
    # one token; the engine's own count wins when it sent usage (include_usage), in the
    # last chunk or the one before [DONE]: read from those two chunks only, once per request.
    counted = max(events - (2 if ctx.req.is_chat else 1), 0)
    tracker.finished(_stream_usage(tracker, last, before_last, counted))
    tracker.completion_tokens += ctx.prior_tokens   # a recompute's earlier attempts
    try:
        await out.write_eof()
    except ConnectionResetError:
        pass
    return out


class _Piped:
    """``relay_stream``'s loop body for a chunk, as ``EngineResponse.pipe``'s sink: the first
    token reported, the events counted, the chunk written, the last two kept (usage). A
    client that is gone, or reads slower than we write, makes it return True: ``drain``
    then raises the one or waits for the other, in the relay's coroutine."""

    __slots__ = ("out", "tracker", "first", "events", "last", "before_last", "error")

    def __init__(self, out: StreamResponse, tracker) -> None:
        self.out = out
        self.tracker = tracker
        self.first = True
        self.events = 0
        self.last = self.before_last = b""
        self.error: BaseException | None = None

    def __call__(self, chunk: bytes) -> bool:
        if self.error is not None:
            return True
        try:
            if self.first:
                self.first = False
                self.tracker.first_token()
            self.events += chunk.count(_EVENT_END)
            paused = self.out.write_nowait(chunk)
        except Exception as exc:   # (raised in the relay's coroutine by drain, not in the engine's parser)
            self.error = exc
            return True
        self.before_last, self.last = self.last, chunk
        return paused

    async def drain(self) -> None:
        if self.error is not None:
            raise self.error
        await self.out.drain()


def _stream_usage(tracker, last: bytes, before_last: bytes, counted: int) -> int:
    """Completion tokens of a finished stream; cached tokens from its usage, when sent."""
    for chunk in (last, before_last):
        at = chunk.rfind(_USAGE)
        if at >= 0:
            m = _COMPLETION_TOKENS.search(chunk, at)
            if m is not None:
                c = _CACHED_TOKENS.search(chunk, at)
                if c is not None:
                    tracker.cached_tokens = int(c.group(1))
                return int(m.group(1))
    return counted


async def relay_json(ctx: FlowContext, resp: EngineResponse, worker_id: str) -> Response:
    """Pass a non-streamed answer through unchanged."""
    data = resp.body_at_hand()    # (the common case: it came with the head)
    if data is None:
        try:
            data = await read_body(worker_id, resp)
        except UpstreamError as exc:
            if ctx.abort_reason:  # the flow closed this leg on purpose; say why
                raise UpstreamError(worker_id, ctx.abort_reason, exc.upstream_status) from None
            raise
    tracker = ctx.tracker
    tracker.first_token(streamed=False)
    if ctx.watch_recompute and RECOMPUTED in data:
        obj = orjson.loads(data)
        if is_recomputed((obj.get("choices") or [{}])[0]):
            raise Recomputed(response=obj)
    if ctx.prior_text or ctx.prior_tokens:
        data = merge_prior(data, ctx.prior_text, ctx.prior_tokens)
    at = data.rfind(_USAGE)
    m = None
    if at >= 0:
        m = _COMPLETION_TOKENS.search(data, at)
        c = _CACHED_TOKENS.search(data, at)
        if c is not None:
            tracker.cached_tokens = int(c.group(1))
    tracker.finished(int(m.group(1)) if m else 0)
    return Response.owning(200, data, _headers(resp, ctx, "application/json"))


async def relay(ctx: FlowContext, resp: EngineResponse, worker_id: str, *,
                on_first_chunk=None) -> Response | StreamResponse:
    if ctx.req.stream:
        return await relay_stream(ctx, resp, worker_id, on_first_chunk=on_first_chunk)
    if on_first_chunk is not None:
        on_first_chunk()
    return await relay_json(ctx, resp, worker_id)
