"""The queue stage: late binding (Omni's request holding), as a policy.

Committing a request to an engine the moment it arrives piles a burst into engine queues
that are first come, first served, and the engine that frees up first is rarely the one
that was chosen. With this stage a request whose best engine is predicted to be busy for
longer than ``hold_s`` waits in the control plane instead, where waiting requests are
ordered by Omni's weight of prompt shortness and waiting time (0.8 / 0.2), and is bound
to an engine only when one can start it soon. A request that has waited ``starvation_s``
goes ahead of every shorter one. The queue is bounded in size (beyond: refused, HTTP 429)
and in wait (beyond: placed on the best engine anyway, or refused: ``on_timeout``).

This class is the policy; ``controlplane.queueing`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.scheduling.base import PlacementContext
from controlplane.workers import Role, WorkerView


@dataclass
class HoldQueue:
    max_size: int = 1024
    max_wait_s: float = 3.0
    hold_s: float = 0.15
    max_running: int = 0            # also hold while the best engine runs this many (0: off)
    shortness_weight: float = 0.8
    wait_weight: float = 0.2
    starvation_s: float = 1.0
    on_timeout: str = "place"       # place | reject
    name: str = "omni"

    def __post_init__(self) -> None:
        if self.on_timeout not in ("place", "reject"):
            raise ValueError(f"on_timeout must be place or reject, got {self.on_timeout!r}")
        for key in ("max_wait_s", "hold_s", "starvation_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0")
        if self.max_size < 1:
            raise ValueError("max_size must be >= 1")

    def should_hold(self, ctx: PlacementContext, chosen: WorkerView) -> bool:
        """Hold while even the best engine has more than ``hold_s`` of prefill work ahead."""
        if self.max_running:
            # A prefill engine is busy with the prompts it still computes, not with those whose
            # KV it only keeps until a decode engine pulls it (sequential PD).
            load = chosen.load
            if (load.prefills if chosen.spec.role is Role.PREFILL else load.requests) >= self.max_running:
                return True
        if ctx.predictor is None or not chosen.load.prefill_tokens:
            return False
        seconds_per_token = ctx.predictor.model(chosen.id).ttft.b
        return chosen.load.prefill_tokens * seconds_per_token > self.hold_s

    def order(self, waiting: list, now: float) -> list:
        """Waiting requests (objects with ``prompt_tokens`` and ``enqueued_at``), best first."""
        if len(waiting) < 2:
            return list(waiting)
        longest = max(w.prompt_tokens for w in waiting) or 1
        oldest = max(now - w.enqueued_at for w in waiting) or 1e-9
        sw, ww, starve = self.shortness_weight, self.wait_weight, self.starvation_s

        def key(w):
            waited = now - w.enqueued_at
            if waited >= starve:
                return (0, w.enqueued_at)            # starved: first come, first served
            return (1, -(sw * (1.0 - w.prompt_tokens / longest) + ww * waited / oldest))

        return sorted(waiting, key=key)


QUEUES = {"omni": HoldQueue}
