"""Per-engine latency models, learned online from what the data planes report.

Two straight lines per engine, refitted with every observation:

* time to first token = a + b * (prefill tokens ahead of the request, its own included):
  ``b`` is the engine's seconds per uncached prompt token, ``a`` what a request pays even
  with nothing ahead (a scheduling step, the data path). The tokens ahead are those placed
  and not yet computed, less what the engine has computed since it last finished a prompt
  (``EngineModel.pending_s``), when fitting as when predicting;
* time per output token = c + d * (requests in the decode batch): the step time of
  continuous batching, growing with the batch; beyond the batches it has seen, at no more
  than the prior's slope (``OnlineLine.bounded_slope``);
* a decode engine's KV pull (sequential PD) = e + f * (prompt tokens it does not hold in
  its own prefix cache): from P's answer to D's first token, so ``f`` is the transfer's
  seconds per token and ``e`` D's first step. Its prior is ``kv_pull_s_per_token``, 5 us
  a token, about what vLLM's NixlConnector moves for an ~8B model over RDMA (and what the
  simulator charges by default, ``--kv-transfer-ms-per-token 0.005``).

The fits forget old samples exponentially (a half-life counted in observations), so a
model follows an engine that slows down (thermal throttling, a noisy neighbour, a longer
context mix). They start from priors given by config, kept as two pseudo-observations
that fade like any other sample, so the first predictions are sane and a few real ones
take over. Each model also tracks its own relative error, exported on /metrics.

An engine nobody has observed yet predicts what the observed engines do, not the static
priors: otherwise, once the others have learned that they are faster than the priors say,
the unobserved engine always looks slower, is never chosen, and so never gets the
observation that would correct it (seen in bench/slo_replay.py: one engine of four
received no request at all). What they do is the median of the current fits (each line's
intercept and slope) of the engines serving the same model, one vote per engine: a typical
engine of the fleet for that model (a 70B model's engines are not an 8B model's), which
neither the busiest engine's many samples nor one slow engine (a 0.5x engine among 1x ones)
decides. The static priors (``PredictionDefaults``) serve only until the first engine's
first sample: 10k uncached tokens a second is a guess for an ~8B model on one GPU, twice
what bench/slo_replay.py's simulated engines do in the tokens and seconds the control plane
sees, and no fixed figure is right for every model and GPU; the fleet's own samples replace
it within the first requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


_LINES = ("ttft", "tpot", "pull")


class ComputedCharge(Protocol):
    """What :meth:`Predictor.prompts_computed` reads of a ledger charge (state.base.Charge)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def prefill_tokens(self) -> int: ...


@dataclass(slots=True)
class OnlineLine:
    """y ~ a + b*x by ridge regression toward the priors, forgetting old samples; a, b >= 0.

    The intercept's prior counts as ``prior_weight_a`` observations that never fade; the
    slope's as ``prior_weight_b`` observations at the data's typical x, so it is all there
    is before the first sample and soon no more than a nudge. Samples
    that cannot tell intercept from slope (every prompt the same length) therefore teach
    the slope while the intercept stays near its prior: prefill time is mostly
    proportional to tokens, not a constant.

    With ``bounded_slope``, beyond the largest x among recent samples (``x_hi``, fading like
    them) the line goes on at no more than the configured prior's slope (``cap_b``): a
    slope fitted where the data are is a correlation there, not a rule for loads never
    seen. The decode step's line needs it: on an aggregated engine the TPOT is mostly the
    prefill chunks sharing its steps, which grow with the load as the batch does, so its
    first samples (batch 1-10, TPOT 8-30 ms) fitted 1.5-2.5 ms a request, and an engine
    with 100 requests was predicted a TPOT of 0.25 s (it had 0.03 s), took no new request
    for the rest of the run, and the other engines' queues grew to 4 s (bench/workload_suite.py ``hetero`` at 3x;
    docs/benchmarks/workloads_notes.md).

    The bound is the configured prior's slope, kept when an engine not observed yet takes
    the fleet's line (:meth:`adopt`): the fleet's fitted slope is the same correlation
    (measured on other engines' small batches), so made the bound it bounded nothing. On
    mixed chat and summarisation traffic one engine's first TPOT samples (batches 4-12,
    prefill chunks in their steps) fitted 1.5-2.5 ms a request, every engine not observed
    yet took that as its bound and, with no sample of its own (``x_hi`` 0), was predicted a
    TPOT of 0.23 s at a batch of 84 (it did 0.01 s): new chats went to an engine with a 2 s
    queue instead (``mixed`` at 4x; docs/benchmarks/workloads_notes.md).
    """

    prior_a: float
    prior_b: float
    prior_x: float              # a typical x, where predictions are checked before any data
    half_life: float = 64.0     # observations after which a sample counts half
    prior_weight_a: float = 1.0
    prior_weight_b: float = 0.5
    bounded_slope: bool = False
    x_hi: float = 0.0           # the largest x among recent samples (``bounded_slope``)
    cap_b: float = 0.0          # the slope beyond ``x_hi`` at most (``bounded_slope``): the configured prior's
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    n: int = 0
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        self.a, self.b = self.prior_a, self.prior_b
        if not self.cap_b:
            self.cap_b = self.prior_b

    def add(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return
        keep = 0.5 ** (1.0 / self.half_life)
        hi = self.x_hi * keep
        self.x_hi = x if x > hi else hi
        self.sw = self.sw * keep + 1.0
        self.sx = self.sx * keep + x
        self.sy = self.sy * keep + y
        self.sxx = self.sxx * keep + x * x
        self.sxy = self.sxy * keep + x * y
        self.n += 1
        self._solve()

    def _solve(self) -> None:
        la = self.prior_weight_a
        lb = self.prior_weight_b * self.sxx / self.sw
        if lb <= 0:
            return   # no spread in x yet: nothing to learn the slope from
        m11, m12, m22 = self.sw + la, self.sx, self.sxx + lb
        r1, r2 = self.sy + la * self.prior_a, self.sxy + lb * self.prior_b
        det = m11 * m22 - m12 * m12
        a, b = (r1 * m22 - m12 * r2) / det, (m11 * r2 - m12 * r1) / det
        if a < 0:
            a, b = 0.0, max(r2 / m22, 0.0)
        elif b < 0:
            a, b = max(r1 / m11, 0.0), 0.0
        self.a, self.b = a, b

    def __call__(self, x: float) -> float:
        if self.bounded_slope and x > self.x_hi:
            b, hi, cap = self.b, self.x_hi, self.cap_b
            return self.a + b * hi + (b if b < cap else cap) * (x - hi)
        return self.a + self.b * x

    def adopt(self, a: float, b: float) -> None:
        """Take (a, b) as the priors and the current fit; only while nothing was observed. The
        slope's bound (``cap_b``) stays the configured prior's (class docstring)."""
        if self.n == 0:
            self.prior_a, self.prior_b, self.a, self.b = a, b, a, b


@dataclass(slots=True)
class ErrorTrack:
    """Mean absolute relative error of recent predictions (EWMA)."""

    alpha: float = 0.05
    mean: float = 0.0
    n: int = 0

    def add(self, predicted: float, observed: float) -> None:
        if observed <= 0 or predicted < 0:
            return
        err = abs(predicted - observed) / observed
        self.mean = err if self.n == 0 else self.mean + self.alpha * (err - self.mean)
        self.n += 1


@dataclass(frozen=True, slots=True)
class PredictionDefaults:
    """Priors: what an engine is assumed to do before it has been observed."""

    prefill_s_per_token: float = 1e-4    # 10k uncached tokens/s
    ttft_base_s: float = 0.02
    tpot_base_s: float = 0.02
    tpot_s_per_request: float = 5e-4
    kv_pull_s_per_token: float = 5e-6
    half_life: float = 64.0
    # Sequences an engine runs at once when its worker spec does not say (label
    # ``max_num_seqs``: the [[workers]] key, or the vLLM plugin's registration from the
    # engine's --max-num-seqs): vLLM V1's default on most GPUs (1024 on 70+ GiB GPUs with the
    # OpenAI server in recent versions, less on some others; SGLang sizes
    # --max-running-requests from its KV pool). See ``seats_of``.
    max_num_seqs: int = 256


def seats_of(labels: Mapping[str, str], default: int) -> int:
    """The sequences an engine runs at once: its worker spec's label ``max_num_seqs`` (the
    ``[[workers]]`` key, checked at start-up, or a registration's label), else ``default``.
    A label that is not a positive integer is ignored."""
    text = labels.get("max_num_seqs")
    if text:
        try:
            n = int(text)
        except ValueError:
            return default
        if n > 0:
            return n
    return default


@dataclass(slots=True)
class EngineModel:
    ttft: OnlineLine
    tpot: OnlineLine
    pull: OnlineLine
    ttft_error: ErrorTrack = field(default_factory=ErrorTrack)
    tpot_error: ErrorTrack = field(default_factory=ErrorTrack)
    pull_error: ErrorTrack = field(default_factory=ErrorTrack)
    # Since when the engine has been computing the prompts now ahead of it: its last prompt
    # computed (a first token), or the placement that found none ahead. 0: not known.
    busy_since: float = 0.0
    served: str = ""        # the model the engine serves ("" until named: Predictor.model)
    # Prompt tokens the control plane's queue holds for this engine, not in the ledger
    # (HoldQueue: the scorer counts them as work ahead, see latency.predict).
    held_tokens: int = 0
    # The engine's seats (max_num_seqs; 0 until latency.predict reads its spec) and the spec
    # labels they were read from (re-read when a registration replaces them).
    seats: int = 0
    seats_from: object = None
    # A request's decode time on this engine (first token to last, seconds), EWMA; 0 until
    # observed: how long a seat stays taken (``seat_wait_s``).
    decode_s: float = 0.0

    def seat_wait_s(self, requests: int, fallback_decode_s: float) -> float:
        """Seconds a new request waits for a seat when the engine already holds ``requests``
        (running and waiting): an engine at its ``max_num_seqs`` admits nothing until a
        running sequence ends. The excess ``requests + 1 - seats`` must each see a sequence
        end first; with ``seats`` sequences at random points of a ``decode_s``-long life, one
        ends every ``decode_s / seats`` seconds. ``fallback_decode_s`` before any observation.

        Without it the TTFT prediction saw the prefill ahead of a request but not a full
        engine: on ``mixed`` at 4x with a TPOT line that follows the data, one chat engine
        took most chats, and of the 47 requests that arrived while 120 or more were in flight
        there (128 seats), 45 missed the TTFT target; none of the 121 below
        (docs/benchmarks/workloads_notes.md)."""
        excess = requests + 1 - self.seats
        if excess <= 0 or self.seats <= 0:
            return 0.0
        life = self.decode_s if self.decode_s > 0 else fallback_decode_s
        return excess * life / self.seats

    def observe_decode(self, seconds: float, alpha: float = 0.05) -> None:
        """A finished request's decode time (first token to last) on this engine."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        d = self.decode_s
        self.decode_s = seconds if d <= 0 else d + alpha * (seconds - d)

    def pending_s(self, prefill_tokens: int, now: float) -> float:
        """Seconds of prefill still ahead of a new prompt: the uncached tokens placed and not
        yet computed, at the learned seconds per token, less the time the engine has been
        computing them since ``busy_since``.

        The tokens are settled only at each prompt's first token, so the one being computed
        counts whole until it is done. Counted whole, a question placed behind a document
        half computed was predicted to wait for all of it: the engine holding a document
        looked seconds busier than it was, and the TTFT line, fitted on such work against the
        short waits really seen, learned a prefill speed up to twice the engine's, so a
        document computed again elsewhere looked cheap (``longdoc`` at 8x: predicted 2.3 s,
        it took 5.7 s, and 17 questions on that engine's own document waited behind it).
        """
        ahead = self.ttft.b * prefill_tokens
        since = self.busy_since
        if ahead > 0 and since and now > since:
            ahead -= now - since
            if ahead < 0:
                ahead = 0.0
        return ahead

    @classmethod
    def new(cls, d: PredictionDefaults) -> EngineModel:
        return cls(ttft=OnlineLine(d.ttft_base_s, d.prefill_s_per_token, 8192.0, d.half_life),
                   tpot=OnlineLine(d.tpot_base_s, d.tpot_s_per_request, 32.0, d.half_life, bounded_slope=True),
                   pull=OnlineLine(d.tpot_base_s, d.kv_pull_s_per_token, 8192.0, d.half_life))

    def observe_ttft(self, work_tokens: float, ttft_s: float) -> OnlineLine:
        self.ttft_error.add(self.ttft(work_tokens), ttft_s)
        self.ttft.add(work_tokens, ttft_s)
        return self.ttft

    def observe_tpot(self, batch: float, tpot_s: float) -> OnlineLine:
        self.tpot_error.add(self.tpot(batch), tpot_s)
        self.tpot.add(batch, tpot_s)
        return self.tpot

    def observe_pull(self, pulled_tokens: float, seconds: float) -> OnlineLine:
        self.pull_error.add(self.pull(pulled_tokens), seconds)
        self.pull.add(pulled_tokens, seconds)
        return self.pull


@dataclass(slots=True)
class FleetLines:
    """The observed engines' median fit (a, b) of each line, for one served model; None
    before any engine of that model has observed the line. A line is recomputed when read
    after an observation moved it (``stale``), not at every observation: the median runs over
    the fleet's engines, and observations come with every request while the median is read
    only for engines not observed yet."""

    ttft: tuple[float, float] | None = None
    tpot: tuple[float, float] | None = None
    pull: tuple[float, float] | None = None
    stale: set[str] = field(default_factory=set)


class Predictor:
    """One model per worker id, made on first use."""

    def __init__(self, defaults: PredictionDefaults | None = None) -> None:
        self.defaults = defaults or PredictionDefaults()
        self._models: dict[str, EngineModel] = {}
        # Per request held in the queue: the engine it was held for and its tokens there
        # (HoldQueue keeps it and each engine's held_tokens; latency.predict reads both).
        self.held: dict[str, tuple[str, int]] = {}
        # The most seconds of held work counted ahead on one engine (HoldQueue sets it to its
        # starvation_s: beyond that, held work goes after a request, not before it).
        self.held_cap_s = float("inf")
        # Per served model, the observed engines' median fit (a, b) per line (module docstring).
        self._pools: dict[str, FleetLines] = {}

    def model(self, worker_id: str, served: str = "") -> EngineModel:
        """The engine's model; one not observed yet follows the median of the observed engines
        that serve the same model (module docstring). ``served``: the model the engine serves
        (its spec's), kept from the first call that names it."""
        m = self._models.get(worker_id)
        if m is None:
            m = self._models[worker_id] = EngineModel.new(self.defaults)
        if served and not m.served:
            m.served = served
            if m.ttft.n or m.tpot.n or m.pull.n:   # observed before it was named: count it now
                self._pool(served).stale.update(_LINES)
        pool = self._pools.get(m.served)
        if pool is not None:
            if m.ttft.n == 0 and (fit := self._fleet(pool, "ttft", m.served)) is not None:
                m.ttft.adopt(*fit)
            if m.tpot.n == 0 and (fit := self._fleet(pool, "tpot", m.served)) is not None:
                m.tpot.adopt(*fit)
            if m.pull.n == 0 and (fit := self._fleet(pool, "pull", m.served)) is not None:
                m.pull.adopt(*fit)
        return m

    def observe_ttft(self, worker_id: str, work_tokens: float, ttft_s: float) -> None:
        m = self.model(worker_id)
        m.observe_ttft(work_tokens, ttft_s)
        self._pool(m.served).stale.add("ttft")

    def observe_tpot(self, worker_id: str, batch: float, tpot_s: float) -> None:
        m = self.model(worker_id)
        m.observe_tpot(batch, tpot_s)
        self._pool(m.served).stale.add("tpot")

    def observe_decode(self, worker_id: str, seconds: float) -> None:
        """A finished request's decode time on ``worker_id`` (``EngineModel.seat_wait_s``)."""
        self.model(worker_id).observe_decode(seconds)

    def fleet_tpot(self, batch: float, served: str = "") -> float:
        """The median TPOT line at ``batch`` of the observed engines serving ``served`` (the
        priors' before any observation): what a decode engine not chosen yet is expected to do."""
        pool = self._pools.get(served)
        a, b = (self._fleet(pool, "tpot", served) if pool is not None else None) or (
            self.defaults.tpot_base_s, self.defaults.tpot_s_per_request)
        return a + b * batch

    def observe_pull(self, worker_id: str, pulled_tokens: float, seconds: float) -> None:
        m = self.model(worker_id)
        m.observe_pull(pulled_tokens, seconds)
        self._pool(m.served).stale.add("pull")

    def progressed(self, worker_id: str, now: float) -> None:
        """The engine finished a prompt, or started one with nothing ahead: the prompts left
        ahead of the next one have been computed since ``now`` (``EngineModel.pending_s``).
        Only engines already modelled (a DP rank's charge has no model of its own)."""
        m = self._models.get(worker_id)
        if m is not None:
            m.busy_since = now

    def prompts_computed(self, charges: Iterable[ComputedCharge], now: float) -> None:
        """A request's prompt is computed (its first token, or its end): every engine that was
        computing it (a charge with prefill tokens) has :meth:`progressed` from ``now``."""
        for c in charges:
            if c.prefill_tokens > 0:
                self.progressed(c.worker_id, now)

    def pending_tokens(self, worker_id: str, prefill_tokens: int, now: float) -> int:
        """``prefill_tokens`` less what the engine has computed of them by ``now``, in tokens at
        its learned speed: the work ahead a TTFT observation is fitted against."""
        m = self._models.get(worker_id)
        if m is None or m.ttft.b <= 0:
            return prefill_tokens
        return round(m.pending_s(prefill_tokens, now) / m.ttft.b)

    def _pool(self, served: str) -> FleetLines:
        pool = self._pools.get(served)
        if pool is None:
            pool = self._pools[served] = FleetLines()
        return pool

    def _fleet(self, pool: FleetLines, kind: str, served: str) -> tuple[float, float] | None:
        """``pool``'s line ``kind``, recomputed first if an observation moved it since."""
        if kind in pool.stale:
            pool.stale.discard(kind)
            setattr(pool, kind, self._median(kind, served))
        fit: tuple[float, float] | None = getattr(pool, kind)
        return fit

    def _median(self, kind: str, served: str) -> tuple[float, float] | None:
        """The median intercept and slope of one line (``ttft``, ``tpot`` or ``pull``) over the
        engines serving ``served`` that have observed it: what an engine of that model not
        observed yet starts from, over the engines' models: read through :meth:`_fleet`, only
        when an engine not observed yet (or ``fleet_tpot``) needs it after a new observation."""
        lines = [line for m in self._models.values() if m.served == served and (line := getattr(m, kind)).n]
        if not lines:
            return None
        return statistics.median(x.a for x in lines), statistics.median(x.b for x in lines)

    def forget(self, worker_id: str) -> None:
        self._models.pop(worker_id, None)

    def items(self) -> list[tuple[str, EngineModel]]:
        return list(self._models.items())
