"""Asyncio ZMQ subscriber for one engine's vLLM KV-event stream, with gap detection and replay.

Why the care: the prefix index is only as good as the event stream. vLLM numbers every PUB
message (``[topic, seq 8B big-endian, msgpack payload]``, seq from 0 per publisher); a lost message
means the index silently disagrees with the engine. So, per publisher (per topic):

* ``seq == last + 1``: normal.
* ``seq > last + 1`` (gap): if the engine has a ``replay_endpoint`` (ROUTER), ask it for
  ``last + 1 ..`` over a DEALER (``[b"", start_seq]``; replies ``[b"", (topic)?, seq, payload]``,
  ended by seq ``END_SEQ`` = 8x0xff or an empty payload; the last two frames are taken as seq and
  payload, so replies with and without the topic frame both work). If the replay does not cover
  the whole gap (no replay endpoint, timeout, buffer rolled over) ``on_reset(engine)`` is called so
  the index drops that engine's entries, then whatever was replayed is applied.
* ``seq <= last``: the engine restarted (seq restarts at 0): ``on_reset`` too.
* first message with ``seq > 0`` and a replay endpoint: backfill from 0 (the engine's buffer may
  hold blocks stored before we connected); nothing is reset when that falls short.

Connect mode (default): the engine binds (``tcp://*:5557``) and we connect. Bind mode: we bind and
engines connect to us (vLLM connects when its endpoint has no ``*``); with several engines on one
socket set ``key_by_topic`` so each engine is told apart by its topic (llm-d style
``kv@<pod>@<model>``); replay is then unavailable (no single engine address).

Malformed frames/payloads are counted and logged at most once per ``log_interval_s``; they still
advance the sequence (the message arrived; its content is lost, which is not a gap).

Replay is streamed and bounded: each replayed batch is applied as it arrives (nothing of the size of
the gap is ever built), and a gap wider than ``max_replay_gap`` messages is not replayed at all: the
engine's entries are reset, since no engine buffer holds that much (vLLM keeps ``buffer_steps``,
10,000 by default). A sequence that jumps by 2*10^7 therefore costs one reset, not hundreds of MB.

**Never a long hold of the event loop.** The loop that applies events also answers placements,
so the work is cut in slices: a batch is decoded a few events at a time (``BatchReader``) and
applied about a thousand blocks at a time, and once a slice has held the loop ``slice_s`` (1 ms by
default) the subscriber yields to it. Messages already waiting on the socket are no reason not
to: pyzmq hands them over without a loop turn, so a backlog of frames (after a pause, or a
burst of long prompts) used to be drained in one go, stalling every placement behind it. The
budget is one ``LoopBudget`` shared by every subscriber of a ``KVCache``, and one batch is
decoded and applied at a time (its ``turn``): N engines' streams together, not each, hold the
loop about a slice per turn. A batch is applied only once
it has decoded whole (a malformed one changes nothing, as before); a placement that runs between
two slices of one batch sees part of it, as it would see one of two batches published apart.

If the receive loop itself dies (a socket error, a bug outside the per-message guard), the exception
is logged and handed to ``on_failed``, so the owner can stop trusting this engine's entries instead
of leaving an exception in a task nobody awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import zmq
import zmq.asyncio

from controlplane.kvcache.events import AllBlocksCleared, BatchReader, KVEvent, MalformedEventError
from omni_runtime import cancel_and_wait

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8

EventHandler = Callable[[str, "int | None", "tuple[KVEvent, ...]"], "Awaitable[None] | None"]
ResetHandler = Callable[[str], "Awaitable[None] | None"]
FailedHandler = Callable[[str, BaseException], None]

DEFAULT_MAX_REPLAY_GAP = 100_000   # messages; vLLM's replay buffer holds 10,000 by default
DEFAULT_SLICE_S = 0.001            # longest the event loop is held before yielding (see LoopBudget)
DECODE_SLICE = 32                  # events decoded between two looks at the clock
APPLY_SLICE = 1024                 # blocks handed to the handler at once (an event without any counts one)


class LoopBudget:
    """How long KV-event work may hold the event loop before it lets the loop turn.

    Shared by every subscriber of one owner, so their streams together hold the loop about
    ``slice_s`` a turn rather than each of them that long. ``spend()`` is cheap (one clock read)
    and yields only when the slice is used up; the first caller after a turn starts a new slice.
    """

    __slots__ = ("_since", "slice_s", "turn", "yields")

    def __init__(self, slice_s: float = DEFAULT_SLICE_S) -> None:
        if slice_s <= 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        self.slice_s = slice_s
        self._since = time.perf_counter()
        self.yields = 0
        # Held while a batch is decoded and applied: the other streams' batches wait for it
        # rather than each doing a slice in the same loop turn (8 engines would hold the loop
        # 8 slices a turn). Never held across a network wait (replay).
        self.turn = asyncio.Lock()

    async def spend(self) -> None:
        if time.perf_counter() - self._since < self.slice_s:
            return
        self.yields += 1
        # Twice: on asyncio's own loop, what arrived on the sockets while the slice ran (a
        # placement's request) is polled at the next turn but queued behind this task's wake-up;
        # a first, empty step lets it run before the next slice instead of after it. (uvloop
        # runs I/O callbacks first already; there the extra step is just empty.)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self._since = time.perf_counter()


@dataclass(frozen=True)
class KVEventSource:
    """One engine publisher (one DP rank: vLLM offsets the port by the rank)."""

    engine_key: str
    endpoint: str                      # connect: tcp://engine:5557; bind: tcp://127.0.0.1:5557
    bind: bool = False
    replay_endpoint: str | None = None  # engine's ROUTER (connect mode only)
    topic: bytes = b""                 # SUB prefix filter
    key_by_topic: bool = False         # bind mode with many engines: engine key = topic string


@dataclass
class SubscriberCounters:
    received: int = 0       # live messages accepted
    malformed: int = 0      # bad frames or undecodable payloads (live or replayed)
    gaps: int = 0           # sequence gaps detected
    replayed: int = 0       # batches recovered through replay
    resets: int = 0         # on_reset calls (unrecovered gap or engine restart)
    handler_errors: int = 0  # exceptions raised by the event handler
    ignored_events: int = 0  # events of unknown types
    gaps_too_large: int = 0  # gaps over max_replay_gap: reset without asking for a replay
    failed: int = 0          # the receive loop died (see on_failed)


class _RateLimitedLog:
    """At most one warning per interval; the counters carry the totals."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" ({self._suppressed} similar suppressed)"
        self._suppressed = 0
        self._next = now + self.interval_s
        log.warning(msg, *args, exc_info=exc_info)


async def _call(fn: Callable[..., object], *args: object) -> None:
    r = fn(*args)
    if inspect.isawaitable(r):
        await r


class KVEventSubscriber:
    """Receives one source's stream and feeds decoded batches to ``handler(engine, dp_rank, events)``."""

    def __init__(self, source: KVEventSource, handler: EventHandler, on_reset: ResetHandler, *,
                 ctx: zmq.asyncio.Context | None = None, replay_timeout_s: float = 2.0,
                 backfill_on_connect: bool = True, log_interval_s: float = 30.0,
                 max_replay_gap: int = DEFAULT_MAX_REPLAY_GAP, on_failed: FailedHandler | None = None,
                 budget: LoopBudget | None = None) -> None:
        if source.key_by_topic and source.replay_endpoint:
            raise ValueError("replay needs one engine per socket; key_by_topic mixes engines")
        if max_replay_gap < 1:
            raise ValueError(f"max_replay_gap must be >= 1, got {max_replay_gap}")
        self.source = source
        self.handler = handler
        self.on_reset = on_reset
        self.on_failed = on_failed
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_gap = max_replay_gap
        self.backfill_on_connect = backfill_on_connect
        self.counters = SubscriberCounters()
        self.budget = budget or LoopBudget()
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._last: dict[bytes, int] = {}   # topic -> last seq seen
        self._rlog = _RateLimitedLog(log_interval_s)
        self.endpoint: str | None = None     # actual endpoint (resolved port in bind mode)

    async def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic)
        if self.source.bind:
            sub.bind(self.source.endpoint)
            self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sub.connect(self.source.endpoint)
            self.endpoint = self.source.endpoint
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.source.engine_key}")
        self._task.add_done_callback(self._task_done)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def last_seqs(self) -> Mapping[bytes, int]:
        """Topic -> the last sequence number seen (read-only: for stats and snapshots)."""
        return MappingProxyType(self._last)

    def resume_from(self, seqs: Mapping[bytes, int]) -> None:
        """Before ``start``: treat ``seqs`` as seen, so the first message replays what came
        after them (a loaded snapshot of the index, ``kvcache/persist.py``)."""
        self._last.update(seqs)

    def _task_done(self, task: asyncio.Task) -> None:
        """Retrieve and report how the receive loop ended; a cancel (stop) is not a failure."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self.counters.failed += 1
        log.error("kv events from %s (%s): subscriber stopped: %s: %s", self.source.engine_key,
                  self.endpoint or self.source.endpoint, type(exc).__name__, exc, exc_info=exc)
        if self.on_failed is not None:
            try:
                self.on_failed(self.source.engine_key, exc)
            except Exception:  # noqa: BLE001 - a done callback has nobody to raise to
                log.exception("kv events from %s: on_failed callback failed", self.source.engine_key)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():  # a task that died was reported by _task_done
            await cancel_and_wait(task)
        for s in (self._sub, self._dealer):
            if s is not None:
                s.close(linger=0)
        self._sub = self._dealer = None

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                await self._on_message(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in a callback must not kill the stream
                self.counters.handler_errors += 1
                self._rlog.warning("kv events from %s: callback failed", self.source.engine_key, exc_info=True)
            await self.budget.spend()   # a backlog of frames is received without a loop turn

    def _engine(self, topic: bytes) -> str:
        if self.source.key_by_topic:
            return topic.decode("utf-8", "replace")
        return self.source.engine_key

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.malformed += 1
            self._rlog.warning("kv events from %s: bad frame layout (%d frames)", self.source.engine_key,
                               len(frames))
            return
        topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
        engine = self._engine(topic)
        last = self._last.get(topic)
        self._last[topic] = seq
        self.counters.received += 1
        if last is None:
            if seq > 0 and self.source.replay_endpoint and self.backfill_on_connect:
                await self._replay(engine, 0, seq, must_cover=False)
        elif seq <= last:
            log.info("kv events from %s: seq went back %d -> %d (engine restart)", engine, last, seq)
            await self._reset(engine)
        elif seq > last + 1:
            self.counters.gaps += 1
            self._rlog.warning("kv events from %s: seq gap %d -> %d", engine, last, seq)
            if self.source.replay_endpoint:
                await self._replay(engine, last + 1, seq, must_cover=True)
            else:
                await self._reset(engine)
        await self._deliver(engine, payload)

    async def _reset(self, engine: str) -> None:
        self.counters.resets += 1
        await _call(self.on_reset, engine)

    async def _deliver(self, engine: str, payload: bytes) -> bool:
        """Decode the batch in slices, then hand it to the handler in slices (see the module's
        docstring): the loop turns whenever the shared budget is spent."""
        budget = self.budget
        events: list[KVEvent] = []
        ignored = 0
        async with budget.turn:
            try:
                # token ids are never read here (not built); a run of one-block removals is one event
                reader = BatchReader(payload, tokens=False, merge_removals=True)
                while reader.remaining:
                    ignored += reader.read(events, DECODE_SLICE)
                    await budget.spend()
                dp_rank = reader.finish()
            except MalformedEventError as e:
                self.counters.malformed += 1
                self._rlog.warning("kv events from %s: malformed payload: %s", engine, e)
                return False
            self.counters.ignored_events += ignored
            n = len(events)
            if not n:
                await _call(self.handler, engine, dp_rank, ())
                return True
            i = 0
            while i < n:        # slices of about APPLY_SLICE blocks: their cost, not the events'
                j, blocks = i, 0
                while j < n and blocks < APPLY_SLICE:
                    ev = events[j]
                    blocks += 1 if isinstance(ev, AllBlocksCleared) else len(ev.block_hashes) or 1
                    j += 1
                await _call(self.handler, engine, dp_rank, tuple(events[i:j]))
                i = j
                if i < n:
                    await budget.spend()
        return True

    async def _replay(self, engine: str, start: int, stop: int, *, must_cover: bool) -> None:
        """Fetch seqs [start, stop) from the engine's ROUTER and apply each as it arrives.

        With ``must_cover`` (a gap), the engine's entries are reset as soon as the replay is known
        not to cover the whole gap: a hole in the replies, a timeout, or a gap too wide to ask for.
        Without it (backfill on first contact), whatever arrives is applied, at most the last
        ``max_replay_gap`` messages.
        """
        if stop - start > self.max_replay_gap:
            if must_cover:
                self.counters.gaps_too_large += 1
                self._rlog.warning("kv events from %s: gap %d..%d (%d messages) exceeds max_replay_gap %d: "
                                   "entries reset instead of replayed", engine, start, stop - 1, stop - start,
                                   self.max_replay_gap)
                await self._reset(engine)
                return
            start = stop - self.max_replay_gap
        expected = start            # the next seq that keeps the replay contiguous
        hole = False
        n = 0

        async def hole_found() -> None:
            nonlocal hole
            if not hole:
                hole = True
                if must_cover:
                    await self._reset(engine)

        complete = False
        async with contextlib.aclosing(self._fetch_replay(start, stop)) as replies:
            async for seq, payload in replies:
                if seq is None:           # end marker (always the last item)
                    complete = True
                    continue
                if seq < expected:        # a duplicate: already applied
                    continue
                if seq > expected:
                    await hole_found()
                expected = seq + 1
                n += 1
                if await self._deliver(engine, payload):
                    self.counters.replayed += 1
        if not complete or expected != stop:
            if must_cover and not hole:
                self._rlog.warning("kv events from %s: replay of %d..%d incomplete (%d batches)", engine, start,
                                   stop - 1, n)
            await hole_found()

    async def _fetch_replay(self, start: int, stop: int) -> AsyncGenerator[tuple[int | None, bytes], None]:
        """Yield (seq, payload) replies in [start, stop) as they arrive, then (None, b"") when the end
        marker arrives in time; on a timeout it just stops (no end marker yielded)."""
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            endpoint = self.source.replay_endpoint
            assert endpoint, "replay asked of an engine without a replay endpoint"
            self._dealer.connect(endpoint)
        dealer = self._dealer
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await dealer.poll(remaining * 1000):
                # late replies would confuse the next replay: start over with a fresh socket
                dealer.close(linger=0)
                self._dealer = None
                return
            r = await dealer.recv_multipart()
            if len(r) < 2:
                self.counters.malformed += 1
                continue
            seq_b, payload = r[-2], r[-1]
            if seq_b == END_SEQ or not payload:
                yield None, b""
                return
            if len(seq_b) != 8:
                self.counters.malformed += 1
                continue
            rs = int.from_bytes(seq_b, "big")
            if start <= rs < stop:
                yield rs, payload
