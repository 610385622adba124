"""This replica's view of the workers, indexed so a placement touches only its candidates.

Specs come from the store (every replica sees the same ones); health, engine metrics and
heartbeats are derived here, by this replica's own checks. All values are immutable and
replaced whole. The routable index maps (model, role) to the ids of the workers that may
get a placement right now; it is rebuilt only when a spec changes or a worker's health
flips, which is rare next to placements, so placement cost follows the candidates, not
the fleet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from controlplane.workers import (NO_METRICS, UNCHECKED, EngineMetrics, Health, HealthState, Load, Role,
                                  WorkerSpec, WorkerView)

_ALL_MODELS = ""


class Fleet:
    def __init__(self) -> None:
        self._specs: dict[str, WorkerSpec] = {}
        self._state: dict[str, HealthState] = {}
        self._engine: dict[str, EngineMetrics] = {}
        self._heartbeat: dict[str, float] = {}
        self._index: dict[tuple[str, Role], tuple[str, ...]] | None = None
        self._models: Counter[str] = Counter()
        self.placements: Counter[str] = Counter()   # per worker id, for listings

    # ------------------------------------------------------------------ specs

    def put(self, spec: WorkerSpec) -> WorkerSpec | None:
        old = self._specs.get(spec.id)
        if old is not None:
            self._models[old.model] -= 1
        self._specs[spec.id] = spec
        self._models[spec.model] += 1
        self._index = None
        return old

    def remove(self, worker_id: str) -> WorkerSpec | None:
        spec = self._specs.pop(worker_id, None)
        if spec is not None:
            self._models[spec.model] -= 1
            self._state.pop(worker_id, None)
            self._engine.pop(worker_id, None)
            self._heartbeat.pop(worker_id, None)
            self.placements.pop(worker_id, None)
            self._index = None
        return spec

    def get(self, worker_id: str) -> WorkerSpec | None:
        return self._specs.get(worker_id)

    def specs(self) -> list[WorkerSpec]:
        return list(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._specs

    def serves_model(self, model: str) -> bool:
        """Some worker is known to serve ``model``, or one's model is not discovered yet."""
        return not model or self._models[model] > 0 or self._models[""] > 0

    # ------------------------------------------------------------------ derived state

    def state(self, worker_id: str) -> HealthState:
        return self._state.get(worker_id, UNCHECKED)

    def set_state(self, worker_id: str, state: HealthState) -> None:
        if worker_id not in self._specs:
            return
        old = self._state.get(worker_id, UNCHECKED)
        self._state[worker_id] = state
        if old.health is not state.health:
            self._index = None

    def engine(self, worker_id: str) -> EngineMetrics:
        return self._engine.get(worker_id, NO_METRICS)

    def set_engine(self, worker_id: str, metrics: EngineMetrics) -> None:
        if worker_id in self._specs:
            self._engine[worker_id] = metrics

    def last_heartbeat(self, worker_id: str) -> float:
        return self._heartbeat.get(worker_id, 0.0)

    def beat(self, worker_id: str, now: float) -> None:
        if worker_id in self._specs:
            self._heartbeat[worker_id] = now

    def view(self, spec: WorkerSpec, load: Load) -> WorkerView:
        wid = spec.id
        return WorkerView(spec, load, self._state.get(wid, UNCHECKED), self._engine.get(wid, NO_METRICS))

    def views(self, ids: Iterable[str], loads: dict[str, Load]) -> list[WorkerView]:
        specs, state, engine = self._specs, self._state, self._engine
        return [WorkerView(specs[i], loads[i], state.get(i, UNCHECKED), engine.get(i, NO_METRICS))
                for i in ids if i in specs]

    # ------------------------------------------------------------------ the routable index

    def routable(self, model: str, role: Role) -> tuple[str, ...]:
        """Ids of healthy, undrained, positively weighted workers of ``role`` serving ``model``
        (any model when ``model`` is empty)."""
        index = self._index
        if index is None:
            index = self._index = self._build_index()
        return index.get((model, role), ())

    def _build_index(self) -> dict[tuple[str, Role], tuple[str, ...]]:
        groups: dict[tuple[str, Role], list[str]] = {}
        for wid, spec in self._specs.items():
            if not spec.placeable or self.state(wid).health is not Health.HEALTHY:
                continue
            groups.setdefault((spec.model, spec.role), []).append(wid)
            if spec.model:
                groups.setdefault((_ALL_MODELS, spec.role), []).append(wid)
        return {key: tuple(sorted(ids)) for key, ids in groups.items()}
