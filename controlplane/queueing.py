"""Runs the queue stage: requests held in the control plane until an engine can take them.

One queue per control plane, shared by every data plane (they all place through it). A
waiting request is a future its session answers when it resolves, so a held placement
never blocks the other placements of the same data plane. Whatever releases load (a
first token, a finished request) kicks the dispatcher; a short tick handles time (waits
that run out, starvation order).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from controlplane.scheduling.queue import HoldQueue
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

PlaceFn = Callable[[pb.PlaceRequest, str, bool], Awaitable["pb.Placement | None"]]

_TICK_S = 0.01
_ATTEMPTS_PER_ROUND = 8


@dataclass(eq=False, slots=True)
class Waiter:
    req: pb.PlaceRequest
    session: str
    future: asyncio.Future
    enqueued_at: float
    # What it would compute where it was last held (HoldQueue.take_work); until it has been
    # held once, its prompt's length. The queue's order weighs it.
    work_tokens: int
    held: bool = False      # a placement has held it at least once (its work_tokens is known)
    engine: str = ""        # the engine it was last held for (the queue's order weighs its work there)
    budget_s: float = 0.0   # its TTFT budget, known once held (0: not yet; the order's late_last)


class PlacementQueue:
    def __init__(self, stage: HoldQueue, place: PlaceFn) -> None:
        self.stage = stage
        self._place = place
        self._waiting: dict[str, Waiter] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.counters = {"queued": 0, "dispatched": 0, "rejected_full": 0, "timed_out": 0, "cancelled": 0}
        self.wait_s_total = 0.0

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for waiter in self._waiting.values():
            if not waiter.future.done():
                waiter.future.cancel()
        self._waiting.clear()

    # ------------------------------------------------------------------ entering and leaving

    def enqueue(self, req: pb.PlaceRequest, session: str) -> asyncio.Future[pb.Placement] | pb.Placement:
        if len(self._waiting) >= self.stage.max_size or req.request_id in self._waiting:
            self.counters["rejected_full"] += 1
            return self.refusal(req, "the placement queue is full")
        self.start()
        fut = asyncio.get_running_loop().create_future()
        waiter = Waiter(req, session, fut, time.monotonic(), req.prompt_tokens)
        self._noted(waiter)
        self._waiting[req.request_id] = waiter
        self.counters["queued"] += 1
        self._wake.set()
        return fut

    def _noted(self, waiter: Waiter) -> None:
        """Take the work the stage noted when it last held ``waiter``."""
        work = self.stage.take_work(waiter.req.request_id)
        if work is not None:
            waiter.work_tokens, waiter.engine, waiter.held = work.tokens, work.worker, True
            waiter.budget_s = work.budget_s

    def refusal(self, req: pb.PlaceRequest, why: str) -> pb.Placement:
        return pb.Placement(seq=req.seq, request_id=req.request_id, error=pb.OVERLOADED, error_message=why,
                            retry_after_s=max(self.stage.max_wait_s / 2, 1.0))

    def cancel(self, request_id: str) -> bool:
        """The client went away while its request waited: it leaves at once."""
        waiter = self._waiting.pop(request_id, None)
        if waiter is None:
            return False
        self.counters["cancelled"] += 1
        self.stage.forget(request_id)
        if not waiter.future.done():
            waiter.future.cancel()
        return True

    def cancel_session(self, session: str) -> int:
        gone = [rid for rid, w in self._waiting.items() if w.session == session]
        for rid in gone:
            self.cancel(rid)
        return len(gone)

    def kick(self) -> None:
        """Load was released somewhere: a waiting request may fit now."""
        if self._waiting:
            self._wake.set()

    # ------------------------------------------------------------------ dispatch

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            else:
                try:
                    await asyncio.wait_for(self._wake.wait(), _TICK_S)
                except TimeoutError:
                    pass
            self._wake.clear()
            try:
                await self.dispatch()
            except Exception:  # never let a bug stop the queue: waiting requests would hang
                log.exception("placement queue dispatch failed")

    async def dispatch(self) -> int:
        """Bind what can be bound now; returns how many left the queue."""
        now = time.monotonic()
        done = 0
        stage = self.stage
        for waiter in [w for w in self._waiting.values() if now - w.enqueued_at >= stage.max_wait_s]:
            self.counters["timed_out"] += 1
            if stage.on_timeout == "reject":
                self._resolve(waiter, self.refusal(waiter.req, "waited too long for a free engine"), now)
            else:
                placement = await self._place(waiter.req, waiter.session, False)
                assert placement is not None   # without hold, placing always answers (maybe a refusal)
                self._resolve(waiter, placement, now)
            done += 1
        ordered = stage.order(list(self._waiting.values()), now)
        # The first in order, then those never tried yet (entered while others waited): their
        # work is known only once a placement has held them, and until then their prompt's
        # length may keep them out of the first few for good.
        tries = ordered[:_ATTEMPTS_PER_ROUND]
        tries += [w for w in ordered[_ATTEMPTS_PER_ROUND:] if not w.held][:_ATTEMPTS_PER_ROUND]
        for waiter in tries:
            if waiter.req.request_id not in self._waiting:
                continue   # cancelled while an earlier one was placed
            placement = await self._place(waiter.req, waiter.session, True)
            if placement is None:
                self._noted(waiter)
                continue   # its engines are still busy; another model's may not be
            self._resolve(waiter, placement, now)
            done += 1
        return done

    def _resolve(self, waiter: Waiter, placement: pb.Placement, now: float) -> None:
        if self._waiting.pop(waiter.req.request_id, None) is None:
            return
        self.stage.forget(waiter.req.request_id)
        waited = now - waiter.enqueued_at
        placement.queued_ms = waited * 1000
        self.wait_s_total += waited
        self.counters["dispatched"] += 1
        if not waiter.future.done():
            waiter.future.set_result(placement)
