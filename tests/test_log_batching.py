"""The data plane's log handler: lines leave in batches, warnings at once, nothing lost at close."""

from __future__ import annotations

import logging
import os

from dataplane.observe import BatchedStreamHandler
from tests.conftest import wait_until


def _readable(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def _logger(handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger("test_log_batching")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log


async def test_info_lines_are_batched_and_flushed_by_the_loop():
    r, w = os.pipe()
    os.set_blocking(r, False)
    handler = BatchedStreamHandler(w)
    log = _logger(handler)
    try:
        log.info("one")
        log.info("two")
        assert _readable(r) == b""       # buffered: the loop has not turned yet
        got = bytearray()

        async def both_lines() -> bool:
            got.extend(_readable(r))
            return got == b"one\ntwo\n"
        await wait_until(both_lines, timeout=5, what="the batched lines to be flushed")
        log.warning("now")               # warnings do not wait
        assert _readable(r) == b"now\n"
        log.info("last")
        handler.close()                  # closing flushes what is buffered
        assert _readable(r) == b"last\n"
    finally:
        handler.close()
        os.close(r)
        os.close(w)


def test_lines_logged_without_a_loop_are_written_at_once():
    r, w = os.pipe()
    os.set_blocking(r, False)
    handler = BatchedStreamHandler(w)
    try:
        _logger(handler).info("no loop here")
        assert _readable(r) == b"no loop here\n"
    finally:
        handler.close()
        os.close(r)
        os.close(w)
