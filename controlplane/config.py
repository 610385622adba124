"""Control-plane configuration: a TOML or YAML file, overridden by command-line flags.

Example (TOML)::

    policy = "least_load"          # round_robin | random | power_of_two | least_load | <custom>
    pd_flow = "sequential"         # sequential | parallel | layerwise
    parallel_protocol = "sglang"   # parallel flow: "sglang" or "mooncake" (vLLM bootstrap)
    metaserver_host = "10.0.0.2"   # layerwise: the address D engines call (never a wildcard)

    [health]
    interval_s = 2.0

    [[workers]]
    url = "http://10.0.0.5:8000"
    role = "prefill"               # both | prefill | decode
    model = "deepseek-v3"          # optional: discovered from /v1/models
    weight = 1.0
    kv_events = "tcp://10.0.0.5:5557"   # optional: exact prefix tracking from KV events

    [kv_cache]                     # must match the engines' prefix-cache settings
    block_size = 16
    hash_algo = "sha256"           # --prefix-caching-hash-algo
    hash_seed = "0"                # the engines' PYTHONHASHSEED (omit if unset)

    [profiles.cautious]            # a custom policy built from plugin names
    filters = [{name = "overload", max_requests = 16}]
    scorers = [{name = "least_load", weight = 1.0}]
    picker = "max_score"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.health import HealthConfig
from controlplane.kvcache.manager import KVCacheConfig
from controlplane.workers import Role, normalize_url


@dataclass
class WorkerSpec:
    url: str
    role: Role = Role.BOTH
    model: str = ""
    weight: float = 1.0
    id: str = ""
    bootstrap_port: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    kv_events: str = ""      # the engine's ZMQ KV-event publisher (exact prefix tracking)
    kv_replay: str = ""      # its replay endpoint, when the engine has one
    dp_size: int = 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkerSpec":
        unknown = set(data) - {"url", "role", "model", "weight", "id", "bootstrap_port", "labels",
                               "kv_events", "kv_replay", "dp_size"}
        if unknown:
            raise ValueError(f"unknown worker keys: {', '.join(sorted(unknown))}")
        if "url" not in data:
            raise ValueError("every worker needs a url")
        weight = float(data.get("weight", 1.0))
        if weight < 0:
            raise ValueError(f"worker {data['url']}: weight must be >= 0")
        return cls(url=normalize_url(str(data["url"])), role=Role.parse(str(data.get("role", "both"))),
                   model=str(data.get("model", "")), weight=weight, id=str(data.get("id", "")),
                   bootstrap_port=int(data.get("bootstrap_port", 0)),
                   labels={str(k): str(v) for k, v in (data.get("labels") or {}).items()},
                   kv_events=str(data.get("kv_events", "")), kv_replay=str(data.get("kv_replay", "")),
                   dp_size=int(data.get("dp_size", 1)))

    @classmethod
    def parse_flag(cls, text: str, role: Role | None = None) -> "WorkerSpec":
        """``URL[,key=value...]`` as given on the command line."""
        url, *opts = [p.strip() for p in text.split(",") if p.strip()]
        data: dict[str, Any] = {"url": url}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep:
                raise ValueError(f"bad worker option {opt!r} in {text!r}: expected key=value")
            data[key.strip()] = value.strip()
        if role is not None:
            data["role"] = role.value
        return cls.from_dict(data)


@dataclass
class ControlPlaneConfig:
    listen: str = "127.0.0.1:50051"
    http_host: str = "127.0.0.1"
    http_port: int = 0               # /metrics, /health (and the metaserver); 0 = any free port
    policy: str = "least_load"
    pd_flow: str = "sequential"
    parallel_protocol: str = "sglang"     # parallel flow: sglang bootstrap_* or vLLM "mooncake"
    metaserver_host: str = ""             # address decode engines use to reach /v1/metaserver
    layerwise_timeout_s: float = 120.0    # how long a layerwise request waits for D's call
    prefill_retries: int = 1              # metaserver: other prefill workers to try on failure
    workers: list[WorkerSpec] = field(default_factory=list)
    health: HealthConfig = field(default_factory=HealthConfig)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    max_request_age_s: float = 3600.0
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)

    @classmethod
    def from_file(cls, path: str | Path) -> "ControlPlaneConfig":
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ControlPlaneConfig":
        data = dict(data)
        cfg = cls()
        health = data.pop("health", {}) or {}
        workers = data.pop("workers", []) or []
        profiles = data.pop("profiles", {}) or {}
        kv = data.pop("kv_cache", {}) or {}
        for key, value in data.items():
            if not hasattr(cfg, key) or key in ("health", "workers", "profiles"):
                raise ValueError(f"unknown config key {key!r}")
            setattr(cfg, key, type(getattr(cfg, key))(value))
        for key, value in health.items():
            if not hasattr(cfg.health, key):
                raise ValueError(f"unknown health key {key!r}")
            setattr(cfg.health, key, type(getattr(cfg.health, key))(value))
        for key, value in kv.items():
            if not hasattr(cfg.kv_cache, key):
                raise ValueError(f"unknown kv_cache key {key!r}")
            current = getattr(cfg.kv_cache, key)
            setattr(cfg.kv_cache, key, value if current is None else type(current)(value))
        cfg.workers = [WorkerSpec.from_dict(w) for w in workers]
        cfg.profiles = dict(profiles)
        return cfg
