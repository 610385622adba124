"""The DP barrier: the ranks of one data-parallel engine step together.

With data-parallel attention in front of expert-parallel (or tensor-parallel) MoE layers,
every forward pass of every rank meets the others in the MoE collectives (all-to-all /
all-gather), so the ranks cannot run steps of their own: vLLM's ``DPEngineCoreProc`` makes
an idle rank run a dummy batch so the others' collectives complete, SGLang's
``--enable-dp-attention`` runs idle batches the same way, and seed 003's PD-hybrid patch
(OmniInfer on vLLM) adds a global prefill/decode phase all-reduce on top. A step of the
group therefore lasts as long as its slowest rank's: a rank prefilling a long prompt holds
the decodes of every other rank for that long (the cost phase-aligned dispatch attacks).

``DpGroup`` plays that: one model clock for all ranks, each step planned on every rank,
lasting the longest plan, then applied to all. Without the barrier (``dp_barrier=False``,
a dense model whose ranks are independent engines) each rank keeps its own clock.

It also counts what the barrier costs, for benchmarks (``/sim/state``'s ``dp_barrier``):
steps, *mixed* steps (a rank prefilling while another only decodes, the decodes held) and
the rank-seconds ranks with work spent waiting for the slowest.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from omni_runtime import cancel_and_wait
from simulator.engine import Engine, StepPlan, drive


@dataclass
class BarrierStats:
    """Monotonic counters of the group's steps (read by ``/sim/state``)."""

    steps: int = 0
    # Steps where one rank prefilled while another had only decodes (held by the prefill).
    mixed_steps: int = 0
    # Sum over ranks with work of (the group's step time - the rank's own): time the barrier took.
    held_rank_s: float = 0.0
    # Sum of the group's step times (the time the group was busy).
    busy_s: float = 0.0
    # Steps where any rank prefilled, and the ranks prefilling summed over them: their ratio
    # is how many prefills share a phase (1: every prefill holds the others alone).
    prefill_steps: int = 0
    prefill_rank_steps: int = 0
    # Prefill phases (runs of consecutive steps with a prefill: each holds every rank's decodes
    # once) and the group time they took.
    prefill_phases: int = 0
    prefill_s: float = 0.0
    # The prefilling ranks' own step times summed over those steps: / prefill_s, how many
    # ranks prefilled at once, weighted by time (long chunks count for what they cost).
    prefill_work_s: float = 0.0

    def snapshot(self) -> dict:
        out = asdict(self)
        out["held_rank_s"] = round(self.held_rank_s, 6)
        out["busy_s"] = round(self.busy_s, 6)
        out["prefill_s"] = round(self.prefill_s, 6)
        out["prefill_work_s"] = round(self.prefill_work_s, 6)
        return out


class DpGroup:
    """The ranks of one DP engine, advanced in lockstep by one loop."""

    def __init__(self, engines: list[Engine], wake: asyncio.Event) -> None:
        # ``wake`` must be the event every rank was built with, so a submit to any rank wakes the group.
        self.engines = engines
        self._wake = wake
        self.stats = BarrierStats()
        self._task: asyncio.Task | None = None
        self._last_prefilled = False   # did the previous step prefill (a phase under way)?

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-dp-group")

    async def stop(self) -> None:
        for e in self.engines:
            e.abort_all()
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        try:
            await drive(self, self._wake)
        except asyncio.CancelledError:
            raise
        except Exception:
            for e in self.engines:   # like a rank's crash: every rank is dead (/health 503)
                e.dead = True
                e.abort_all()
            raise

    # ---- the Stepper protocol (engine.drive) -------------------------------------------

    def plan_step(self) -> list[StepPlan] | None:
        plans = [e.plan_step() for e in self.engines]
        return plans if any(plans) else None

    def step_duration(self, plans: list[StepPlan]) -> float:
        return max(e.step_duration(p) for e, p in zip(self.engines, plans, strict=True))

    def account(self, plans: list[StepPlan], duration: float) -> None:
        st = self.stats
        st.steps += 1
        st.busy_s += duration
        prefilling = 0
        decoding_only = False
        for e, p in zip(self.engines, plans, strict=True):
            if not p:
                continue
            own = e.step_duration(p)
            e.account(p, own)
            st.held_rank_s += duration - own
            if p.prefill:
                prefilling += 1
                st.prefill_work_s += own
            else:
                decoding_only = True
        if prefilling:
            st.prefill_steps += 1
            st.prefill_rank_steps += prefilling
            st.prefill_s += duration
            st.prefill_phases += not self._last_prefilled
            if decoding_only:
                st.mixed_steps += 1
        self._last_prefilled = prefilling > 0

    def complete_step(self, plans: list[StepPlan], now: float) -> None:
        for e, p in zip(self.engines, plans, strict=True):
            if p:
                e.complete_step(p, now)
