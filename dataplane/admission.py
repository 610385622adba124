"""Overload protection in one data-plane process: an admission limit, a bounded priority
wait queue, and per-client token-bucket rate limits.

* **Admission.** At most ``max_inflight`` requests are in progress (from parsed body to the
  last byte of the answer). Beyond that a request waits in a queue of at most
  ``max_queued``, for at most ``queue_timeout_s``; a full queue or a wait that times out
  is a 429 with ``Retry-After``. Waiting requests are admitted by priority (lower value
  first, as vLLM's ``priority``), then in arrival order. In the common case (a free slot,
  nobody waiting) admission is a counter increment and nothing else.
* **Priority.** The body's ``priority`` (vLLM's field, passed on to engines unchanged) or
  the ``X-Priority`` header (which wins for the queue order and is not forwarded). Integers
  in ``[PRIORITY_MIN, PRIORITY_MAX]``; anything else is a 400.
* **Rate limits** (``--rate-limits FILE``, TOML)::

      [default]                    # every client without its own table (omit: no limit)
      requests_per_s = 20
      burst = 40                   # bucket size (default: max(1, requests_per_s))
      prompt_tokens_per_s = 0      # 0 = no token limit
      prompt_tokens_burst = 0      # default: prompt_tokens_per_s

      [keys.alice]                 # the client API key's name (--api-keys name:key)
      requests_per_s = 100

  A client is the name of its API key (with ``--api-keys``), else ``key-<12 hex>`` (a hash
  of the Bearer token it sent), else ``ip-<address>``: see :func:`client_identity`.
  Buckets are kept for at most ``MAX_BUCKETS`` clients; a bucket that has refilled is
  dropped first (dropping it loses nothing), then the least recently used.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dataplane.errors import APIError
from dataplane.messages import Request

PRIORITY_MIN = -(2 ** 31)
PRIORITY_MAX = 2 ** 31 - 1
MAX_BUCKETS = 65536


@dataclass(frozen=True)
class Limit:
    requests_per_s: float = 0.0       # 0 = unlimited
    burst: float = 0.0
    prompt_tokens_per_s: float = 0.0  # 0 = unlimited
    prompt_tokens_burst: float = 0.0


@dataclass
class AdmissionConfig:
    max_inflight: int = 4096
    max_queued: int = 1024
    queue_timeout_s: float = 30.0
    rate_limits: str = ""             # TOML file; "" = none


def _number(table: dict, key: str, where: str) -> float:
    value = table.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}.{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def parse_limit(table: object, where: str) -> Limit:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    known = {"requests_per_s", "burst", "prompt_tokens_per_s", "prompt_tokens_burst"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (allowed: {sorted(known)})")
    rps, tps = _number(table, "requests_per_s", where), _number(table, "prompt_tokens_per_s", where)
    burst = _number(table, "burst", where) or max(1.0, rps)
    tburst = _number(table, "prompt_tokens_burst", where) or tps
    return Limit(rps, burst, tps, tburst)


def load_rate_limits(path: str) -> tuple[Limit | None, dict[str, Limit]]:
    """(default limit or None, per-client limits) from a TOML file; ValueError names the key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--rate-limits {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--rate-limits {path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"default", "keys"})
    if unknown:
        raise ValueError(f"--rate-limits {path}: unknown tables {unknown} (allowed: default, keys)")
    keys = data.get("keys", {})
    if not isinstance(keys, dict):
        raise ValueError(f"--rate-limits {path}: keys must be a table of tables")
    try:
        default = parse_limit(data["default"], "default") if "default" in data else None
        return default, {str(name): parse_limit(t, f"keys.{name}") for name, t in keys.items()}
    except ValueError as exc:
        raise ValueError(f"--rate-limits {path}: {exc}") from None


def client_identity(http: Request, api_keys=None) -> str:
    """Who a request counts against: the API key's name when the data plane checks keys
    (``dataplane.auth``), else a hash of the Bearer token, else the client's address."""
    from dataplane.auth import key_id, presented_key

    if api_keys is not None and not http.get("api_key_name") and http.headers.get("Authorization"):
        name = api_keys.who(presented_key(http))
        if name:
            return name
    return key_id(http) or f"ip-{http.remote or 'unknown'}"


def request_priority(http: Request, body: dict) -> int:
    """The queue priority: X-Priority, else the body's ``priority``, else 0 (400 when bad)."""
    header = http.headers.get("X-Priority")
    if header is not None:
        try:
            value = int(header.strip())
        except ValueError:
            raise APIError(400, "X-Priority must be an integer", param="X-Priority") from None
        where = "X-Priority"
    else:
        value = body.get("priority", 0)
        if value is None:
            return 0
        if type(value) is not int:
            raise APIError(400, "'priority' must be an integer", param="priority")
        where = "priority"
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise APIError(400, f"{where} must be between {PRIORITY_MIN} and {PRIORITY_MAX}", param=where)
    return value


class _Bucket:
    __slots__ = ("limit", "stamp", "requests", "tokens")

    def __init__(self, limit: Limit, now: float) -> None:
        self.limit, self.stamp = limit, now
        self.requests, self.tokens = limit.burst, limit.prompt_tokens_burst

    def refill(self, now: float) -> None:
        dt = now - self.stamp
        self.stamp = now
        lim = self.limit
        if lim.requests_per_s:
            self.requests = min(lim.burst, self.requests + dt * lim.requests_per_s)
        if lim.prompt_tokens_per_s:
            self.tokens = min(lim.prompt_tokens_burst, self.tokens + dt * lim.prompt_tokens_per_s)

    def full_at(self) -> float:
        """When this bucket will have refilled completely (then it equals a fresh one)."""
        lim = self.limit
        t = self.stamp
        if lim.requests_per_s:
            t = max(t, self.stamp + (lim.burst - self.requests) / lim.requests_per_s)
        if lim.prompt_tokens_per_s:
            t = max(t, self.stamp + (lim.prompt_tokens_burst - self.tokens) / lim.prompt_tokens_per_s)
        return t


class RateLimiter:
    def __init__(self, default: Limit | None, per_key: dict[str, Limit], *, max_buckets: int = MAX_BUCKETS,
                 clock=time.monotonic) -> None:
        self.default, self.per_key = default, per_key
        self.max_buckets = max_buckets
        self.clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.limited = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, who: str, prompt_tokens: int = 0) -> None:
        """Take one request (and its prompt tokens) from ``who``'s bucket, or 429."""
        limit = self.per_key.get(who, self.default)
        if limit is None or not (limit.requests_per_s or limit.prompt_tokens_per_s):
            return
        now = self.clock()
        buckets = self._buckets
        bucket = buckets.get(who)
        if bucket is None:
            self._evict(now)
            bucket = buckets[who] = _Bucket(limit, now)
        else:
            buckets.move_to_end(who)
            bucket.refill(now)
        wait = 0.0
        if limit.requests_per_s and bucket.requests < 1.0:
            wait = (1.0 - bucket.requests) / limit.requests_per_s
        tokens = min(float(prompt_tokens), limit.prompt_tokens_burst) if limit.prompt_tokens_per_s else 0.0
        if tokens and bucket.tokens < tokens:
            wait = max(wait, (tokens - bucket.tokens) / limit.prompt_tokens_per_s)
        if wait > 0:
            self.limited += 1
            raise APIError(429, f"rate limit exceeded for client {who!r}; retry after {wait:.2f} s",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})
        if limit.requests_per_s:
            bucket.requests -= 1.0
        bucket.tokens -= tokens

    def _evict(self, now: float) -> None:
        buckets = self._buckets
        for _ in range(2):   # lossless: the oldest buckets that have refilled
            if not buckets:
                return
            name, oldest = next(iter(buckets.items()))
            if oldest.full_at() > now:
                break
            del buckets[name]
        while len(buckets) >= self.max_buckets:
            buckets.popitem(last=False)


class Admission:
    """The in-flight limit and its priority wait queue (one per data-plane process)."""

    def __init__(self, config: AdmissionConfig) -> None:
        if config.max_inflight < 1 or config.max_queued < 0 or not config.queue_timeout_s >= 0:
            raise ValueError("--max-inflight must be >= 1, --max-queued >= 0, --queue-timeout >= 0")
        self.config = config
        self.inflight = 0
        self.queued = 0                     # live waiters
        self._heap: list = []               # [priority, seq, future]; cancelled ones are skipped
        self._seq = 0
        self.admitted_after_wait = 0
        self.rejected_full = 0
        self.rejected_timeout = 0
        self.limiter: RateLimiter | None = None
        if config.rate_limits:
            self.limiter = RateLimiter(*load_rate_limits(config.rate_limits))

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot; the caller must call :meth:`release` once afterwards. 429 when the
        queue is full or the wait times out. A cancelled waiter leaves the queue at once."""
        if self.inflight < self.config.max_inflight and not self.queued:
            self.inflight += 1
            return
        if self.queued >= self.config.max_queued:
            self.rejected_full += 1
            raise APIError(429, f"data plane overloaded: {self.inflight} requests in progress and "
                                f"{self.queued} waiting", headers={"Retry-After": "1"})
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._heap, [priority, self._seq, fut])
        self.queued += 1
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await fut
        except BaseException as exc:
            if not fut.done() or fut.cancelled():
                if not fut.done():
                    fut.cancel()
                self.queued -= 1
                self._compact()
            else:                # the slot was handed over just as we gave up: pass it on
                self.release()
            if isinstance(exc, TimeoutError):
                self.rejected_timeout += 1
                raise APIError(429, f"data plane overloaded: no slot within {self.config.queue_timeout_s:g} s",
                               headers={"Retry-After": "1"}) from None
            raise
        self.admitted_after_wait += 1

    def release(self) -> None:
        heap = self._heap
        while heap:
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)   # the slot passes to the waiter: inflight unchanged
                self.queued -= 1
                return
        self.inflight -= 1

    def _compact(self) -> None:
        if len(self._heap) > 2 * self.queued + 64:
            self._heap = [e for e in self._heap if not e[2].done()]
            heapq.heapify(self._heap)

    async def admit(self, http: Request, req, api_keys=None) -> None:
        """Rate limit, then a slot, for a parsed request. Release with :meth:`release` only
        when this returned."""
        priority = self.try_admit(http, req, api_keys)
        if priority is not None:
            await self.acquire(priority)

    def try_admit(self, http: Request, req, api_keys=None) -> int | None:
        """``admit`` without an await when it need not wait: the priority's check (400), the
        rate limit (429), then a free slot taken (None: release it as after ``admit``).
        Otherwise the priority to wait with in :meth:`acquire`."""
        priority = request_priority(http, req.body)
        if self.limiter is not None:
            self.limiter.check(client_identity(http, api_keys), req.prompt_tokens)
        if self.inflight < self.config.max_inflight and not self.queued:
            self.inflight += 1
            return None
        return priority


class AdmissionMetrics:
    """Scrape-time view of an :class:`Admission` for the data plane's registry."""

    def __init__(self, admission: Admission) -> None:
        self.a = admission

    def describe(self):
        return []

    def collect(self):
        a = self.a
        yield GaugeMetricFamily("omni_dp_admission_inflight", "Requests holding an admission slot", value=a.inflight)
        yield GaugeMetricFamily("omni_dp_admission_queued", "Requests waiting for an admission slot",
                                value=a.queued)
        yield GaugeMetricFamily("omni_dp_admission_max_inflight", "--max-inflight", value=a.config.max_inflight)
        c = CounterMetricFamily("omni_dp_admission_rejected", "Requests refused with 429", labels=["reason"])
        c.add_metric(["queue_full"], a.rejected_full)
        c.add_metric(["queue_timeout"], a.rejected_timeout)
        c.add_metric(["rate_limit"], a.limiter.limited if a.limiter is not None else 0)
        yield c
        yield CounterMetricFamily("omni_dp_admission_waited", "Requests admitted after waiting in the queue",
                                  value=a.admitted_after_wait)
        yield GaugeMetricFamily("omni_dp_rate_limit_buckets", "Clients with a rate-limit bucket",
                                value=len(a.limiter) if a.limiter is not None else 0)
