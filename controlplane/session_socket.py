"""Data-plane sessions on a plain TCP socket: the same session as gRPC's, at a fraction of the CPU.

``SchedulerService.Session`` is written against an async iterator of ``DataPlaneMessage``
in and an async generator of ``ControlPlaneMessage`` out; gRPC is one way to feed it and
this socket (``protos/framing.py``: length-prefixed messages) is another. Everything a
session does (placement order, batching, claims on reconnect, orphaning when it ends) is
therefore the same on both; only the transport's cost differs. Data planes ask
``GetSessionEndpoint`` on the gRPC port where this socket is and fall back to the gRPC
stream when it is off or unreachable.

Who may open a session is decided as on gRPC: the first message is ``open``, carrying the
node's dataplane token when ``[auth]`` asks for one (checked by the same
:class:`~controlplane.auth.AuthInterceptor`), and with TLS configured the socket speaks TLS
with the same certificate (mutual TLS too). A refused node hears why (``refused``) and the
connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

from google.protobuf.message import DecodeError

from controlplane.auth import AuthInterceptor
from protos import omni_proxy_pb2 as pb
from protos.framing import FrameError, FrameWriter, encode, read_frames, split_target, tune, widen
from protos.options import MAX_OPENING_FRAME_BYTES

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0            # refused connections: one log line at most this often
OPEN_TIMEOUT_S = 5.0          # a connection that sends no ``open`` this long is closed


class SessionSocketServer:
    """Listens on ``listen`` and serves each connection as one data-plane session."""

    def __init__(self, service, auth: AuthInterceptor | None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.service = service        # SchedulerService
        self.auth = auth              # None: sessions need no token
        self.ssl_context = ssl_context
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self._logged_at = -LOG_EVERY_S
        self._closing = False
        self._suppressed = 0

    async def start(self, listen: str) -> int:
        host, port = split_target(listen)
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.ssl_context,
                                                  limit=MAX_OPENING_FRAME_BYTES, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            tune(writer)
            peer = writer.get_extra_info("peername")
            # Until its token is checked a connection may send no more than a small opening.
            frames = read_frames(reader, first_max_bytes=MAX_OPENING_FRAME_BYTES)
            opening = await self._opening(frames, writer, peer)
            if opening is not None:
                widen(reader)        # admitted: the session's own buffer size
                await self._relay(opening, frames, writer, peer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass        # the node went away; the session (if any) ended with its reader
        except asyncio.CancelledError:
            # close() (the control plane stopping): the connection's end, not an error. A
            # task left cancelled would have asyncio's stream callback (Python 3.11) log a
            # CancelledError traceback for every live session at each SIGTERM.
            if not self._closing:
                raise
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()

    async def _opening(self, frames, writer: asyncio.StreamWriter, peer) -> pb.DataPlaneMessage | None:
        """The session's ``open`` message, once it is known to be one and allowed; else None."""
        try:
            raw = await asyncio.wait_for(frames.__anext__(), OPEN_TIMEOUT_S)
            first = pb.DataPlaneMessage.FromString(raw)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            self._refuse(writer, peer, f"no session opening within {OPEN_TIMEOUT_S:g}s")
            return None
        except FrameError as exc:
            self._refuse(writer, peer, f"session opening refused before authentication: {exc}")
            return None
        except DecodeError as exc:
            self._refuse(writer, peer, f"malformed session opening: {type(exc).__name__}")
            return None
        if first.WhichOneof("body") != "open":
            self._refuse(writer, peer, "the first message of a session must be 'open'")
            return None
        if self.auth is not None and self.auth.who("dataplane", first.open.token, "session socket") is None:
            self._refuse(writer, peer, "dataplane calls need a valid token", quiet=True)
            return None
        first.open.token = ""
        return first

    def _refuse(self, writer: asyncio.StreamWriter, peer, why: str, *, quiet: bool = False) -> None:
        if not quiet:      # token refusals are logged, rate-limited, by the interceptor
            self._log_refusal(peer, why)
        writer.write(encode(pb.ControlPlaneMessage(refused=why)))
        return None

    def _log_refusal(self, peer, why: str) -> None:
        """One WARNING every LOG_EVERY_S at most (a flood of bad openings is one line, not one
        per connection), saying how many were refused meanwhile."""
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more refused since the last line)" if self._suppressed else ""
        self._logged_at, self._suppressed = now, 0
        log.warning("session socket: refused %s: %s%s", peer, why, more)

    async def _relay(self, opening: pb.DataPlaneMessage, frames, writer: asyncio.StreamWriter, peer) -> None:
        """Run the session: decoded frames in, its answers out as frames."""
        async def incoming():
            yield opening
            try:
                async for raw in frames:
                    yield pb.DataPlaneMessage.FromString(raw)
            except (DecodeError, FrameError) as exc:
                log.warning("session socket: malformed message from %s ends its session: %s",
                            peer, f"{type(exc).__name__}: {exc}"[:300])
            except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                pass
            except Exception:   # a bug must show, not end the session silently
                log.exception("session socket: reading from %s failed", peer)

        answers = self.service.Session(incoming(), None)
        try:
            await FrameWriter(writer).send_all(answers)
        finally:
            await answers.aclose()
