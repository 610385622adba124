"""Continuous-batching cost model: one async loop that plays vLLM's v1 scheduler.

The sim's latencies are the product: they come from the same mechanics a real engine has
(queueing behind ``max_num_seqs``, chunked prefill under a per-step token budget, KV-block
pressure and preemption, one decode token per running sequence per step), each step
lasting what the cost model says. Handlers never compute timings themselves.

The loop is split into ``plan_step`` / ``step_duration`` / ``complete_step`` so tests can
drive the scheduler step by step without waiting for real time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from simulator.config import SimConfig
from simulator.tokens import VOCAB, next_token

log = logging.getLogger(__name__)

NEW, WAITING, RUNNING, FINISHED = "new", "waiting", "running", "finished"
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# When the event loop falls behind (a noisy host, a burst of HTTP work), the model clock
# catches up by running steps back to back, but never by more than this: a long stall
# should not be repaid with a burst of instant tokens.
_MAX_CATCH_UP_S = 0.02


@dataclass(eq=False, slots=True)
class SimRequest:
    """One sequence inside the engine, plus the hooks its HTTP handler waits on."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    rng: int
    arrival: float
    external_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    # Set on a prefill node that keeps the KV for a decode node; called with the number
    # of blocks handed over when the request finishes normally.
    hold_kv: Callable[["SimRequest", int], None] | None = None
    output: list[int] = field(default_factory=list)
    status: str = NEW
    prefill_remaining: int = 0
    num_computed: int = 0
    blocks: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.status == FINISHED


class EngineObserver(Protocol):
    """Receives per-request milestones (metrics); called synchronously from the loop."""

    def on_first_token(self, req: SimRequest, now: float) -> None: ...

    def on_finished(self, req: SimRequest, now: float) -> None: ...


@dataclass
class EngineTotals:
    """Monotonic counters; /metrics and /sim/state read them at scrape time."""

    requests: int = 0
    prompt_tokens: int = 0
    prompt_tokens_local: int = 0
    prompt_tokens_external: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))


@dataclass(slots=True)
class StepPlan:
    """What one engine step computes: prompt chunks and single decode tokens."""

    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: list[SimRequest] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for _, chunk in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Engine:
    """Waiting queue + running batch + KV block pool, advanced one step at a time."""

    def __init__(self, cfg: SimConfig, observer: EngineObserver | None = None) -> None:
        self.cfg = cfg
        self.observer = observer
        self.totals = EngineTotals()
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._used_blocks = 0
        self._held_blocks = 0
        self._remote_kv_waits = 0
        self._next_block_id = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Set if the loop crashed; /health then answers 503, like vLLM's EngineDeadError.
        self.dead = False

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        self.abort_all()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ---- request API -----------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """Queue a request; prompt tokens already delivered by a KV transfer skip prefill."""
        req.external_tokens = min(req.external_tokens, req.prompt_tokens)
        req.num_computed = req.external_tokens
        req.prefill_remaining = req.prompt_tokens - req.external_tokens
        req.status = WAITING
        t = self.totals
        t.requests += 1
        t.prompt_tokens += req.prompt_tokens
        t.prompt_tokens_external += req.external_tokens
        t.prompt_tokens_local += req.prefill_remaining
        self._waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request wherever it is (client went away) and free its KV blocks."""
        if req.status == WAITING:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
        elif req.status == RUNNING:
            self._running.remove(req)
        else:
            return
        self._finish(req, "abort", asyncio.get_running_loop().time())

    def abort_all(self) -> None:
        for req in [*self._running, *self._waiting]:
            self.abort(req)

    @contextmanager
    def remote_kv_wait(self) -> Iterator[None]:
        """Count a request whose KV is in flight from a prefill node as waiting, as vLLM does."""
        self._remote_kv_waits += 1
        try:
            yield
        finally:
            self._remote_kv_waits -= 1

    def release_held_blocks(self, blocks: int) -> None:
        """A prefill node's KV lease ended (pulled or expired): the blocks are free again."""
        blocks = min(blocks, self._held_blocks)
        self._held_blocks -= blocks
        self._used_blocks -= blocks
        self._wake.set()

    def block_ids(self, count: int) -> list[int]:
        """Synthetic, distinct-looking block ids for kv_transfer_params."""
        start = self._next_block_id
        self._next_block_id = (start + count) % self.cfg.num_gpu_blocks
        n = self.cfg.num_gpu_blocks
        return [(start + i) % n for i in range(count)]

    # ---- state -----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + self._remote_kv_waits

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return self._remote_kv_waits

    @property
    def used_blocks(self) -> int:
        return self._used_blocks

    @property
    def held_blocks(self) -> int:
        return self._held_blocks

    @property
    def kv_cache_usage(self) -> float:
        return min(1.0, self._used_blocks / self.cfg.num_gpu_blocks)

    # ---- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine loop crashed; aborting all requests")
            self.dead = True
            self.abort_all()
            raise

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        model_clock = loop.time()
        while True:
            plan = self.plan_step()
            if not plan:
                self._wake.clear()
                await self._wake.wait()
                model_clock = loop.time()
                continue
            now = loop.time()
            duration = self.step_duration(plan)
            end = max(model_clock, now - _MAX_CATCH_UP_S) + duration
            delay = end - now
            # sleep(0) still yields, so handlers get to write between back-to-back steps.
            await asyncio.sleep(delay if delay > 0 else 0)
            model_clock = end
            self.totals.busy_s += duration
            self.complete_step(plan, loop.time())

    def step_duration(self, plan: StepPlan) -> float:
        cfg = self.cfg
        ms = cfg.prefill_ms_per_token * plan.prefill_tokens
        if plan.decode:
            ms += cfg.decode_ms_per_step + cfg.decode_ms_per_seq * len(plan.decode)
        return ms / 1000.0

    def plan_step(self) -> StepPlan:
        """vLLM v1 order: running requests first (preempting from the tail when KV runs
        out), then admit waiting requests while seats, budget and KV blocks allow."""
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens
        preemptions_before = self.totals.preemptions
        for req in list(self._running):
            if budget <= 0:
                break
            if req.status != RUNNING:  # preempted earlier in this pass
                continue
            tokens = min(req.prefill_remaining, budget) if req.prefill_remaining else 1
            if not self._allocate_running(req, tokens):
                continue
            budget -= tokens
            if req.prefill_remaining:
                plan.prefill.append((req, tokens))
            else:
                plan.decode.append(req)
        if self.totals.preemptions != preemptions_before:
            return plan  # vLLM admits nothing in a step that had to preempt
        while self._waiting and budget > 0 and len(self._running) < self.cfg.max_num_seqs:
            req = self._waiting[0]
            tokens = min(req.prefill_remaining, budget) if req.prefill_remaining else 1
            need = self._blocks_needed(req, tokens)
            if need > self.cfg.num_gpu_blocks - self._used_blocks:
                break
            self._waiting.popleft()
            self._take_blocks(req, need)
            req.status = RUNNING
            self._running.append(req)
            self.totals.prefix_cache_queries += req.prompt_tokens
            budget -= tokens
            if req.prefill_remaining:
                plan.prefill.append((req, tokens))
            else:
                plan.decode.append(req)
        return plan

    def complete_step(self, plan: StepPlan, now: float) -> None:
        """Apply a planned step: advance prefills, emit one token per finished prefill/decode."""
        self.totals.steps += 1
        finished_any = False
        for req, chunk in plan.prefill:
            if req.status != RUNNING:  # aborted while the step ran
                continue
            req.num_computed += chunk
            req.prefill_remaining -= chunk
            if req.prefill_remaining == 0:
                finished_any |= self._emit(req, now)
        for req in plan.decode:
            if req.status != RUNNING:
                continue
            req.num_computed += 1
            finished_any |= self._emit(req, now)
        if finished_any:
            self._running = [r for r in self._running if r.status == RUNNING]

    # ---- internals -------------------------------------------------------------------

    def _emit(self, req: SimRequest, now: float) -> bool:
        req.rng, token = next_token(req.rng)
        req.output.append(token)
        self.totals.generation_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = now
            if self.observer is not None:
                self.observer.on_first_token(req, now)
        if token in req.stop_ids:  # checked first: in vLLM a stop string overrides the length cap
            req.stop_reason = VOCAB[token].strip()
            self._finish(req, "stop", now)
            return True
        if len(req.output) >= req.max_tokens:
            self._finish(req, "length", now)
            return True
        req.progress.set()
        return False

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        """Mark finished; the caller has already taken it out of the waiting queue, and the
        running list is compacted by the step (or by abort)."""
        if req.status == RUNNING:
            if req.hold_kv is not None and reason != "abort":
                blocks, req.blocks = req.blocks, 0
                self._held_blocks += blocks
                req.hold_kv(req, blocks)
            else:
                self._free(req)
        req.status = FINISHED
        req.finish_reason = reason
        req.finished_at = now
        self.totals.finished[reason] = self.totals.finished.get(reason, 0) + 1
        if self.observer is not None:
            self.observer.on_finished(req, now)
        req.progress.set()
        req.finished.set()

    def _blocks_needed(self, req: SimRequest, new_tokens: int) -> int:
        return math.ceil((req.num_computed + new_tokens) / self.cfg.block_size) - req.blocks

    def _take_blocks(self, req: SimRequest, count: int) -> None:
        if count > 0:
            req.blocks += count
            self._used_blocks += count

    def _free(self, req: SimRequest) -> None:
        self._used_blocks -= req.blocks
        req.blocks = 0

    def _allocate_running(self, req: SimRequest, tokens: int) -> bool:
        """Find KV blocks for a running request, preempting the newest running requests
        (possibly ``req`` itself) like vLLM's recompute preemption. False if ``req`` lost."""
        need = self._blocks_needed(req, tokens)
        while need > self.cfg.num_gpu_blocks - self._used_blocks:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        self._take_blocks(req, need)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self._running.pop()
        self._free(req)
        # Recompute preemption: prompt and already generated tokens are prefilled again.
        req.num_computed = 0
        req.prefill_remaining = req.prompt_tokens + len(req.output)
        req.status = WAITING
        self._waiting.appendleft(req)
        self.totals.preemptions += 1
