"""Predicted-latency plugins: choose the engine that will answer soonest, not the least busy.

For each candidate the prediction is (``controlplane.prediction``):

* TTFT: the engine's learned line at (prefill tokens already placed there and not yet
  computed, less what it has computed of them since its last first token:
  ``EngineModel.pending_s`` + the tokens of this prompt it does not hold in its prefix
  cache). So a warm cache and a short queue both count, in the same unit: seconds.
  Plus, on an engine already running its ``max_num_seqs`` (its seats: the worker's label or
  engine facts, ``prediction.seats_of``), the wait for a running sequence to end
  (``EngineModel.seat_wait_s``).
* TPOT: the engine's learned step time at its decode batch with this request added.

PD pairs are judged together (sequential flow: D is still placed after P answers):

* a decode leg: the KV pull it needs (the prompt tokens that engine does not hold in its own
  prefix cache, at its learned seconds per pulled token, plus its first step) and TPOT, so
  the decode engine that already holds the conversation's prefix, with TPOT headroom, wins;
* a prefill worker at entry, beside aggregated workers (and against a request's SLO): its
  own TTFT plus the pull of the decode engine it would be paired with (the best one now,
  ``pair_decode``), and that engine's TPOT, so an aggregated worker competes with the whole
  PD path, not with its first leg. Among prefill workers alone that pair is the same for
  each, so it is left out of their comparison.

An aggregated worker is judged by its TTFT and TPOT, each against the request's target (its
SLO headers, or the scorer's defaults).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.prediction import seats_of
from controlplane.scheduling.base import PlacementContext
from controlplane.workers import Role, WorkerView

TTFT_TARGET_S = 2.0     # the defaults when a request names no SLO
TPOT_TARGET_S = 0.1
DECODE_FLOOR = 0.25


def predict(ctx: PlacementContext, w: WorkerView) -> tuple[float, float]:
    """(predicted TTFT, predicted TPOT) in seconds for ``w``; 0 for a leg it does not run."""
    spec = w.spec
    wid = spec.id
    got = ctx.predicted.get(wid)
    if got is not None:
        return got
    model = ctx.predictor.model(wid, spec.model)
    role = spec.role
    # The models' lines evaluated inline (a + b * x): this runs per candidate per placement.
    uncached = ctx.prompt_tokens - ctx.match_blocks.get(wid, 0) * ctx.block_size
    if uncached < 0:
        uncached = 0
    if ctx.leg != "decode" and role is not Role.DECODE:
        line = model.ttft
        ttft = line.a + line.b * uncached + model.pending_s(w.load.prefill_tokens, ctx.now)
        held = model.held_tokens
        if held:
            # Work the queue stage holds for this engine: the ledger does not show it, and
            # without it the engine a conversation's cache follows looks no busier than the
            # queue's hold_s, so its next turns wait for it while another engine is free
            # (docs/benchmarks/pd_queue.md, fifth session). This request's own held work is
            # not ahead of itself, and beyond held_cap_s the rest goes after it (HoldQueue._publish).
            mine = ctx.predictor.held.get(ctx.request_id)
            if mine is not None and mine[0] == wid:
                held -= mine[1]
            extra = line.b * held
            cap = ctx.predictor.held_cap_s
            ttft += extra if extra < cap else cap
    elif role is Role.DECODE:
        line = model.pull      # what this decode engine pulls: the prompt less its own prefix
        ttft = line.a + line.b * uncached
    else:
        ttft = 0.0
    requests = w.load.requests
    if model.seats_from is not spec.labels:      # (read once per spec, not per placement)
        model.seats, model.seats_from = seats_of(spec.labels, ctx.predictor.defaults.max_num_seqs), spec.labels
    if requests >= model.seats and role is not Role.PREFILL:
        # A full engine admits nothing until a sequence ends (EngineModel.seat_wait_s); before
        # any decode was observed there, a sequence lives this request's output at the line's TPOT.
        ttft += model.seat_wait_s(requests, (ctx.max_tokens or 256) * model.tpot(model.seats))
    if role is not Role.PREFILL:
        tpot = model.tpot(requests + 1)     # (its slope bounded beyond the batches seen)
    else:
        tpot = 0.0
    got = ctx.predicted[wid] = (ttft, tpot)
    return got


def decode_cost(ttft_s: float, tpot_s: float, ttft_target_s: float, tpot_target_s: float,
                floor: float = DECODE_FLOOR) -> float:
    """A decode engine's cost: its pull against the TTFT target, its TPOT against the TPOT
    target but never below ``floor`` (engines comfortably within it are equally good)."""
    tpot = tpot_s / tpot_target_s
    return ttft_s / ttft_target_s + (tpot if tpot > floor else floor)


def pair_decode(ctx: PlacementContext, decodes: Sequence[WorkerView], match_blocks: dict[str, int]) -> None:
    """Entry leg of a PD fleet: the decode engine a prefill worker would be paired with.

    Sets ``ctx.pair`` to the best decode engine's predicted (pull + first step, TPOT), by
    ``decode_cost``, and ``ctx.pair_decode`` to its id. ``match_blocks``: the decode engines'
    prefix matches for this prompt. The decode leg itself is chosen again when P answers
    (loads will have moved by then); this is what the PD path is predicted with.
    """
    if not decodes:
        return
    ttft_t = ctx.ttft_slo_s or TTFT_TARGET_S
    tpot_t = ctx.tpot_slo_s or TPOT_TARGET_S
    bs, prompt = ctx.block_size, ctx.prompt_tokens
    best = None
    for d in decodes:
        model = ctx.predictor.model(d.id, d.spec.model)
        pulled = prompt - match_blocks.get(d.id, 0) * bs
        pull = model.pull(pulled if pulled > 0 else 0)
        tpot = model.tpot(d.load.requests + 1)
        cost = decode_cost(pull, tpot, ttft_t, tpot_t) / (d.spec.weight if d.spec.weight > 1e-9 else 1e-9)
        if best is None or cost < best[0]:
            best = (cost, pull, tpot, d.id)
    assert best is not None, "no decode worker to pair with"
    ctx.pair, ctx.pair_decode = (best[1], best[2]), best[3]


def with_pair(ctx: PlacementContext, w: WorkerView, ttft: float, tpot: float) -> tuple[float, float]:
    """A prefill worker's (TTFT, TPOT) for the whole PD path: its own TTFT plus the paired
    decode engine's pull, and that engine's TPOT. Others' unchanged."""
    if ctx.pair is None or w.spec.role is not Role.PREFILL or ctx.leg == "decode":
        return ttft, tpot
    return ttft + ctx.pair[0], ctx.pair[1]


@dataclass
class PredictedLatencyScorer:
    """Score = the best candidate's predicted cost / this one's (1.0 for the best).

    Cost = (TTFT + ``recompute_weight`` x the prefill time of the prompt's uncached tokens)
    / TTFT target + ``tpot_weight`` x TPOT / TPOT target, divided by the worker's weight.

    The recompute term is what placing the request there costs everyone else: tokens
    computed again on a worker that does not hold them are capacity the requests behind it
    no longer have. Judged by its own TTFT alone (``recompute_weight = 0``), a follow-up
    turn leaves its conversation's engine whenever that engine's queue is longer than the
    cached prefix, and under load the fleet spends itself recomputing prefixes it already
    holds (docs/benchmarks/slo_replay_notes.md).

    The recompute term is weighed ``recompute_weight`` plus ``queued_weight`` for each prompt
    that engine still has to compute (``Load.prefills``): they all wait for the recomputed
    tokens too. Counted once, a question on a long document left the document's engine for
    one with a shorter queue whenever the queue difference passed twice the document's
    prefill, and under load the fleet computed documents again (bench/workloads.py
    ``longdoc`` at 16x, one run each: 5.0-6.7 % SLO attainment against 13.3-32.5 % with the
    queue counted; ``system_prompt`` at 4x: 87-96.7 against 97-100 %).

    The candidates' common match is compared as if every candidate held it (it prefers no
    one). A shared prefix beyond it (one that several prompts continued differently, such as
    the system prompt every request starts with: ``controlplane.scheduling.shared``) is
    compared as held only for the candidates starved of recent placements
    (``RecentShares``), in the TTFT and the recompute term: such an engine computes it once
    (that one request is slower by the prefix's prefill time) and holds it from then on.
    Charged to them every time, it kept every new conversation on the engines that got the
    first requests: in a replay with a 512-token system prompt on 4 idle-ish engines, two of
    them received nothing (tests/test_fair_share.py); the same for a decode engine's KV pull
    (every decode on the one decode engine of four that held an 8k-token system prompt).
    Counted as held for everyone, a document asked a few questions lost its engine to load,
    and each engine computed it again (the Mooncake window H at 2x: SLO 90 -> 85 %). A
    starved candidate whose own predicted TTFT, computing the prefix, would miss both the
    TTFT target and the best candidate's predicted TTFT is judged by what it holds: a 94k-token
    document went to a starved engine that took 2 s to compute it while an idle engine holding
    it would have answered in 0.1 s (``longdoc`` at 4x). Bounded by the target alone, a
    starved engine never took a long shared prefix even when every holder would answer later
    still (issue 17: 40-66k-token prefixes, one engine at 0.46 of its fair share).

    On an entry leg whose candidates mix aggregated and prefill engines, a prefill engine is
    costed with the PD path (``with_pair``): the pull and TPOT of the decode engine it would
    pair with (``ctx.pair``; the fleet's median TPOT line at batch 1, ``Predictor.fleet_tpot``,
    when no pair was predicted). Counted as 0, every prefill engine looked cheaper than every
    aggregated one by a whole TPOT term, so the aggregated engines got nothing (the demo's 2
    aggregated engines: 0 of 16 requests).

    A decode leg's TPOT part is at least ``decode_floor`` (a fraction of the TPOT target):
    decode engines predicted comfortably within the target are equally good for this
    request, and what tells them apart is the KV pull (the engine that holds the prompt's
    prefix pulls less), then the picker's load balance. Otherwise a few milliseconds of noise in the fits
    decide, since a decode step barely grows with the batch: one decode engine of two got 2
    of 200 decodes in bench/slo_replay.py's PD mode, its KV pool idle while the other's filled.
    """

    ttft_target_s: float = TTFT_TARGET_S
    tpot_target_s: float = TPOT_TARGET_S
    tpot_weight: float = 1.0
    recompute_weight: float = 1.0
    queued_weight: float = 1.0
    decode_floor: float = DECODE_FLOOR
    name: str = "predicted_latency"
    uses_prefix_cache: bool = True
    uses_predictions: bool = True

    def score(self, ctx: PlacementContext, workers: list[WorkerView]) -> list[float]:
        ttft_t = ctx.ttft_slo_s or self.ttft_target_s
        tpot_t = (ctx.tpot_slo_s or self.tpot_target_s) / self.tpot_weight if self.tpot_weight > 0 else float("inf")
        mu, queued = self.recompute_weight, self.queued_weight
        decode = ctx.leg == "decode" and self.tpot_weight > 0
        pd_tpot = -1.0          # a prefill candidate's TPOT beside aggregated ones (see the docstring)
        if ctx.leg == "entry" and Role.BOTH in ctx.roles and Role.PREFILL in ctx.roles and \
                any(w.spec.role is Role.BOTH for w in workers):
            pd_tpot = ctx.predictor.fleet_tpot(1, ctx.model) if ctx.pair is None else 0.0
        costs = []
        computes = ctx.leg != "decode"
        model = ctx.predictor.model
        match, bs, prompt = ctx.match_blocks.get, ctx.block_size, ctx.prompt_tokens
        common, floor, starved = ctx.common_blocks, ctx.floor_blocks, ctx.starved
        # A starved candidate counts the shared prefix as held only if its own predicted TTFT
        # meets the target or the best candidate's (class docstring).
        predicted = [predict(ctx, w) for w in workers]   # (each candidate once)
        bound = max(ttft_t, min(p[0] for p in predicted)) if starved and common > floor else 0.0
        for w, (ttft, tpot) in zip(workers, predicted, strict=True):
            spec = w.spec
            # ctx.uncached_tokens inline, and the tokens to recompute (per candidate per placement):
            # the candidates' common match counts as held by everyone in the comparison, and a
            # shared prefix beyond it by the starved candidates (class docstring); predict()
            # keeps the real TTFT.
            c = common if common > floor and spec.id in starved and ttft <= bound else floor
            held = match(spec.id, 0)
            uncached = prompt - held * bs
            recompute = prompt - (held if held > c else c) * bs
            uncached, recompute = (uncached if uncached > 0 else 0), (recompute if recompute > 0 else 0)
            if computes and spec.role is not Role.DECODE:
                b = model(spec.id).ttft.b
                # (each prompt still to be computed there waits for the recomputed tokens too)
                mu_w = mu + queued * w.load.prefills if recompute else 0.0
                ttft += b * (mu_w * recompute - (uncached - recompute))
            elif decode and c:
                # Likewise a decode engine's pull of the common prefix: pulled once, held after.
                ttft -= model(spec.id).pull.b * (uncached - recompute)
            if pd_tpot >= 0 and spec.role is Role.PREFILL:
                ttft, tpot = with_pair(ctx, w, ttft, tpot) if ctx.pair is not None else (ttft, pd_tpot)
            cost = decode_cost(ttft, tpot, ttft_t, tpot_t, self.decode_floor) if decode else \
                ttft / ttft_t + tpot / tpot_t
            weight = spec.weight
            costs.append(cost / (weight if weight > 1e-9 else 1e-9))
        best = min(costs, default=0.0)
        return [best / c if c > 0 else 1.0 for c in costs]


def misses_slo(ctx: PlacementContext, w: WorkerView) -> bool:
    """Whether ``w`` is predicted to miss the request's own SLO headers (a prefill worker at
    entry: with the decode engine it would be paired with); False when the request names none."""
    ttft_slo, tpot_slo = ctx.ttft_slo_s, ctx.tpot_slo_s
    if not (ttft_slo or tpot_slo):
        return False
    ttft, tpot = with_pair(ctx, w, *predict(ctx, w))
    return bool(ttft_slo and ttft > ttft_slo) or bool(tpot_slo and tpot > tpot_slo)


@dataclass
class SLOFilter:
    """Keep the workers predicted to meet the request's own SLO headers (opt-in, not in the
    built-in policies).

    Soft: when none is predicted to meet them, all stay (the scorer then takes the least
    bad); requests without targets are not filtered.

    Not in ``predicted_latency``: it serves the one request at any cost to the others. It
    dropped the engine the scorer chose (a conversation's own engine, or the one whose queue
    the request lengthened least) whenever another was predicted to meet the targets, however
    much that one would recompute or however full it was already, and it judged TPOT by a
    fit that does not see what drives it (a decode step with a prefill chunk in it): on the
    heterogeneous fleet the filter dropped an engine at 50.7 ms predicted against a 50 ms
    target while its twin read 11 ms, and later none at all (every TPOT fit over the target).
    With the headers the suite's heterogeneous fleet at 3x/4x met the SLO 6-7 points less
    often and PD 2:2 at 3x 7 points less (docs/benchmarks/workloads_notes.md). The built-in
    policies use the targets in the scorer's cost and, within the near-best picker's band,
    to prefer the engines predicted to meet them (``NearBestPicker``).
    """

    name: str = "slo"
    soft: bool = True
    uses_predictions: bool = True

    def active(self, ctx: PlacementContext) -> bool:
        """Whether this filter can drop anyone for this request (the pipeline skips it if not)."""
        return bool(ctx.ttft_slo_s or ctx.tpot_slo_s)

    def keep(self, ctx: PlacementContext, worker: WorkerView) -> bool:
        return not misses_slo(ctx, worker)
