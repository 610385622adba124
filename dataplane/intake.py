"""Reading a client's request body: bounded in time, in size, and after decompression.

The server (``dataplane.server``) hands the body over as sent: inflating a gzip body in
one go on the event loop (as aiohttp's server did) let a small "gzip bomb" stall every
other request for seconds before the size limit was even checked. Here a compressed body is inflated in
steps of at most ``STEP_BYTES`` of output, yielding to the loop between steps, and the
running total is checked against the body limit at each step. A plain body (the common
case) is read and returned as is.
"""

from __future__ import annotations

import asyncio
import zlib

from dataplane.errors import APIError
from dataplane.messages import BodyTooLarge, PayloadError, Request

STEP_BYTES = 256 * 1024        # ~0.5 ms of zlib work: the longest the loop waits on one step
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def body_at_hand(http: Request) -> bytes | None:
    """The body, when ``read_client_body`` would return it as it is without waiting: all of
    it arrived intact, with no Content-Encoding header to decode. None: await that."""
    if "Content-Encoding" in http.headers:
        return None
    return http.body_at_hand()


async def read_client_body(http: Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, decompressed; 408 when it does not arrive within ``timeout_s``.

    The size as sent is bounded by the server's ``max_body_bytes`` (the same limit), the
    decompressed size by ``max_bytes``; both are a 413; a corrupt body is a 400, an encoding we do
    not decode a 415.
    """
    encoding = http.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity") and encoding not in _ENCODINGS:
        raise APIError(415, "unsupported Content-Encoding; send the body as identity, gzip or deflate")
    try:
        raw = await _read_within(http, timeout_s)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g}s") from None
    except BodyTooLarge:
        raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes") from None
    except PayloadError:
        raise APIError(400, "the request body's framing is malformed (chunked encoding or length)") from None
    if encoding in ("", "identity"):
        return raw
    return await inflate(raw, encoding, max_bytes)


async def _read_within(http: Request, timeout_s: float) -> bytes:
    if timeout_s <= 0 or http.complete:   # the common case: the body came with the head
        return await http.read()
    async with asyncio.timeout(timeout_s):   # no extra task per request
        return await http.read()


async def inflate(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """Decompress ``data`` in bounded steps; 413 past ``max_bytes``, 400 when corrupt."""
    wbits = _ENCODINGS[encoding]
    if encoding == "deflate" and data and data[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS    # raw deflate without the zlib header, as some clients send
    out: list[bytes] = []
    total = 0
    pending = data
    inflater = zlib.decompressobj(wbits)
    try:
        while True:
            piece = inflater.decompress(pending, STEP_BYTES)
            total += len(piece)
            if total > max_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes once decompressed")
            out.append(piece)
            pending = inflater.unconsumed_tail
            if inflater.eof:
                rest = inflater.unused_data
                if wbits > zlib.MAX_WBITS and rest:   # concatenated gzip members
                    inflater, pending = zlib.decompressobj(wbits), rest
                    continue
                if rest:
                    raise APIError(400, f"request body has data after the end of its {encoding} stream")
                break
            if not pending and not piece:
                raise APIError(400, f"request body is a truncated {encoding} stream")
            await asyncio.sleep(0)
    except zlib.error:
        raise APIError(400, f"request body is not valid {encoding} data") from None
    return b"".join(out)
