"""A lean, pipelining Redis client for the ledger's hot calls (placement's loads and reserve).

redis-py spends ~70-90 us of CPU per command (pool checkout, timeouts, retries,
telemetry hooks) before the ~20 us loopback round trip; a placement makes two. This client
keeps one connection per store, writes each command at once (hiredis packs it) and
matches replies to callers in order (hiredis parses them), so concurrent placements share
the connection as an implicit pipeline. Everything else (specs, pub/sub, sweeps) stays on
redis-py.

**One write per loop turn for the ledger's per-request calls** (``script_soon``,
``call_soon``): on loopback a send() runs Redis's side of the TCP stack in the sender's
syscall and wakes Redis once per write, so each placement's reserve and each report's end
sent alone cost a syscall here and a read and a reply write in Redis. Commands queued in one
turn of the event loop leave together at the start of the next turn (as
``protos.framing.FrameWriter`` does for the data planes' answers), with one reply timer for
them all; a command written at once (``call``, ``pipeline``) sends what is queued before it,
so the connection's order is the callers' order. **One script call for many callers**
(``batch_nowait``): callers of the same script join the call the turn's queue ends with (one
command, one reply, one future; Redis pays a script call's fixed cost, ~4 us plus its
arguments' conversion, once) until another command is queued after it.

Failure rules: a connection that breaks, or a reply that does not come within
``timeout_s``, fails every call waiting on it with ``ConnectionError`` / ``TimeoutError``
and is dropped; the next call opens a new one. A call that failed with a broken
connection is retried once on a new one (never after a timeout). Redis answers LOADING / READONLY / MASTERDOWN
are raised as ``ConnectionError`` too (Redis is there but cannot serve).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from typing import Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import NoScriptError, ResponseError

_UNAVAILABLE_REPLIES = ("LOADING", "READONLY", "MASTERDOWN", "BUSY")
# Callers one script call takes at most (batch_nowait): bounds how long one call holds Redis
# (~30 us of redis-server a write-behind reserve or end) and the size of its reply.
BATCH_MAX = 256


def error_of(reply: hiredis.ReplyError) -> Exception:
    """What an error reply raises: a Redis that cannot serve now is a ``ConnectionError`` (the
    store's resilience takes it as away), an unknown script ``NoScriptError``, else
    ``ResponseError`` (the command itself is wrong)."""
    msg = str(reply)
    if msg.startswith(_UNAVAILABLE_REPLIES):
        return ConnectionError(f"redis cannot serve: {msg[:200]}")
    if msg.startswith("NOSCRIPT"):
        return NoScriptError(msg)
    return ResponseError(msg)


def supported(url: str) -> bool:
    """Plain TCP or unix-socket URLs; TLS (rediss://) stays on redis-py."""
    try:
        return parse_url(url).get("connection_class") is not SSLConnection
    except ValueError:
        return False


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8")
        self.waiters: deque = deque()   # futures, or [future, n, replies] for a pipeline
        # None until asyncio calls connection_made, its first call on a protocol; the client
        # gets the protocol only once it is connected: typed as set.
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.closed = False
        self.lost: Exception | None = None
        # The loop it was made in (the caller's): asyncio.get_running_loop() checks the pid, a
        # getpid() system call each time, and the queue's calls are per placement.
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader, waiters = self.reader, self.waiters
        reader.feed(data)
        while True:
            reply = reader.gets()
            if reply is False:
                return
            if not waiters:   # a reply nobody asked for: the stream is out of step
                self.abort(ConnectionError("redis sent an unexpected reply"))
                return
            entry = waiters[0]
            if type(entry) is list:   # a pipeline: [future, replies still expected, replies]
                entry[2].append(reply)
                entry[1] -= 1
                if entry[1]:
                    continue
                waiters.popleft()
                fut, reply = entry[0], entry[2]
            else:
                fut = waiters.popleft()
            if not fut.done():   # its caller may have been cancelled: skip, stay in step
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc if isinstance(exc, Exception) else ConnectionError("connection closed by redis"))

    def abort(self, exc: Exception) -> None:
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        self.lost = self.lost or exc
        while self.waiters:
            fut = self.waiters.popleft()
            if type(fut) is list:
                fut = fut[0]
            if not fut.done():
                fut.set_exception(ConnectionError(str(exc)) if not isinstance(exc, (ConnectionError, TimeoutError))
                                  else exc)


class Batch:
    """One script call that callers join with their own arguments while it is the last command
    queued this loop turn (``WireClient.batch_nowait``); packed when it leaves. ``ops``: the
    caller's notes of what joined it, in order (its reply answers them all)."""

    __slots__ = ("source", "head", "args", "future", "ops", "calls")

    def __init__(self, source: str, head: tuple, future: asyncio.Future) -> None:
        self.source = source
        self.head = head
        self.args: list[Any] = []
        self.future = future
        self.ops: list[Any] = []
        self.calls = 0

    def pack(self) -> bytes:
        return hiredis.pack_command((*self.head, *self.args))


class WireClient:
    def __init__(self, url: str, *, timeout_s: float = 1.0, connect_timeout_s: float = 2.0) -> None:
        opts = parse_url(url)
        self.path = opts.get("path")
        self.host, self.port = opts.get("host", "localhost"), int(opts.get("port", 6379))
        self.username, self.password = opts.get("username"), opts.get("password")
        self.db = int(opts.get("db", 0) or 0)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._shas: dict[str, str] = {}
        self._loaded_on: dict[int, set[str]] = {}   # connection -> scripts it has run
        # Commands queued this loop turn (see the module's docstring): packed, for _queued_on,
        # their replies' futures already in its waiters; the last one's future ends the timer.
        self._queued: list[bytes | Batch] = []
        self._queued_on: _Protocol | None = None
        self._queued_last: asyncio.Future | None = None
        self._batch: Batch | None = None   # the last queued command, while callers may join it
        self.writes = 0   # sends to Redis (for tests and benchmarks: commands per write)
        self.commands = 0

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and not proto.closed:
            return proto
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            if self.path:
                coro = loop.create_unix_connection(_Protocol, self.path)
            else:
                coro = loop.create_connection(_Protocol, self.host, self.port)
            _, proto = await asyncio.wait_for(coro, self.connect_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"timed out connecting to redis after {self.connect_timeout_s:g}s") from None
        if self.password:
            auth = ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
            await self._send(proto, auth)
        if self.db:
            await self._send(proto, ("SELECT", self.db))
        self._loaded_on.clear()   # a new connection may face a restarted Redis
        self._proto = proto
        return proto

    async def _send(self, proto: _Protocol, args: tuple) -> Any:
        self.flush()
        fut = asyncio.get_running_loop().create_future()
        proto.waiters.append(fut)
        proto.transport.write(hiredis.pack_command(args))
        self.writes += 1
        self.commands += 1
        timer = asyncio.get_running_loop().call_later(
            self.timeout_s, proto.abort, TimeoutError(f"no reply from redis within {self.timeout_s:g}s"))
        try:
            reply = await fut
        finally:
            timer.cancel()
        if isinstance(reply, hiredis.ReplyError):
            raise error_of(reply)
        return reply

    def script_nowait(self, source: str, keys: list[str], args: list[Any]) -> asyncio.Future | None:
        """Queue a script on the open connection without waiting: it leaves with the rest of
        this loop turn's commands, and its reply (or error) lands in the returned future, in
        order with every later call. The first time on a connection it goes as EVAL (which
        loads it: the EVALSHAs behind it find it). None when no connection is open: the caller
        then awaits ``script``."""
        proto = self._proto
        if proto is None or proto.closed:
            return None
        loaded = self._loaded_on.setdefault(id(proto), set())
        if source in loaded:
            return self._queue(proto, ("EVALSHA", self._sha(source), len(keys), *keys, *args))
        loaded.add(source)
        return self._queue(proto, ("EVAL", source, len(keys), *keys, *args))

    def unloaded(self, source: str) -> None:
        """Redis answered NOSCRIPT to ``source`` (its script cache was flushed): the next
        ``script_nowait`` sends it as EVAL again."""
        for loaded in self._loaded_on.values():
            loaded.discard(source)

    def _sha(self, source: str) -> str:
        sha = self._shas.get(source)
        if sha is None:
            sha = self._shas[source] = hashlib.sha1(source.encode()).hexdigest()
        return sha

    def _queue(self, proto: _Protocol, args: tuple, many: list[tuple] | None = None) -> asyncio.Future:
        if self._queued and self._queued_on is not proto:
            self.flush()   # (commands for a connection that broke: their futures have failed)
        loop = proto.loop
        fut = loop.create_future()
        if many is None:
            proto.waiters.append(fut)
        else:
            proto.waiters.append([fut, len(many), []])
        if not self._queued:
            self._queued_on = proto
            loop.call_soon(self.flush)
        if many is None:
            self._queued.append(hiredis.pack_command(args))
        else:
            self._queued += [hiredis.pack_command(c) for c in many]
        self._queued_last = fut
        self._batch = None   # (a later batch call goes after this command: a new batch)
        return fut

    def batch_nowait(self, source: str, first: list[Any], args: list[Any]) -> Batch | None:
        """Join ``args`` to the call of script ``source`` this loop turn's queue ends with, or
        queue a new one whose arguments start with ``first``: one command, one reply, one
        future for every caller that joins it before another command is queued or it leaves
        (so the connection's order stays the callers' order). The caller reads ``.ops`` to
        know whether it is the first (then it adds its done-callback) and notes itself there.
        None when no connection is open. The script gets no keys (as ``script_nowait``)."""
        proto = self._proto
        if proto is None or proto.closed:
            return None
        batch = self._batch
        if batch is None or self._queued_on is not proto or batch.source is not source or batch.calls >= BATCH_MAX:
            if self._queued and self._queued_on is not proto:
                self.flush()
            loop = proto.loop
            fut = loop.create_future()
            proto.waiters.append(fut)
            if not self._queued:
                self._queued_on = proto
                loop.call_soon(self.flush)
            loaded = self._loaded_on.setdefault(id(proto), set())
            if source in loaded:
                batch = Batch(source, ("EVALSHA", self._sha(source), 0), fut)
            else:
                loaded.add(source)
                batch = Batch(source, ("EVAL", source, 0), fut)
            batch.args += first
            self._queued.append(batch)
            self._queued_last = fut
            self._batch = batch
        batch.args += args
        batch.calls += 1
        return batch

    def pipeline_nowait(self, commands: list[tuple]) -> asyncio.Future | None:
        """Queue several commands with this loop turn's others; their replies, as a list, land
        in the returned future (error replies in it as ``hiredis.ReplyError``). None when no
        connection is open."""
        proto = self._proto
        if proto is None or proto.closed or not commands:
            return None
        return self._queue(proto, (), commands)

    @property
    def queued(self) -> bool:
        """Whether commands wait to leave at the next turn (a write that happens anyway)."""
        return bool(self._queued)

    def flush(self) -> None:
        """Send the commands queued this loop turn now (in one write)."""
        queued, proto, last = self._queued, self._queued_on, self._queued_last
        if not queued:
            return
        self._queued, self._queued_on, self._queued_last, self._batch = [], None, None, None
        if proto is None or proto.closed or last is None:
            return   # the connection broke meanwhile: it failed their futures
        data = [q if type(q) is bytes else cast(Batch, q).pack() for q in queued]
        proto.transport.write(data[0] if len(data) == 1 else b"".join(data))
        self.writes += 1
        self.commands += len(queued)
        # Replies come in order: the last one's arrival ends the wait for all of them.
        timer = proto.loop.call_later(
            self.timeout_s, proto.abort, TimeoutError(f"no reply from redis within {self.timeout_s:g}s"))
        last.add_done_callback(lambda _: timer.cancel())

    async def script_soon(self, source: str, keys: list[str], args: list[Any]) -> Any:
        """``script``, sent with this loop turn's other queued commands (one write for all)."""
        fut = self.script_nowait(source, keys, args)
        if fut is None:
            return await self.script(source, keys, args)
        return await self._queued_reply(fut, lambda: self.script(source, keys, args))

    async def call_soon(self, *args) -> Any:
        """``call``, sent with this loop turn's other queued commands (one write for all)."""
        proto = self._proto
        if proto is None or proto.closed:
            return await self.call(*args)
        return await self._queued_reply(self._queue(proto, args), lambda: self.call(*args))

    async def _queued_reply(self, fut: asyncio.Future, again) -> Any:
        try:
            reply = await fut
        except ConnectionError:
            # As ``call``: once more on a new connection (never after a timeout).
            return await again()
        if isinstance(reply, hiredis.ReplyError):
            error = error_of(reply)
            if isinstance(error, NoScriptError):   # Redis restarted between loading and this call
                return await again()
            raise error
        return reply

    async def pipeline(self, commands: list[tuple]) -> list[Any]:
        """Several commands in one write; their replies in order (error replies raised)."""
        for attempt in (1, 2):
            proto = await self._connection()
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self.flush()
            proto.waiters.append([fut, len(commands), []])
            proto.transport.write(b"".join(hiredis.pack_command(c) for c in commands))
            self.writes += 1
            self.commands += len(commands)
            timer = loop.call_later(self.timeout_s, proto.abort,
                                    TimeoutError(f"no reply from redis within {self.timeout_s:g}s"))
            try:
                replies = await fut
            except ConnectionError:
                if attempt == 2:
                    raise
                continue
            finally:
                timer.cancel()
            for reply in replies:
                if isinstance(reply, hiredis.ReplyError):
                    raise error_of(reply)
            return replies
        raise AssertionError("unreachable")

    async def call(self, *args) -> Any:
        for attempt in (1, 2):
            proto = await self._connection()
            try:
                return await self._send(proto, args)
            except ConnectionError:
                # Retried once on a new connection (a Redis restart breaks the old one). A
                # timeout is not retried: the command may have run. RedisStore.reserve carries
                # an operation token, so even a retried reserve is applied once.
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def script(self, source: str, keys: list[str], args: list[Any]) -> Any:
        sha = self._sha(source)
        try:
            reply = await self.call("EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted (or flushed its script cache): load it and run it once more.
            await self.call("SCRIPT", "LOAD", source)
            reply = await self.call("EVALSHA", sha, len(keys), *keys, *args)
        if self._proto is not None:   # known to be loaded in the Redis behind this connection
            self._loaded_on.setdefault(id(self._proto), set()).add(source)
        return reply

    async def close(self) -> None:
        self.flush()   # what callers queued (write-behind reserves) still goes out
        proto, self._proto = self._proto, None
        if proto is not None and proto.waiters and not proto.closed:
            # Their replies too (within the reply timeout): a write-behind reserve that
            # closing cut off would count as failed, and Redis may well have applied it.
            last = proto.waiters[-1]
            await asyncio.wait([last[0] if type(last) is list else last], timeout=self.timeout_s)
        self._loaded_on.clear()
        if proto is not None and proto.transport is not None:
            proto.transport.close()
            proto.closed = True
