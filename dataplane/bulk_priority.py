"""Bulk work (long prompts' encode slices, block hashing) at a lower CPU priority than the event loop.

Under a burst of long prompts the data plane's loop thread needs a core for a fraction of a
millisecond at a time, while the encode threads and the hashing process want every core for
tens of milliseconds. At equal priority the kernel's fair scheduler makes the loop, once woken,
wait its turn behind them: the sixth session measured late ticks in which the loop ran 0.2-4.5
ms and waited for a core the rest of the time. Lowering only the bulk threads (Linux nice
values are per thread, and lowering one's own priority needs no privilege) should let the loop
take a core as soon as it wakes, while the bulk work still gets every idle cycle. Measured, it
did not pay on the bench's shared 2-core host (the default is 0, see ``DEFAULT_BULK_NICE``):
each launched process is its own scheduling group there (autogroup), so nice only orders the
data plane's own threads, and a lowered encode thread that must take the GIL back (its
results, the next slice) waits behind the loop and the bookkeeping threads.

Only threads that hold the GIL for a few microseconds at a time are lowered: the encode pool's
threads (the Rust encode runs with the GIL released) and the hashing process (its own
interpreter). The threads that do a prompt's Python bookkeeping stay at the loop's priority: a
lowered thread preempted while holding the GIL would make the loop wait for it (the inversion
that made an earlier try, every tokenizing thread at nice +5, slower on a loaded host).

``priority``: a nice increment (0 = unchanged, up to 19; the result is capped at 19) or
``"idle"`` (``SCHED_IDLE``: the thread runs only when a core has nothing else to run).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

IDLE = "idle"
MAX_NICE = 19
# Off by default: measured with bench/burst.py (docs/benchmarks/burst_text.md, "Bulk work below
# the loop's priority"), nice +10 made tokenized p50/p99, placement p99 and the longest stall
# worse at 1x on the final code (same tree, --bulk-nice 0 against 10, 3 repeats, load 5-6), and
# SCHED_IDLE stalled the loop up to 250 ms. An operator who shares the host with other work can
# still lower the bulk work.
DEFAULT_BULK_NICE = 0

BulkPriority = int | str     # a nice increment 0..19, or IDLE


def parse(text: str) -> BulkPriority:
    """argparse type of ``--bulk-nice``: an integer 0..19 or ``idle``."""
    if text.strip().lower() == IDLE:
        return IDLE
    try:
        value = int(text, 10)
    except (TypeError, ValueError):
        value = -1
    if not 0 <= value <= MAX_NICE:
        raise argparse.ArgumentTypeError(f"a nice increment from 0 to {MAX_NICE}, or 'idle', got {text!r}")
    return value


def lower_this_thread(priority: BulkPriority) -> None:
    """Lower the calling thread's CPU priority (Linux; elsewhere nothing: there a "process"
    priority would be the whole data plane's). A refusal is logged once, not raised: the work
    still runs, at the loop's priority."""
    if priority == 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        if priority == IDLE:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + int(priority)))
    except OSError as exc:
        _warn_once(exc)


_warned = False


def _warn_once(exc: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("bulk work stays at the event loop's CPU priority: %s", exc)
