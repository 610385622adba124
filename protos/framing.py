"""The session socket's wire format: protobuf messages, each behind a 4-byte length.

The gRPC ``Session`` stream costs a data plane and a control plane most of their CPU per
placement at low and moderate load: every message crosses gRPC's C core, its poller
thread and a wake-up of the event loop, in both processes (py-spy: the poller thread
alone was 16 % of the data plane's samples and 31 % of the control plane's at
concurrency 1). The session socket carries the same ``DataPlaneMessage`` /
``ControlPlaneMessage`` values over one TCP connection (TLS when the control plane has a
certificate), so the session's logic is the same on both transports:

    frame := length (4 bytes, big-endian, unsigned) || serialized message

The first frame from the data plane is a ``DataPlaneMessage`` with ``open`` (carrying its
token when the control plane asks for one); the control plane answers ``info`` first, or
``refused`` and closes. Frames over :data:`MAX_FRAME_BYTES` end the session; the opening
frame, read before the token is checked, may be no longer than
:data:`~protos.options.MAX_OPENING_FRAME_BYTES` (8 KiB): a connection announcing a 60 MiB
opening is refused after its 4-byte length, before anything of the frame is read (a data
plane with many live requests sends them in a second ``open``, once admitted).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

from protos.options import MAX_MESSAGE_BYTES

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
_LENGTH = struct.Struct(">I")
# A quiet connection to a peer that vanished (power loss, a partition: no FIN, no RST) is
# noticed by TCP keepalive after KEEPIDLE + KEEPINTVL * KEEPCNT seconds, as gRPC's pings did.
KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 10, 5, 3
STREAM_LIMIT = 1 << 20   # StreamReader buffer before it pauses the socket
WRITE_HIGH_WATER = 1 << 20   # bytes queued for a slow reader before writers wait


class FrameError(Exception):
    """A frame the other side should never have sent: too long, or not a message."""


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def encode(message) -> bytes:
    """One protobuf message as a frame."""
    return frame(message.SerializeToString())


class FrameWriter:
    """Writes frames to a stream; those written within one event-loop turn leave in one send.

    On loopback a send() runs the receiver's TCP stack inline and wakes it: it costs far
    more than the bytes. Placements made for several clients in one turn of the loop (and
    answers made in one turn of the control plane's) therefore share one, sent at the
    start of the next turn: no timer, no added wait beyond the turn.
    """

    __slots__ = ("_writer", "_transport", "_loop", "_pending")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._transport = writer.transport
        self._loop = asyncio.get_running_loop()
        self._pending: list[bytes] = []

    def write(self, message) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(encode(message))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def flush(self) -> None:
        """Send what is pending now (before a half-close)."""
        if self._pending:
            self._flush()

    @property
    def closing(self) -> bool:
        return self._transport.is_closing()

    async def send_all(self, messages: AsyncIterator) -> bool:
        """Write what ``messages`` yields until it ends (True) or the stream closes (False),
        waiting for the socket whenever more than WRITE_HIGH_WATER bytes are queued."""
        async for msg in messages:
            if self._transport.is_closing():
                return False
            self.write(msg)
            if self._transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                await self._writer.drain()
        self.flush()
        return not self._transport.is_closing()


async def read_frames(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES, *,
                      first_max_bytes: int | None = None) -> AsyncIterator[bytes]:
    """The payloads of the frames ``reader`` delivers, until a clean end of stream.

    A stream that ends inside a frame raises ``asyncio.IncompleteReadError``; a length
    over ``max_bytes`` (``first_max_bytes`` for the first frame, when given) raises
    :class:`FrameError` before anything of it is read.
    """
    limit = max_bytes if first_max_bytes is None else first_max_bytes
    while True:
        try:
            head = await reader.readexactly(4)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return          # closed between frames: a normal end
            raise
        (length,) = _LENGTH.unpack(head)
        if length > limit:
            raise FrameError(f"a frame of {length} bytes is over the limit of {limit}")
        limit = max_bytes
        yield await reader.readexactly(length) if length else b""


def widen(reader: asyncio.StreamReader, limit: int = STREAM_LIMIT) -> None:
    """Let ``reader`` buffer up to ``limit`` (twice that before it pauses the socket).

    The session socket's server starts each connection's reader at the opening frame's
    size, so a connection that has not shown its token can make the control plane hold no
    more than that (at 1 MiB, 16 connections streaming junk held 32 MB), and widens it once
    the session is admitted. asyncio offers no public setter for the limit it was made with.
    """
    reader._limit = limit   # type: ignore[attr-defined]  # private in asyncio: see above


def tune(writer: asyncio.StreamWriter) -> None:
    """No Nagle delay (a placement is one small write) and TCP keepalive on a session socket."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPIDLE_S), ("TCP_KEEPINTVL", KEEPINTVL_S), ("TCP_KEEPCNT", KEEPCNT)):
        if hasattr(socket, name):      # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` -> (host, port); the host as a socket call wants it."""
    host, _, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)
