"""Malformed gRPC messages answer INVALID_ARGUMENT with one log line, not UNKNOWN and a traceback.

gRPC's Python server decodes a request with the method's ``request_deserializer`` inside its
own machinery: bytes that are not a valid message raise ``DecodeError`` there, the client is
told ``UNKNOWN`` ("Unexpected <class 'DecodeError'>") and the server logs a full traceback for
every such message. :class:`MalformedMessageGuard` is a server interceptor that hands each
method's handler to gRPC without a deserializer (gRPC then passes the raw bytes through) and
decodes them itself: a message that does not decode is refused with ``INVALID_ARGUMENT``
naming the message type, and logged as one WARNING line. Streamed requests (the data plane's
``Session``) are decoded message by message; a bad one ends that call the same way.

Valid messages cost one extra Python call each (the decode gRPC would have made anyway is
now made here).

It also holds each method to its size (``protos.options.max_request_bytes``): a message over
it is refused with ``RESOURCE_EXHAUSTED`` before it is decoded. Only placements may be large;
a registration or an admin call of 58 MiB (many labels, say) would otherwise be decoded into
a structure many times its size.
"""

from __future__ import annotations

import inspect
import logging

import grpc

from protos.options import max_request_bytes

log = logging.getLogger(__name__)


class MalformedMessageGuard(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.refused = 0        # malformed messages refused since start

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method or "?"
        return _guarded(handler, method, self, max_request_bytes(method))

    async def refuse(self, context, method: str, exc: Exception) -> None:
        """Answer INVALID_ARGUMENT (raises, as ``context.abort`` does)."""
        self.refused += 1
        what = f"{type(exc).__name__}: {exc}"[:300]
        try:
            peer = context.peer() or "?"
        except Exception:   # noqa: BLE001 - a log line must never fail the call
            peer = "?"
        log.warning("malformed %s message from %s refused: %s", method, peer, what)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message for {method}: {what}")


    async def refuse_size(self, context, method: str, size: int, limit: int) -> None:
        """Answer RESOURCE_EXHAUSTED (raises, as ``context.abort`` does)."""
        self.refused += 1
        log.warning("%s message of %d bytes refused: over its limit of %d bytes", method, size, limit)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"a {method} message of {size} bytes is over its limit of {limit} bytes")


class _Requests:
    """A stream of raw request messages, decoded one at a time."""

    __slots__ = ("_it", "_decode", "_context", "_guard", "_method", "_limit")

    def __init__(self, it, decode, context, guard: MalformedMessageGuard, method: str, limit: int) -> None:
        self._it, self._decode, self._context, self._guard, self._method = it, decode, context, guard, method
        self._limit = limit

    def __aiter__(self):
        return self

    async def __anext__(self):
        raw = await self._it.__anext__()
        if len(raw) > self._limit:
            await self._guard.refuse_size(self._context, self._method, len(raw), self._limit)
        try:
            return self._decode(raw)
        except Exception as exc:   # noqa: BLE001 - DecodeError and whatever a deserializer raises
            await self._guard.refuse(self._context, self._method, exc)


def _guarded(handler: grpc.RpcMethodHandler, method: str, guard: MalformedMessageGuard,
             limit: int) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer
    out = handler.response_serializer

    async def one(raw, context):
        if len(raw) > limit:
            await guard.refuse_size(context, method, len(raw), limit)
        try:
            return decode(raw)
        except Exception as exc:   # noqa: BLE001
            await guard.refuse(context, method, exc)

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(raw, context):
            return await inner(await one(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=out)

    if handler.unary_stream is not None:
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):
            async def unary_stream_gen(raw, context):
                async for item in inner(await one(raw, context), context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(unary_stream_gen, response_serializer=out)

        async def unary_stream(raw, context):
            return await inner(await one(raw, context), context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=out)

    if handler.stream_unary is not None:
        inner = handler.stream_unary

        async def stream_unary(raws, context):
            return await inner(_Requests(raws, decode, context, guard, method, limit), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=out)

    streams = handler.stream_stream
    if inspect.isasyncgenfunction(streams):   # gRPC tells how to run a behaviour by its function type
        async def stream_stream_gen(raws, context):
            async for item in streams(_Requests(raws, decode, context, guard, method, limit), context):
                yield item
        return grpc.stream_stream_rpc_method_handler(stream_stream_gen, response_serializer=out)

    async def stream_stream(raws, context):
        return await streams(_Requests(raws, decode, context, guard, method, limit), context)
    return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=out)
