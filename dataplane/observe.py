"""What the data plane tells operators about each request, once, when it ends.

* Metrics (``dataplane.metrics``): stage histograms, token counters, by model and flow.
* One access-log line per request: JSON (orjson) on the ``omni_proxy.access`` logger, INFO.
* The request id on every other log line written while the request is being served: a
  context variable, set once per request, read by a filter on the root handlers
  (``install_request_id_filter``). Tasks a request starts inherit it.
* W3C trace context: a valid client ``traceparent`` (and its ``tracestate``) is forwarded
  to every engine leg; OpenTelemetry spans only when ``--otel-endpoint`` is set
  (``dataplane.otel``, imported only then).

Everything here runs once per request; nothing per streamed chunk.
"""

from __future__ import annotations

import asyncio
import contextvars
from bisect import bisect_left
import io
import logging
import re
import sys
import time
from typing import cast

import orjson

from dataplane.metrics import DataPlaneMetrics
from dataplane.tracking import RequestTracker

_now = time.perf_counter
log = logging.getLogger(__name__)

ACCESS_LOGGER = "omni_proxy.access"
access_log = logging.getLogger(ACCESS_LOGGER)

# The engine-facing id of the request the current task serves ("" outside requests).
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("omni_request_id", default="")

# version-traceid-parentid-flags; version ff is invalid, all-zero ids are invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[ -~]*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
MAX_TRACESTATE = 512


def trace_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str] | None:
    """The client's trace context to forward, if it is valid W3C trace context; else None."""
    if not traceparent:
        return None
    value = traceparent.strip().lower()
    m = _TRACEPARENT.fullmatch(value)
    if m is None or m.group(1) == "ff" or m.group(2) == _ZERO_TRACE or m.group(3) == _ZERO_SPAN \
            or (m.group(1) == "00" and m.group(5)):
        return None
    headers = {"traceparent": value}
    if tracestate and len(tracestate) <= MAX_TRACESTATE and tracestate.isprintable():
        headers["tracestate"] = tracestate.strip()
    return headers


class RequestIdFilter(logging.Filter):
    """Prefix ``[request id]`` to a record logged while a request is served.

    Installed on handlers, so every logger's records get it however they were configured;
    ``record.request_id`` is set for formatters that want it as a field. The access log
    line carries the ids in its JSON and is left as it is.
    """

    prefix = True     # off with --log-format json: the id is a field of its own there

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            rid = current_request_id.get()
            record.request_id = rid
            if rid and self.prefix and record.name != ACCESS_LOGGER and isinstance(record.msg, str):
                record.msg = f"[{rid}] {record.msg}"
        return True


_FILTER = RequestIdFilter()

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class CachedTimeFormatter(logging.Formatter):
    """A Formatter whose ``asctime`` is rendered once a second, not per record.

    ``time.strftime`` of every record is about a third of the cost of writing an
    access-log line; the text is the same as the default formatter's.
    """

    default_msec_format = "%s,%03d"   # logging.Formatter's (typed there as optional)

    def __init__(self, fmt: str = LOG_FORMAT) -> None:
        super().__init__(fmt)
        self._second = -1
        self._text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._text = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return self.default_msec_format % (self._text, record.msecs)


def skip_unused_record_fields() -> None:
    """The data plane's format names no thread or process: do not look them up for every
    record (logging's documented switches; a third of a LogRecord's cost)."""
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


class BatchedStreamHandler(logging.StreamHandler):
    """Log lines to a block-buffered stream, flushed within ``FLUSH_S`` (at once from WARNING up).

    stderr is line-buffered: with the access log on, every request cost one write system
    call for its line (a third of the data plane's writes per request at concurrency 32).
    Here lines collect in the stream's buffer and leave together: a timer on the event
    loop flushes what is buffered at most ``FLUSH_S`` after the first line of a batch;
    WARNING and worse, and lines logged off the loop's thread, flush at once. A process
    killed without warning loses at most that much of its access log.
    """

    FLUSH_S = 0.1

    def __init__(self, fd: int) -> None:
        super().__init__(io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "wb", closefd=False), 1 << 16),
                                          encoding="utf-8", errors="backslashreplace", write_through=False))
        self._timer: asyncio.TimerHandle | None = None

    def flush(self) -> None:      # logging calls it after each record: only when due here
        return

    def flush_now(self) -> None:
        self._timer = None
        self.acquire()
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if record.levelno >= logging.WARNING:
            self.flush_now()
        else:
            self._flush_soon()

    def _flush_soon(self) -> None:
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.FLUSH_S, self.flush_now)
            except RuntimeError:      # no loop in this thread (start-up, an executor thread)
                self.flush_now()

    def write_info(self, line: str) -> None:
        """Write one INFO line as ``emit`` would (lock, terminator, flushed within FLUSH_S)."""
        self.write_text(line + self.terminator)

    def write_text(self, text: str) -> None:
        """Write INFO lines already terminated, in one go (one lock, flushed within FLUSH_S)."""
        self.acquire()
        try:
            self.stream.write(text)
        finally:
            self.release()
        self._flush_soon()

    def close(self) -> None:
        self.flush_now()
        super().close()


class _AccessRecord:
    """The fields the formatters read of an access record, without a LogRecord's cost."""

    __slots__ = ("created", "msecs", "msg", "request_id")
    name = ACCESS_LOGGER
    levelname = "INFO"
    levelno = logging.INFO
    json_message = True
    exc_info = exc_text = worker = None

    def __init__(self, msg: str, created: float, request_id: str) -> None:
        self.msg = msg
        self.created = created
        self.msecs = int((created - int(created)) * 1000) + 0.0   # as LogRecord computes it
        self.request_id = request_id


_root = logging.getLogger()


def direct_access_handler() -> BatchedStreamHandler | None:
    """The handler an access line would reach, when writing to it directly is equivalent.

    Logging an access line (a LogRecord, the walk up the logger tree, the handler's filter,
    lock and ``Formatter.format``) cost about 9 us per request, more than building the
    line. That is all skipped only in the data plane's own configuration
    (``configure_logging``): the access logger and its ancestors have no handler or filter
    of their own, and the root's only handler is the batched one with the request-id
    filter and one of our formatters. Anything else (a test's caplog, an application
    embedding the data plane) goes through logging as usual; the check is a few attribute
    reads, made per line, so a configuration changed at run time is followed.
    """
    if access_log.handlers or access_log.filters or not access_log.propagate or access_log.disabled:
        return None
    logger = access_log.parent
    while logger is not None and logger is not _root:
        if logger.handlers or not logger.propagate:
            return None
        logger = logger.parent
    handlers = _root.handlers
    if len(handlers) != 1:
        return None
    handler = handlers[0]
    if (type(handler) is not BatchedStreamHandler or handler.filters != [_FILTER] or handler.level > logging.INFO
            or type(handler.formatter) not in _DIRECT_FORMATTERS):
        return None
    return handler


def write_access_line(handler: BatchedStreamHandler, line: str) -> None:
    """``line`` as the access logger would have written it through ``handler``."""
    write_access_lines(handler, [(line, current_request_id.get())])


def write_access_lines(handler: BatchedStreamHandler, lines: list[tuple[str, str]]) -> None:
    """(line, request id) pairs as the access logger would have written each through
    ``handler``, stamped with one time (they end in the same loop turn), in one write."""
    # The formatters read only these fields of a record (the test compares their bytes).
    now = time.time()
    formatter = cast(logging.Formatter, handler.formatter)
    end = handler.terminator
    if type(formatter) is CachedTimeFormatter and formatter._fmt == LOG_FORMAT:
        head = f"{formatter.formatTime(cast(logging.LogRecord, _AccessRecord('', now, '')))} INFO {ACCESS_LOGGER}: "
        text = "".join([head + line + end for line, _ in lines])
    else:                                 # JsonFormatter: the request id is a field of each line
        text = "".join([formatter.format(cast(logging.LogRecord, _AccessRecord(line, now, rid))) + end
                        for line, rid in lines])
    handler.write_text(text)


def _direct_formatters() -> tuple[type, ...]:
    from omni_runtime.logs import JsonFormatter

    return (CachedTimeFormatter, JsonFormatter)


_DIRECT_FORMATTERS = _direct_formatters()


def configure_logging(level: str, fmt: str = "text") -> None:
    """The data plane's own process: its log format (``text``, or ``json``: one object per
    line, ``omni_runtime.logs``), request ids on every line, lines written in batches
    (``BatchedStreamHandler``)."""
    from omni_runtime.logs import JsonFormatter

    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, handlers=[BatchedStreamHandler(sys.stderr.fileno())])
    skip_unused_record_fields()
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter() if fmt == "json" else CachedTimeFormatter())
    _FILTER.prefix = fmt != "json"
    install_request_id_filter()


def install_request_id_filter() -> None:
    """Add the filter to the root logger's handlers (idempotent)."""
    for handler in logging.getLogger().handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


# A request whose handler is done: (tracker, route, status, client's id, client key id, request id).
Ended = tuple[RequestTracker, str, int, str, "str | None", str]


class Observer:
    """The end-of-request bookkeeping: metrics, access log, and the request's span."""

    def __init__(self, metrics: DataPlaneMetrics, *, access_log_on: bool = True, tracing=None) -> None:
        self.metrics = metrics
        self.access_log_on = access_log_on
        self.tracing = tracing          # dataplane.otel.Tracing or None

    def complete(self, t: RequestTracker, route: str, code: int, client_id: str = "",
                 key: str | None = None) -> None:
        """The handler is done with request ``t`` (answered ``code``): record it everywhere."""
        self.complete_all([(t, route, code, client_id, key, current_request_id.get())])

    def complete_all(self, ended: list[Ended]) -> None:
        """Requests whose handlers are done, in the order they ended: each recorded as
        ``complete`` does. The data plane collects those of one loop turn
        (``DataPlane.generate``): their access lines leave in one write, under one lock and
        one check of the logging setup, instead of one callback, check and write each."""
        lines: list[tuple[str, str]] | None = (
            [] if self.access_log_on and access_log.isEnabledFor(logging.INFO) else None)
        for t, route, code, client_id, key, rid in ended:
            try:
                if not t.done:
                    t.done = t.last_token or _now()
                self.metrics.count_request(route, code)
                if t.placed:
                    self._observe(t)
                if lines is not None:
                    lines.append((self.access_line(t, route, code, client_id, key), rid))
                if t.span is not None:
                    self.tracing.end_request(t, code)
            except Exception:   # bookkeeping never changes how a request ends, nor another's
                log.exception("recording a request's metrics and access log failed")
        if not lines:
            return
        handler = direct_access_handler()
        if handler is not None:
            write_access_lines(handler, lines)
            return
        for line, rid in lines:
            # makeRecord + handle: Logger.info would also walk the stack for the caller.
            record = access_log.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, line, (), None)
            record.json_message = True     # a JSON log embeds it whole (omni_runtime.logs)
            token = current_request_id.set(rid)
            try:
                access_log.handle(record)
            finally:
                current_request_id.reset(token)

    def _observe(self, t: RequestTracker) -> None:
        req = t.req
        assert req is not None   # placed: attach set it
        s = self.metrics.series(req.model, t.flow)
        # What Hist.observe and Count.inc do, inline for the series every placed request
        # updates (seven calls a request otherwise).
        s.flows.value += 1
        h, v = s.e2e, t.done - t.received
        h.counts[bisect_left(h.bounds, v)] += 1
        h.sum += v
        h, v = s.placement, t.placed_at - t.matched if t.matched else t.placed_at - t.received
        h.counts[bisect_left(h.bounds, v)] += 1
        h.sum += v
        h, v = s.queue, t.queued_ms / 1000
        h.counts[bisect_left(h.bounds, v)] += 1
        h.sum += v
        s.prompt_tokens.value += req.prompt_tokens
        if t.cached_tokens > 0:
            s.cached_tokens.value += t.cached_tokens
        if t.completion_tokens:
            s.generated_tokens.value += t.completion_tokens
        first = t.first_token_at
        prefill_end = t.prefill_answered or (first if t.stream else 0.0)
        if t.dispatched and prefill_end:
            s.prefill.observe(prefill_end - t.dispatched)
        decode_start = t.decode_dispatched if t.decode_dispatched >= prefill_end > 0 else (
            first if t.stream else 0.0)
        if decode_start and t.last_token:
            s.decode.observe(t.last_token - decode_start)
        if t.stream and first:
            s.ttft.observe(first - t.received)
            if t.completion_tokens > 1 and t.last_token > first:
                s.tpot.observe((t.last_token - first) / (t.completion_tokens - 1))

    def access_line(self, t: RequestTracker, route: str, code: int, client_id: str = "",
                    key: str | None = None) -> str:
        """``key``: the client's key id (``dataplane.auth.key_id``: a configured name or a
        hash prefix), never the key."""
        req = t.req
        t0 = t.received
        first, last, done, n = t.first_token_at, t.last_token, t.done, t.completion_tokens
        streamed = t.stream and first
        # Milliseconds since receipt, to the microsecond (int() is cheaper than round()).
        line = {
            "request_id": req.request_id if req is not None else None,
            "client_request_id": (req.client_id if req is not None else client_id) or None,
            "client_key": key,
            "route": route,
            "model": req.model[:200] if req is not None else None,
            "stream": t.stream,
            "flow": t.flow or None,
            "prefill_worker": t.prefill_worker or None,
            "decode_worker": t.decode_worker or None,
            "status": code,
            "outcome": t.outcome or ("rejected" if not t.placed else None),
            "prompt_tokens": req.prompt_tokens if req is not None else None,
            "completion_tokens": n,
            "cached_tokens": t.cached_tokens if t.cached_tokens >= 0 else None,
            "retries": t.retries,
            "recomputes": t.recomputes,
            "e2e_ms": int((done - t0) * 1e6) / 1000,
            "queued_ms": t.queued_ms,
            "ttft_ms": int((first - t0) * 1e6) / 1000 if streamed else None,
            "tpot_ms": (int((last - first) * 1e6 / (n - 1)) / 1000 if streamed and n > 1 and last > first else None),
            # Each stage as ms since the request was received (null: not reached).
            "stages_ms": {
                "tokenized": int((t.tokenized - t0) * 1e6) / 1000 if t.tokenized else None,
                "matched": int((t.matched - t0) * 1e6) / 1000 if t.matched else None,
                "placed": int((t.placed_at - t0) * 1e6) / 1000 if t.placed_at else None,
                "dispatched": int((t.dispatched - t0) * 1e6) / 1000 if t.dispatched else None,
                "prefill_answered": int((t.prefill_answered - t0) * 1e6) / 1000 if t.prefill_answered else None,
                "decode_dispatched": int((t.decode_dispatched - t0) * 1e6) / 1000 if t.decode_dispatched else None,
                "first_token": int((first - t0) * 1e6) / 1000 if first else None,
                "last_token": int((last - t0) * 1e6) / 1000 if last else None,
                "done": int((done - t0) * 1e6) / 1000,
            },
        }
        if t.error:
            line["error"] = t.error
            line["upstream_status"] = t.upstream_status
        if t.trace is not None:
            line["traceparent"] = t.trace["traceparent"]
        return orjson.dumps(line).decode()
