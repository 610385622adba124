"""The candidate stage: which routable workers a placement looks at, bounded at large fleets.

Filters, scorers and pickers cost a little Python per candidate; at 1,000 workers that is
milliseconds per placement when every worker is a candidate. Yet a policy's choice is decided
by a few workers: the ones holding the deepest prefix match, the least loaded, and (for the
spread that random tie-breaking gives) a few others. So when more than ``max_candidates``
workers are routable, this stage hands the pipeline only those:

* ``deepest`` workers holding the deepest matches of the prompt's chain, found by one walk of
  the prefix index over the group's slot mask (``KVCache.deepest``: O(chain + k), not O(fleet));
  only when the policy reads the prefix cache;
* ``least_loaded`` workers by the ledger's counts, from the group's lazy heap
  (``fleet.Group.least_loaded``: O(k log n));
* ``random`` workers sampled uniformly (O(k)).

Policies whose picker needs no comparison do not even sample: ``round_robin`` with no scorers
and filters is stride scheduling over the group (a heap of passes, weights respected: O(log n)),
``random`` is a draw on cumulative weights (O(log n), O(1) with equal weights), and
``power_of_two`` draws its uniform pair here, which is exactly the pair its picker would have
drawn from the whole group. At or below ``max_candidates`` nothing changes: every routable
worker is a candidate and decisions are those of the unsampled pipeline.

If the sample leaves the pipeline nothing (every sampled worker filtered out by a hard filter),
placement runs again over the whole group, so sampling never refuses a request by itself.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from random import Random
from typing import TYPE_CHECKING, Any

from controlplane.scheduling.base import PlacementContext

if TYPE_CHECKING:
    from controlplane.fleet import Group


@dataclass
class SampleStage:
    max_candidates: int = 32     # K: more routable workers than this and only a sample is considered
    deepest: int = 6             # workers with the deepest prefix matches (prefix-cache policies)
    least_loaded: int = 3        # workers with the least work by the ledger
    random: int = 3              # uniform samples, for spread
    rng: Random = field(default_factory=Random)
    name: str = "sample"
    mode: str = field(default="sample", init=False)     # set by bind(): see the module docstring
    _rr: dict[int, tuple[Any, list[list]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("max_candidates", "deepest", "least_loaded", "random"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ValueError(f"{key} must be an integer >= 0")
        if self.max_candidates < 2:
            raise ValueError("max_candidates must be >= 2")
        if self.least_loaded + self.random < 1:
            raise ValueError("least_loaded + random must be >= 1")

    def bind(self, profile: Any) -> None:
        """Choose how to bound the candidates from what the profile's plugins need."""
        from controlplane.scheduling.pickers import PowerOfTwoPicker, RoundRobinPicker, WeightedRandomPicker

        plain = not profile.scorers and not profile.filters
        picker = profile.picker
        if plain and isinstance(picker, RoundRobinPicker):
            self.mode = "round_robin"
        elif plain and isinstance(picker, WeightedRandomPicker):
            self.mode = "random"
        elif isinstance(picker, PowerOfTwoPicker):
            self.mode = "pair"
        else:
            self.mode = "sample"
        self._uses_prefix = profile.uses_prefix_cache

    def applies(self, group_size: int) -> bool:
        return group_size > self.max_candidates

    def select(self, ctx: PlacementContext, group: Group, kv: Any, chain: list[int]) -> list[str]:
        """The ids to consider, in O(sample) (plus one prefix-index walk when the policy uses it)."""
        ids, rng, exclude = group.ids, self.rng, ctx.exclude
        mode = self.mode
        if mode == "round_robin":
            return self._round_robin(group, exclude)
        if mode == "random":
            return self._weighted_random(group, exclude)
        if mode == "pair":
            return self._uniform(ids, 2, exclude)
        out: dict[str, None] = {}
        matched = None
        if chain and kv is not None and getattr(self, "_uses_prefix", False):
            matched = kv.group_match(chain, ids, self.deepest + len(exclude), rng)
            for wid in matched.top:
                if wid not in exclude:
                    out[wid] = None
        if self.least_loaded:
            for wid in group.least_loaded(self.least_loaded, exclude):
                out[wid] = None
        if self.random:
            for wid in self._uniform(ids, self.random, exclude):
                out[wid] = None
        chosen = list(out)
        if matched is not None:
            # The same walk gives every candidate's depth: placement need not look them up again.
            ctx.match_blocks = matched.depths(chosen)
            ctx.matched = True
        return chosen

    def _uniform(self, ids: tuple[str, ...], k: int, exclude: frozenset[str]) -> list[str]:
        """``k`` distinct ids drawn uniformly, none in ``exclude``: rejection sampling, O(k)
        (random.sample's bookkeeping costs more than the draws at this size)."""
        n = len(ids)
        if k >= n - len(exclude):
            return [wid for wid in ids if wid not in exclude]
        rnd = self.rng.random
        out: dict[str, None] = {}
        for _ in range(8 * k + 16):
            wid = ids[int(rnd() * n)]
            if wid not in exclude:
                out[wid] = None
                if len(out) == k:
                    return list(out)
        rest = [wid for wid in ids if wid not in exclude and wid not in out]   # nearly all excluded
        return list(out) + self.rng.sample(rest, k - len(out))

    def _weighted_random(self, group: Group, exclude: frozenset[str]) -> list[str]:
        ids, rng = group.ids, self.rng
        for _ in range(4 + len(exclude)):
            if group.uniform:
                wid = ids[rng.randrange(len(ids))]
            else:
                cum = group.cumulative_weights
                wid = ids[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(ids) - 1)]
            if wid not in exclude:
                return [wid]
        return [wid for wid in ids if wid not in exclude]     # nearly all excluded: let the picker choose

    def _round_robin(self, group: Group, exclude: frozenset[str]) -> list[str]:
        """Stride scheduling: each worker's pass advances by 1/weight when it is chosen; the
        lowest pass goes next (ties in group order), so weight-w workers get w shares, evenly."""
        state = self._rr.get(id(group))
        if state is None or state[0] is not group:
            if len(self._rr) >= 16:
                self._rr.clear()
            heap: list[list[Any]] = [[0.0, i, 1.0 / group.weight(wid)] for i, wid in enumerate(group.ids)]
            heapq.heapify(heap)
            state = self._rr[id(group)] = (group, heap)
        heap = state[1]
        skipped = []
        chosen = ""
        while heap:
            entry = heap[0]
            wid = group.ids[entry[1]]
            entry[0] += entry[2]
            heapq.heapreplace(heap, entry)
            if wid not in exclude:
                chosen = wid
                break
            skipped.append(wid)
            if len(skipped) >= len(heap):
                break
        return [chosen] if chosen else [wid for wid in group.ids if wid not in exclude]


CANDIDATE_STAGES = {"sample": SampleStage}
