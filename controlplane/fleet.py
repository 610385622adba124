"""This replica's view of the workers, indexed so a placement touches only its candidates.

Specs come from the store (every replica sees the same ones); health, engine metrics and
heartbeats are derived here, by this replica's own checks. All values are immutable and
replaced whole. The routable index maps (model, role) to the ids of the workers that may
get a placement right now; it is rebuilt only when a spec changes or a worker's health
flips, which is rare next to placements, so placement cost follows the candidates, not
the fleet.

Above a few dozen candidates placement considers a bounded sample of a group
(``controlplane.scheduling.candidates``); for it a :class:`Group` keeps, built on first use
and dropped with the index, the group's least-loaded order (a lazy heap fed by the ledger's
load changes, :meth:`Fleet.note_load`) and its cumulative weights.
"""

from __future__ import annotations

import asyncio

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from controlplane.workers import (NO_METRICS, UNCHECKED, EngineMetrics, Health, HealthState, Load, Role,
                                  WorkerSpec, WorkerView)

_ALL_MODELS = ""
TOKENS_PER_REQUEST = 256     # the least-loaded order's work per request, as LeastLoadScorer's default


class Group:
    """The routable workers for one (model, roles) at one index version, and what bounded
    placement needs of them, each built on first use: O(group) once, O(log group) per query."""

    __slots__ = ("ids", "_fleet", "_members", "_heap", "_cum", "_uniform")

    def __init__(self, fleet: Fleet, ids: tuple[str, ...]) -> None:
        self.ids = ids
        self._fleet = fleet
        self._members: frozenset[str] | None = None
        self._heap: list[tuple[float, str]] | None = None
        self._cum: list[float] | None = None
        self._uniform: bool | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def members(self) -> frozenset[str]:
        if self._members is None:
            self._members = frozenset(self.ids)
        return self._members

    # ---- weights (random picks in O(log n)) ----------------------------------------------------

    @property
    def uniform(self) -> bool:
        if self._uniform is None:
            specs = self._fleet._specs
            first = specs[self.ids[0]].weight if self.ids else 1.0
            self._uniform = all(specs[i].weight == first for i in self.ids)
        return self._uniform

    @property
    def cumulative_weights(self) -> list[float]:
        if self._cum is None:
            specs = self._fleet._specs
            self._cum = list(itertools.accumulate(specs[i].weight for i in self.ids))
        return self._cum

    def weight(self, worker_id: str) -> float:
        return self._fleet._specs[worker_id].weight

    # ---- least-loaded order --------------------------------------------------------------------

    def _key(self, worker_id: str) -> float:
        fleet = self._fleet
        return fleet._work.get(worker_id, 0) / fleet._specs[worker_id].weight

    def _push(self, worker_id: str) -> None:
        heap = self._heap
        assert heap is not None
        heapq.heappush(heap, (self._key(worker_id), worker_id))
        if len(heap) > 3 * len(self.ids) + 64:     # stale entries: rebuild, amortised O(1) a push
            self._heap = None

    def least_loaded(self, k: int, skip: Sequence[str] | frozenset[str] = ()) -> list[str]:
        """The ``k`` workers with the least work (in-flight tokens + 256 per in-flight request,
        per unit of weight) by the ledger's counts, skipping ``skip``; ties in id order."""
        heap = self._heap
        if heap is None:
            if self._members is None:
                self._members = frozenset(self.ids)
            self._fleet._ordered.add(self)
            heap = self._heap = [(self._key(i), i) for i in self.ids]
            heapq.heapify(heap)
        out: list[str] = []
        keep: list[tuple[float, str]] = []
        seen: set[str] = set()
        work, specs = self._fleet._work, self._fleet._specs
        while heap and len(out) < k:
            entry = heapq.heappop(heap)
            key, wid = entry
            if wid in seen or key != work.get(wid, 0) / specs[wid].weight:
                continue                     # stale (the load changed since) or a duplicate
            seen.add(wid)
            keep.append(entry)
            if wid not in skip:
                out.append(wid)
        for entry in keep:
            heapq.heappush(heap, entry)
        return out


class Fleet:
    def __init__(self) -> None:
        self._specs: dict[str, WorkerSpec] = {}
        self._state: dict[str, HealthState] = {}
        self._engine: dict[str, EngineMetrics] = {}
        self._heartbeat: dict[str, float] = {}
        self._heard: set[str] = set()
        self._index: dict[tuple[str, Role], tuple[str, ...]] | None = None
        self._returns_at = 0.0        # when the first ejected worker comes back (0: none is out)
        self.version = 0              # grows whenever the routable set may have changed
        self._groups: dict[tuple[str, tuple[Role, ...]], Group] = {}
        self._ordered: set[Group] = set()              # groups whose least-loaded heap exists
        self._work: dict[str, int] = {}                # ledger work per worker (see note_load)
        self._view_cache: dict[str, WorkerView] = {}
        self._models: Counter[str] = Counter()
        self._loras: Counter[str] = Counter()       # LoRA adapter name -> workers serving it
        self.placements: Counter[str] = Counter()   # per worker id, for listings
        self._watchers: list[asyncio.Future] = []     # changed()'s, resolved at the next version

    # ------------------------------------------------------------------ specs

    def put(self, spec: WorkerSpec) -> WorkerSpec | None:
        old = self._specs.get(spec.id)
        if old is not None:
            self._models[old.model] -= 1
        self._specs[spec.id] = spec
        self._view_cache.pop(spec.id, None)
        self._models[spec.model] += 1
        self._invalidate()
        return old

    def remove(self, worker_id: str) -> WorkerSpec | None:
        spec = self._specs.pop(worker_id, None)
        if spec is not None:
            self._models[spec.model] -= 1
            self._loras.subtract(name for name, _ in self._state.pop(worker_id, UNCHECKED).loras)
            self._engine.pop(worker_id, None)
            self._heartbeat.pop(worker_id, None)
            self._heard.discard(worker_id)
            self.placements.pop(worker_id, None)
            self._work.pop(worker_id, None)
            self._view_cache.pop(worker_id, None)
            self._invalidate()
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
        return not model or self._models[model] > 0 or self._models[""] > 0 or self._loras[model] > 0

    def knew_model(self, model: str) -> bool:
        """Some worker served ``model`` since this replica started, even if none does now.

        Placement tells "not served here" (404) from "no worker for it right now" (503,
        retry): a model whose workers all went away for a while (a shared store that came
        back empty, every engine restarting) is the second.
        """
        return model in self._models or model in self._loras   # (a Counter keeps a model's key at 0)

    # ------------------------------------------------------------------ derived state

    def state(self, worker_id: str) -> HealthState:
        return self._state.get(worker_id, UNCHECKED)

    def set_state(self, worker_id: str, state: HealthState) -> None:
        if worker_id not in self._specs:
            return
        old = self._state.get(worker_id, UNCHECKED)
        self._state[worker_id] = state
        self._view_cache.pop(worker_id, None)
        if old.loras != state.loras:
            self._loras.subtract(name for name, _ in old.loras)
            self._loras.update(name for name, _ in state.loras)
            self._invalidate()
        elif old.health is not state.health or old.ejected_until != state.ejected_until:
            self._invalidate()

    def engine(self, worker_id: str) -> EngineMetrics:
        return self._engine.get(worker_id, NO_METRICS)

    def set_engine(self, worker_id: str, metrics: EngineMetrics) -> None:
        if worker_id in self._specs:
            self._engine[worker_id] = metrics
            self._view_cache.pop(worker_id, None)

    def last_heartbeat(self, worker_id: str) -> float:
        return self._heartbeat.get(worker_id, 0.0)

    def beat(self, worker_id: str, now: float, *, local: bool = True) -> None:
        """A heartbeat (or registration) at ``now``. ``local``: this replica heard it; only
        such workers are expired here, since their heartbeats go to this replica alone."""
        if worker_id in self._specs:
            self._heartbeat[worker_id] = now
            if local:
                self._heard.add(worker_id)

    def heard_from(self, worker_id: str) -> bool:
        return worker_id in self._heard

    def view(self, spec: WorkerSpec, load: Load) -> WorkerView:
        wid = spec.id
        return WorkerView(spec, load, self._state.get(wid, UNCHECKED), self._engine.get(wid, NO_METRICS))

    def views(self, ids: Iterable[str], loads: dict[str, Load]) -> list[WorkerView]:
        """Views of ``ids`` with ``loads``; a view is reused while its load is the same object
        (loads, specs, health and metrics are immutable, replaced on change: a worker's new
        spec, health or metrics drop its view, so only the load is compared here)."""
        cache = self._view_cache
        out = []
        for i in ids:
            v = cache.get(i)
            load = loads[i]
            if v is None or v.load is not load:
                spec = self._specs.get(i)
                if spec is None:
                    continue
                v = cache[i] = WorkerView(spec, load, self._state.get(i, UNCHECKED), self._engine.get(i, NO_METRICS))
            out.append(v)
        return out

    # ------------------------------------------------------------------ load order

    def note_load(self, worker_id: str, load: Load) -> None:
        """The ledger's load of a worker changed (a store's load listener, or placement after
        reading or reserving it): keeps the groups' least-loaded orders current in O(log n)."""
        work = load.tokens + TOKENS_PER_REQUEST * load.requests
        if self._work.get(worker_id, 0) == work:
            return
        spec = self._specs.get(worker_id)
        if spec is None:
            return
        self._work[worker_id] = work
        if self._ordered:
            entry = (work / spec.weight if spec.weight > 0 else float("inf"), worker_id)
            for group in self._ordered:
                heap, members = group._heap, group._members   # (members are set with the heap)
                if heap is not None and members is not None and worker_id in members:
                    heapq.heappush(heap, entry)
                    if len(heap) > 3 * len(group.ids) + 64:   # stale entries: rebuilt on next use
                        group._heap = None

    # ------------------------------------------------------------------ the routable index

    def changed(self) -> asyncio.Future:
        """A future resolved when the routable set may have changed next (a new ``version``):
        the sessions push their data planes' worker lists on it, not a second later."""
        fut = asyncio.get_running_loop().create_future()
        self._watchers.append(fut)
        return fut

    def _invalidate(self) -> None:
        self.version += 1
        if self._watchers:
            watchers, self._watchers = self._watchers, []
            for fut in watchers:
                if not fut.done():
                    fut.set_result(None)
        self._index = None
        self._groups = {}
        self._ordered = set()

    def group(self, model: str, roles: tuple[Role, ...]) -> Group:
        """The routable workers of ``roles`` serving ``model``, as a :class:`Group` (the same
        object until the index changes, so what it builds on demand is reused)."""
        key = (model, roles)
        group = self._groups.get(key)
        if group is None:
            ids = self.routable(model, roles[0]) if len(roles) == 1 else \
                tuple(i for role in roles for i in self.routable(model, role))
            group = self._groups[key] = Group(self, ids)
        return group

    def routable(self, model: str, role: Role) -> tuple[str, ...]:
        """Ids of healthy, undrained, positively weighted workers of ``role`` serving ``model``
        (any model when ``model`` is empty)."""
        index = self._index
        if index is None or (self._returns_at and time.monotonic() >= self._returns_at):
            self._invalidate()
            index = self._index = self._build_index()
        return index.get((model, role), ())

    def routable_specs(self) -> list[WorkerSpec]:
        """Every worker that may get a placement now (for the data planes' fallback lists)."""
        self.routable("", Role.BOTH)   # (re)builds the index when it is stale
        ids = {i for group in (self._index or {}).values() for i in group}
        return [self._specs[i] for i in sorted(ids)]

    def _build_index(self) -> dict[tuple[str, Role], tuple[str, ...]]:
        groups: dict[tuple[str, Role], list[str]] = {}
        now, returns = time.monotonic(), 0.0
        for wid, spec in self._specs.items():
            state = self.state(wid)
            if not spec.placeable or state.health is not Health.HEALTHY:
                continue
            if state.ejected(now):   # the circuit breaker: back in rotation at ejected_until
                returns = state.ejected_until if not returns else min(returns, state.ejected_until)
                continue
            groups.setdefault((spec.model, spec.role), []).append(wid)
            for name, _ in state.loras:
                groups.setdefault((name, spec.role), []).append(wid)
            if spec.model:
                groups.setdefault((_ALL_MODELS, spec.role), []).append(wid)
        self._returns_at = returns
        return {key: tuple(sorted(ids)) for key, ids in groups.items()}
