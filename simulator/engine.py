"""Continuous-batching cost model: one async loop that plays vLLM's v1 scheduler.

The sim's latencies are the product: they come from the same mechanics a real engine has
(queueing behind ``max_num_seqs``, chunked prefill under a per-step token budget, KV-block
pressure and preemption, one decode token per running sequence per step), each step
lasting what the cost model says. Handlers never compute timings themselves.

KV blocks come from a ``BlockPool`` with vLLM's automatic prefix caching: a request's full
blocks are cached under vLLM's chained block hashes (``kvhash.hashing``, the
same code the router uses), a new request reuses the longest cached prefix and is charged
prefill time only for the rest, and the pool's BlockStored/BlockRemoved/AllBlocksCleared
events go to ``on_events`` once per step (the ZMQ publisher in ``kv_events``).

The loop is split into ``plan_step`` / ``step_duration`` / ``complete_step`` so tests can
drive the scheduler step by step without waiting for real time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from kvhash.hashing import BlockHashConfig, BlockHasher, UnreproducibleHashError
from omni_runtime import cancel_and_wait
from simulator.block_pool import BlockPool, KVBlock, PoolEvent
from simulator.config import SimConfig
from simulator.tokens import VOCAB, next_token

log = logging.getLogger(__name__)

NEW, WAITING, RUNNING, FINISHED = "new", "waiting", "running", "finished"
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# When the event loop falls behind (a noisy host, a burst of HTTP work), the model clock
# catches up by running steps back to back, but never by more than this: a long stall
# should not be repaid with a burst of instant tokens.
_MAX_CATCH_UP_S = 0.02


class _LoraKw(TypedDict, total=False):
    lora_name: str
    lora_path: str


def _lora_kw(req: SimRequest) -> _LoraKw:
    return {"lora_name": req.lora[0], "lora_path": req.lora[1]} if req.lora else {}


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
    # The prompt's token ids (None: the request takes no part in prefix caching) and the
    # body's cache_salt, which salts the first block's hash.
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    # The LoRA adapter (name, path) the request names: its key goes into every block's hash.
    lora: tuple[str, str] | None = None
    # Set on a prefill node that keeps the KV for a decode node; called with the blocks
    # handed over when the request finishes normally (release them with release_held).
    hold_kv: Callable[[SimRequest, HeldKv], None] | None = None
    output: list[int] = field(default_factory=list)
    status: str = NEW
    prefill_remaining: int = 0
    num_computed: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    # Prefix caching: the hash chain over prompt + output (full blocks only), how many of
    # ``blocks`` are registered in the cache, and vLLM's num_cached_tokens (local prefix-cache
    # hits plus KV received from a prefill node, fixed at the first admission).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    hashed: bool = False
    finish_reason: str | None = None
    stop_reason: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.status == FINISHED

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (vLLM's ``request.num_tokens``)."""
        return self.prompt_tokens + len(self.output)

    def token_range(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        p = self.token_ids
        assert p is not None
        n = len(p)
        if end <= n:
            return p[start:end]
        if start >= n:
            return self.output[start - n:end - n]
        return p[start:] + self.output[:end - n]


@dataclass(eq=False)
class HeldKv:
    """A finished prefill's blocks, kept for a decode node until ``Engine.release_held``."""

    blocks: list[KVBlock]
    owner: Any = None   # the Engine (DP rank) whose pool the blocks belong to

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class EngineObserver(Protocol):
    """Receives per-request milestones (metrics); called synchronously from the loop."""

    def on_first_token(self, req: SimRequest, now: float) -> None: ...

    def on_finished(self, req: SimRequest, now: float) -> None: ...


@dataclass
class EngineTotals:
    """Monotonic counters; /metrics and /sim/state read them at scrape time."""

    requests: int = 0
    prompt_tokens: int = 0
    # By source, counted at each request's first admission (vLLM's prompt_tokens_by_source):
    # computed here, reused from the local prefix cache, received by KV transfer.
    prompt_tokens_local: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_external: int = 0
    generation_tokens: int = 0
    # vLLM's prefix-cache stats, in tokens, for requests admitted the first time.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
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


class Stepper(Protocol):
    """What ``drive`` advances: one engine, or a DP group whose ranks step together."""

    def plan_step(self) -> Any: ...

    def step_duration(self, plan: Any) -> float: ...

    def account(self, plan: Any, duration: float) -> None: ...

    def complete_step(self, plan: Any, now: float) -> None: ...


async def drive(stepper: Stepper, wake: asyncio.Event) -> None:
    """The model clock: plan a step, let it last what the cost model says, apply it; sleep
    on ``wake`` while there is nothing to do (a submit or a freed block sets it)."""
    loop = asyncio.get_running_loop()
    model_clock = loop.time()
    while True:
        plan = stepper.plan_step()
        if not plan:
            wake.clear()
            await wake.wait()
            model_clock = loop.time()
            continue
        now = loop.time()
        duration = stepper.step_duration(plan)
        end = max(model_clock, now - _MAX_CATCH_UP_S) + duration
        delay = end - now
        # sleep(0) still yields, so handlers get to write between back-to-back steps.
        await asyncio.sleep(delay if delay > 0 else 0)
        model_clock = end
        stepper.account(plan, duration)
        stepper.complete_step(plan, loop.time())


class Engine:
    """Waiting queue + running batch + KV block pool, advanced one step at a time."""

    def __init__(self, cfg: SimConfig, observer: EngineObserver | None = None,
                 wake: asyncio.Event | None = None) -> None:
        self.cfg = cfg
        self.observer = observer
        self.totals = EngineTotals()
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self.pool = BlockPool(cfg.num_gpu_blocks, enable_caching=cfg.enable_prefix_caching)
        self.hasher = _make_hasher(cfg) if cfg.enable_prefix_caching else None
        # Receives each step's KV events (set_event_sink); the pool records none without it.
        self._on_events: Callable[[list[PoolEvent]], None] | None = None
        self._held_blocks = 0
        self._remote_kv_waits = 0
        self._next_block_id = 0
        # Set when there may be work; a DP group's ranks share their group's (``dp_barrier``).
        self._wake = wake if wake is not None else asyncio.Event()
        self._task: asyncio.Task | None = None
        # Set if the loop crashed; /health then answers 503, like vLLM's EngineDeadError.
        self.dead = False
        # Step times are multiplied by this (the ``slowdown`` fault of /sim/faults).
        self.slowdown = 1.0

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        self.abort_all()
        await cancel_and_wait(self._task)
        self._task = None

    def set_event_sink(self, sink: Callable[[list[PoolEvent]], None] | None) -> None:
        """Publish KV events: ``sink`` gets each step's events (never an empty list)."""
        self._on_events = sink
        self.pool.record_events = sink is not None and self.pool.enable_caching

    # ---- request API -----------------------------------------------------------------

    def prepare(self, req: SimRequest) -> None:
        """Compute the prompt's block hashes (once; vLLM does it when the request is created)."""
        if req.hashed:
            return
        req.hashed = True
        if self.hasher is not None and req.token_ids is not None:
            req.block_hashes = self.hasher.block_hashes(req.token_ids, cache_salt=req.cache_salt,
                                                        **_lora_kw(req))

    def cached_prefix_tokens(self, req: SimRequest) -> int:
        """Prompt tokens a prefix-cache lookup would reuse right now (nothing is touched)."""
        self.prepare(req)
        bs = self.cfg.block_size
        return len(self.pool.longest_hit(req.block_hashes, (req.prompt_tokens - 1) // bs)) * bs

    def submit(self, req: SimRequest) -> None:
        """Queue a request; prompt tokens already delivered by a KV transfer skip prefill,
        and so do those found in the prefix cache when it is admitted."""
        self.prepare(req)
        req.external_tokens = min(req.external_tokens, req.prompt_tokens)
        req.num_computed = 0
        req.prefill_remaining = req.prompt_tokens
        req.status = WAITING
        t = self.totals
        t.requests += 1
        t.prompt_tokens += req.prompt_tokens
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

    def release_held(self, held: HeldKv) -> None:
        """A prefill node's KV lease ended (pulled or expired): the blocks are freed (and stay
        cached, evictable). Safe to call more than once."""
        if held.owner is not None and held.owner is not self:   # another DP rank's blocks
            held.owner.release_held(held)
            return
        blocks, held.blocks = held.blocks, []
        if blocks:
            self._held_blocks -= len(blocks)
            self.pool.free_blocks(reversed(blocks))
            self._wake.set()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache``: refused while blocks are in use, unless running
        requests are first preempted (``reset_running_requests``); publishes AllBlocksCleared."""
        if reset_running_requests:
            while self._running:
                self._preempt(self._running[-1])
            self._wake.set()
        ok = self.pool.reset_prefix_cache()
        self._flush_events()
        return ok

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
        """Blocks referenced by requests or held for decode nodes (cached free ones excluded)."""
        return self.pool.num_used

    @property
    def held_blocks(self) -> int:
        return self._held_blocks

    @property
    def kv_cache_usage(self) -> float:
        return min(1.0, self.pool.num_used / self.cfg.num_gpu_blocks)

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
        await drive(self, self._wake)

    def account(self, plan: StepPlan, duration: float) -> None:
        """Book a step that ran for ``duration`` (the engine's own work) as busy time."""
        self.totals.busy_s += duration

    def step_duration(self, plan: StepPlan) -> float:
        cfg = self.cfg
        ms = cfg.prefill_ms_per_token * plan.prefill_tokens
        if plan.decode:
            ms += cfg.decode_ms_per_step + cfg.decode_ms_per_seq * len(plan.decode)
        return ms * self.slowdown / 1000.0

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
        bs = self.cfg.block_size
        pool = self.pool
        while self._waiting and budget > 0 and len(self._running) < self.cfg.max_num_seqs:
            req = self._waiting[0]
            num_tokens = req.num_tokens
            # The longest cached prefix of full blocks, never the last token (vLLM recomputes
            # at least one to get logits), then KV a prefill node sent for the rest.
            hit = pool.longest_hit(req.block_hashes, (num_tokens - 1) // bs)
            hit_tokens = len(hit) * bs
            first = req.num_preemptions == 0
            external = max(0, req.external_tokens - hit_tokens) if first else 0
            computed = hit_tokens + external
            if computed >= num_tokens:
                # All of it arrived by transfer: like vLLM, recompute the last token, which
                # here is a decode step (remaining 0) rather than a one-token prefill.
                computed, remaining = num_tokens - 1, 0
            else:
                remaining = num_tokens - computed
            tokens = min(remaining, budget) if remaining else 1
            new = math.ceil((computed + tokens) / bs) - len(hit)
            evictable = sum(1 for b in hit if b.ref_cnt == 0)  # hits sitting in the free queue
            if new + evictable > pool.num_free:
                break
            self._waiting.popleft()
            pool.touch(hit)
            req.blocks = hit + pool.get_new_blocks(new)
            req.num_cached_blocks = len(hit)
            req.num_computed = computed
            req.prefill_remaining = remaining
            req.status = RUNNING
            self._running.append(req)
            if first:
                t = self.totals
                if pool.enable_caching:
                    t.prefix_cache_queries += num_tokens
                    t.prefix_cache_hits += hit_tokens
                req.cached_tokens = hit_tokens + external
                t.prompt_tokens_cached += hit_tokens
                t.prompt_tokens_external += external
                t.prompt_tokens_local += req.prompt_tokens - hit_tokens - external
            self._cache_blocks(req, computed + tokens)
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
        self._flush_events()

    # ---- internals -------------------------------------------------------------------

    def _emit(self, req: SimRequest, now: float) -> bool:
        req.rng, token = next_token(req.rng)
        req.output.append(token)
        self.totals.generation_tokens += 1
        if self.hasher is not None and req.token_ids is not None and req.num_tokens % self.cfg.block_size == 0:
            self._extend_hashes(req)
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
                held = HeldKv(req.blocks, self)
                req.blocks = []
                self._held_blocks += len(held.blocks)
                req.hold_kv(req, held)
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
        return math.ceil((req.num_computed + new_tokens) / self.cfg.block_size) - len(req.blocks)

    def _free(self, req: SimRequest) -> None:
        """Return a request's blocks, tail first: its full blocks stay cached (evictable)."""
        blocks, req.blocks = req.blocks, []
        req.num_cached_blocks = 0
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def _allocate_running(self, req: SimRequest, tokens: int) -> bool:
        """Find KV blocks for a running request, preempting the newest running requests
        (possibly ``req`` itself) like vLLM's recompute preemption. False if ``req`` lost."""
        need = self._blocks_needed(req, tokens)
        while need > self.pool.num_free:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += self.pool.get_new_blocks(need)
        self._cache_blocks(req, req.num_computed + tokens)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self._running.pop()
        self._free(req)
        # Recompute preemption: prompt and already generated tokens are prefilled again,
        # less whatever is still in the prefix cache when the request is readmitted.
        req.num_computed = 0
        req.prefill_remaining = req.num_tokens
        req.num_preemptions += 1
        req.status = WAITING
        self._waiting.appendleft(req)
        self.totals.preemptions += 1

    # ---- prefix caching --------------------------------------------------------------

    def _extend_hashes(self, req: SimRequest) -> None:
        """Hash the blocks that generated tokens have filled (vLLM hashes all token ids)."""
        assert self.hasher is not None
        bs = self.cfg.block_size
        start, end = len(req.block_hashes), req.num_tokens // bs
        if end > start:
            req.block_hashes += self.hasher.block_hashes(
                req.token_range(start * bs, end * bs), parent=req.block_hashes[-1] if start else None,
                first_block=start, cache_salt=req.cache_salt, **_lora_kw(req))

    def _cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Cache the request's blocks that are full once this step ran (vLLM caches at
        scheduling time, capped at the tokens known so far)."""
        if not self.pool.enable_caching or req.token_ids is None:
            return
        bs = self.cfg.block_size
        end = min(min(num_tokens, req.num_tokens) // bs, len(req.block_hashes), len(req.blocks))
        start = req.num_cached_blocks
        if end > start:
            self.pool.cache_full_blocks(req.blocks, req.block_hashes, start, end,
                                        req.token_range(start * bs, end * bs), bs, req.cache_salt)
            req.num_cached_blocks = end

    def _flush_events(self) -> None:
        if self._on_events is not None and self.pool.events:
            self._on_events(self.pool.take_events())


def _make_hasher(cfg: SimConfig) -> BlockHasher:
    """vLLM's hash setup: the algorithm flag and PYTHONHASHSEED; with no seed and an xxhash
    algorithm vLLM's NONE_HASH is random per process, and so is ours."""
    conf = BlockHashConfig(block_size=cfg.block_size, algo=cfg.prefix_caching_hash_algo,
                           python_hash_seed=cfg.python_hash_seed)
    try:
        return BlockHasher(conf)
    except UnreproducibleHashError:
        log.warning("%s with PYTHONHASHSEED unset: block hashes are random per process (as in vLLM)",
                    cfg.prefix_caching_hash_algo)
        return BlockHasher(BlockHashConfig(block_size=cfg.block_size, algo=cfg.prefix_caching_hash_algo,
                                           python_hash_seed=os.urandom(16).hex()))
