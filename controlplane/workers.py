"""The control plane's values for one inference engine ("worker").

Everything here is immutable. A worker's *spec* (where it is, what it serves, how much
traffic an operator wants it to get) changes only by replacing it in the store; its
health and engine metrics are derived from checks and replaced whole; its load lives in
the ledger. Placement reads a :class:`WorkerView` per candidate, a snapshot that nobody
can change behind its back, so a store that suspends mid-placement cannot tear it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from collections.abc import Mapping

from protos import omni_proxy_pb2 as pb


class Role(str, enum.Enum):  # noqa: UP042 - StrEnum would change str(member) from 'Role.X' to its value
    BOTH = "both"        # aggregated: prefill and decode on one engine
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: str) -> Role:
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"unknown role {value!r}: expected both, prefill or decode") from None


# The one mapping between a Role and the wire's pb.Role (the admin API, placements, fleet
# snapshots), both ways.
ROLE_TO_PB: Mapping[Role, pb.Role] = MappingProxyType(
    {Role.BOTH: pb.ROLE_BOTH, Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE})
PB_TO_ROLE: Mapping[int, Role] = MappingProxyType({v: k for k, v in ROLE_TO_PB.items()})


class Health(str, enum.Enum):  # noqa: UP042 - as Role: str(member) stays 'Health.X'
    UNKNOWN = "unknown"    # never checked: gets no placements until the first check passes
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


_NO_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker is; durable (config, registration, operators' changes)."""

    id: str
    url: str
    role: Role
    model: str = ""
    weight: float = 1.0
    draining: bool = False
    source: str = "config"            # config | registry | admin
    bootstrap_port: int = 0
    labels: Mapping[str, str] = field(default_factory=lambda: _NO_LABELS)
    kv_events: str = ""               # ZMQ KV-event publisher; empty: approximate cache tracking
    kv_replay: str = ""
    dp_size: int = 1
    heartbeat_ttl_s: float = 0.0      # 0: never expires (static workers)
    # Registered workers (source registry) only, see controlplane/ownership.py: the name of
    # the token that registered it ("" when the registry is open) and the SHA-256 of the
    # registration's owner key. Registry calls for this id must bring both.
    owner: str = ""
    owner_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.labels, MappingProxyType):
            object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    @property
    def placeable(self) -> bool:
        """The operator's part of routability: not drained, not weighted out."""
        return not self.draining and self.weight > 0

    def serves(self, model: str) -> bool:
        return not model or self.model == model


@dataclass(frozen=True, slots=True)
class HealthState:
    """Derived from health checks and data-plane failure reports.

    ``health`` is what the health checks say. Ejection is the circuit breaker (Envoy's
    outlier detection): engines that keep failing real requests (5xx, 429, timeouts) while
    passing health checks are taken out of rotation until ``ejected_until``, for a time
    that doubles with every ejection in a row; one more failure after the return ejects
    again, a success closes the breaker.
    """

    health: Health = Health.UNKNOWN
    consecutive_failures: int = 0     # of health checks
    failures_total: int = 0           # of requests, as the data planes report them
    last_error: str = ""
    failure_streak: int = 0           # requests failed in a row on this worker
    ejections: int = 0                # ejections in a row (no success in between)
    ejected_until: float = 0.0        # time.monotonic(); 0: not ejected
    # The engine's /v1/models max_model_len: 0 not read yet (again after a failed check,
    # since a restarted engine may say otherwise), -1 the engine does not say.
    max_model_len: int = 0
    # The LoRA adapters the engine serves besides its base model, (served name, path), read
    # with max_model_len from /v1/models (vLLM lists each adapter with a "parent" and its
    # path as "root"): a request naming one is routed here like one for the base model.
    loras: tuple[tuple[str, str], ...] = ()

    def serves_lora(self, name: str) -> bool:
        return any(n == name for n, _ in self.loras)

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    def circuit(self, now: float) -> str:
        if self.ejected(now):
            return "open"
        return "half_open" if self.ejections else "closed"


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """Engine-side numbers polled from /metrics; only used to refine our own counts."""

    running: int = -1
    waiting: int = -1
    kv_usage: float = -1.0
    prefix_hits: float = -1.0       # vllm:prefix_cache_hits_total (tokens)
    prefix_queries: float = -1.0    # vllm:prefix_cache_queries_total (tokens)
    updated_at: float = 0.0

    def fresh(self, max_age_s: float, now: float) -> bool:
        return self.updated_at > 0 and (now - self.updated_at) <= max_age_s


NO_METRICS = EngineMetrics()
UNCHECKED = HealthState()


@dataclass(frozen=True, slots=True)
class Load:
    """What the ledger holds against one worker: placed and not yet released.

    ``prefill_tokens`` is the part of it still to be computed: the uncached prompt tokens
    of requests placed there whose first token has not come yet. It is what a new
    request would queue behind, so predicted time to first token starts from it.
    """

    requests: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    prefills: int = 0            # requests whose prompt is still to be computed


IDLE = Load()


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as a placement sees it: spec, load, health and metrics at one instant."""

    spec: WorkerSpec
    load: Load = IDLE
    state: HealthState = UNCHECKED
    engine: EngineMetrics = NO_METRICS

    # The attributes plugins read most, without the extra hop.
    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def weight(self) -> float:
        return self.spec.weight

    @property
    def draining(self) -> bool:
        return self.spec.draining

    @property
    def kv_events(self) -> str:
        return self.spec.kv_events

    @property
    def health(self) -> Health:
        return self.state.health

    @property
    def inflight_requests(self) -> int:
        return self.load.requests

    @property
    def inflight_tokens(self) -> int:
        return self.load.tokens

    @property
    def routable(self) -> bool:
        return self.state.health is Health.HEALTHY and self.spec.placeable

    def serves(self, model: str) -> bool:
        return self.spec.serves(model) or self.state.serves_lora(model)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url
