"""``--log-format text|json`` for every omni-proxy process (control plane, data plane, simulator, up).

``json`` writes one object per line, for a log pipeline to read without a grok pattern::

    {"ts":"2026-11-26T23:57:19.123Z","level":"INFO","logger":"controlplane.health",
     "message":"worker p0 (http://10.0.0.5:8000) is healthy","worker":"p0"}

Fields: ``ts`` (UTC, milliseconds), ``level``, ``logger``, ``message``; ``request_id`` and
``worker`` when the record knows them (the data plane's request-id filter sets the first;
``extra={"worker": id}`` the second); ``exc`` with the traceback of ``log.exception``. A
record whose message is already a JSON object (the data plane's access line, flagged
``json_message``) is embedded whole under ``access`` (``orjson.Fragment``: not parsed
again). Built on orjson, which every process already has; no new dependency.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_log_arguments(parser, *, level: bool = True) -> None:
    """``--log-format`` (and ``--log-level``) as every process spells them."""
    if level:
        from omni_runtime import flags

        parser.add_argument("--log-level", type=flags.log_level, default="INFO",
                            help="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text (default) or json: one JSON object per line (ts, level, logger, message, "
                             "request_id and worker where known)")


class JsonFormatter(logging.Formatter):
    """One JSON object per record; the timestamp's second is formatted once per second."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._prefix = ""

    def _ts(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return f"{self._prefix}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": self._ts(record.created), "level": record.levelname, "logger": record.name}
        if getattr(record, "json_message", False):
            out["message"] = "access"
            out["access"] = orjson.Fragment(record.msg)
        else:
            out["message"] = record.getMessage()
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        worker = getattr(record, "worker", None)
        if worker:
            out["worker"] = worker
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return orjson.dumps(out, default=str).decode()


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str, fmt: str = "text") -> None:
    """The root logger of a process: ``level`` and ``fmt`` on stderr (basicConfig's handler)."""
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
    if fmt == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
