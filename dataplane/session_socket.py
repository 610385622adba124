"""The data plane's end of the session socket (``protos/framing.py``).

:class:`SocketCall` stands where the gRPC ``Session`` call stands in
:class:`~dataplane.placement_client.PlacementClient`: iterated for the control plane's
messages, fed by the client's outgoing generator, cancelled to drop the session. A gRPC
call's errors map onto it: a refused session raises :class:`SessionRefused`, a broken
connection raises ``ConnectionError``, and a clean end (the control plane closed, or we
finished writing and it answered with its end) simply ends the iteration.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

from protos import omni_proxy_pb2 as pb
from protos.framing import STREAM_LIMIT, FrameWriter, read_frames, tune



class SessionRefused(Exception):
    """The control plane refused the session (a bad token, a malformed opening)."""


async def connect(host: str, port: int, *, ssl_context: ssl.SSLContext | None, timeout_s: float) -> SocketCall:
    """Open the socket (OSError, ssl.SSLError or asyncio.TimeoutError when it cannot be)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=ssl_context, server_hostname=host if ssl_context else None,
                                limit=STREAM_LIMIT), timeout_s)
    tune(writer)
    return SocketCall(reader, writer)


class SocketCall:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pump: asyncio.Task | None = None

    def send_from(self, outgoing: AsyncIterator[pb.DataPlaneMessage]) -> None:
        """Write what ``outgoing`` yields until it ends, then close our side of the stream."""
        self._pump = asyncio.ensure_future(self._write_all(outgoing))

    async def _write_all(self, outgoing: AsyncIterator[pb.DataPlaneMessage]) -> None:
        writer = self._writer
        try:
            if await FrameWriter(writer).send_all(outgoing):
                # The control plane ends the session once it has read everything before this.
                if writer.can_write_eof():
                    writer.write_eof()
                else:            # TLS cannot half-close
                    writer.close()
        except (ConnectionError, ssl.SSLError):
            pass

    async def __aiter__(self) -> AsyncIterator[pb.ControlPlaneMessage]:
        async for raw in read_frames(self._reader):
            msg = pb.ControlPlaneMessage.FromString(raw)
            if msg.WhichOneof("body") == "refused":
                raise SessionRefused(msg.refused)
            yield msg

    def cancel(self) -> None:
        """Drop the connection at once, as a network fault would."""
        if self._pump is not None:
            self._pump.cancel()
        self._writer.transport.abort()
