"""Filters: each removes workers for one reason, named in ``omni-ctl explain``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from controlplane.scheduling.base import PlacementContext
from controlplane.scheduling.latency import SLOFilter
from controlplane.workers import Health, WorkerView


class ModelFilter:
    name = "model"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return worker.serves(ctx.model)


class RoleFilter:
    """Only workers that can run this leg (entry: aggregated or prefill)."""

    name = "role"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return worker.role in ctx.roles


class HealthyFilter:
    name = "healthy"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return worker.health is Health.HEALTHY


class EjectedFilter:
    """The circuit breaker: a worker failing real requests sits out until it is let back."""

    name = "ejected"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return not worker.state.ejected(ctx.now or time.monotonic())


class DrainFilter:
    """Draining workers finish what they have but take nothing new."""

    name = "draining"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return not worker.draining


class ExcludeFilter:
    """Retries name the workers that already failed this request."""

    name = "excluded"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return worker.id not in ctx.exclude


class ZeroWeightFilter:
    """Weight 0 is an operator's way to park a worker without draining it."""

    name = "zero_weight"

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return worker.weight > 0


@dataclass
class OverloadFilter:
    """Skip workers over a request or token budget (Omni's overload protection).

    If every candidate is over budget the pipeline keeps them all rather than refuse:
    queueing at the engine beats failing the request.
    """

    max_requests: int = 32
    max_tokens: int = 32000
    name: str = "overload"
    soft: bool = True

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return worker.inflight_requests < self.max_requests and worker.inflight_tokens < self.max_tokens


# Always applied, in this order: they encode correctness, not preference.
BASE_FILTERS = (ModelFilter(), RoleFilter(), HealthyFilter(), EjectedFilter(), DrainFilter(), ExcludeFilter(),
                ZeroWeightFilter())

FILTERS = {"overload": OverloadFilter, "slo": SLOFilter}
