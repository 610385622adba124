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
``refused`` and closes. Frames over :data:`MAX_FRAME_BYTES` end the session.
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


class FrameError(Exception):
    """A frame the other side should never have sent: too long, or not a message."""


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def encode(message) -> bytes:
    """One protobuf message as a frame."""
    return frame(message.SerializeToString())


async def read_frames(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> AsyncIterator[bytes]:
    """The payloads of the frames ``reader`` delivers, until a clean end of stream.

    A stream that ends inside a frame raises ``asyncio.IncompleteReadError``; a length
    over ``max_bytes`` raises :class:`FrameError` before anything of it is read.
    """
    while True:
        try:
            head = await reader.readexactly(4)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return          # closed between frames: a normal end
            raise
        (length,) = _LENGTH.unpack(head)
        if length > max_bytes:
            raise FrameError(f"a frame of {length} bytes is over the limit of {max_bytes}")
        yield await reader.readexactly(length) if length else b""


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
