"""The control plane's view of one inference engine ("worker") and its load."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class Role(str, enum.Enum):
    BOTH = "both"        # aggregated: prefill and decode on one engine
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: str) -> "Role":
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"unknown role {value!r}: expected both, prefill or decode") from None


class Health(str, enum.Enum):
    UNKNOWN = "unknown"    # never checked: gets no placements until the first check passes
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass
class EngineMetrics:
    """Engine-side numbers polled from /metrics; only used to refine our own counts."""

    running: int = -1
    waiting: int = -1
    kv_usage: float = -1.0
    prefix_hits: float = -1.0       # vllm:prefix_cache_hits_total (tokens)
    prefix_queries: float = -1.0    # vllm:prefix_cache_queries_total (tokens)
    updated_at: float = 0.0

    def fresh(self, max_age_s: float, now: float | None = None) -> bool:
        return self.updated_at > 0 and ((now or time.monotonic()) - self.updated_at) <= max_age_s


@dataclass
class Worker:
    id: str
    url: str
    role: Role
    model: str = ""
    weight: float = 1.0
    health: Health = Health.UNKNOWN
    draining: bool = False
    source: str = "config"            # config | registry | admin
    bootstrap_port: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    # Load counted by the control plane itself: current at the moment of each placement.
    inflight_requests: int = 0
    inflight_tokens: int = 0
    engine: EngineMetrics = field(default_factory=EngineMetrics)
    placements_total: int = 0
    failures_total: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    heartbeat_ttl_s: float = 0.0      # 0: never expires (static workers)
    kv_events: str = ""               # ZMQ KV-event publisher; empty: approximate cache tracking
    kv_replay: str = ""
    dp_size: int = 1
    last_heartbeat: float = field(default_factory=time.monotonic)

    @property
    def routable(self) -> bool:
        return self.health is Health.HEALTHY and not self.draining

    def serves(self, model: str) -> bool:
        return not model or self.model == model


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url
