"""Control-plane configuration: a TOML or YAML file, overridden by command-line flags.

Example (TOML)::

    policy = "predicted_latency"   # the default (with the queue stage); or predicted_latency_unqueued
                                   #   | cache_aware | apc_first | least_load | power_of_two
                                   #   | round_robin | random | <custom>
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

    [state]                        # where specs and loads live; "redis" to share them between replicas
    backend = "redis"              # memory (default) | redis
    redis_url = "redis://127.0.0.1:6379/0"   # redis://, rediss:// or unix:///path
    key_prefix = "omni:"           # namespaces one deployment's keys in a shared Redis
    replica_ttl_s = 10.0           # a replica silent this long loses its reservations
    loads_max_age_s = 0.05         # > 0: place from a local copy of the loads, refreshed this often
    write_behind = true            # answer a placement (and its end) before Redis confirms it
    ledger = "shared"              # "local": placement never waits for Redis (controlplane/state/local.py)
    flush_interval_s = 0.005       # ledger = "local": this replica's loads are written this often
    op_timeout_s = 0.5             # a Redis call unanswered this long: the store is out (placed from memory)
    # file = "/var/lib/omni-proxy/admin.json"   # backend = "memory": operators' changes survive restarts

    [auth]                         # gRPC API tokens (controlplane/auth.py); each scope open until set
    admin_tokens = ["ops:s3cret"]  # omni-ctl; "token" or "name:token" (the name is what logs show)
    registry_tokens = ["vllm:t0k"] # engine plugins (admin tokens work too)
    dataplane_tokens = []          # data-plane sessions (open when empty)
    tokens_file = "tokens.txt"     # lines: SCOPE NAME TOKEN

    [slo]                          # the deployment's latency targets (0 = none): a request without
    ttft_ms = 2000                 #   X-SLO-TTFT-Ms / X-SLO-TPOT-Ms is placed as if it had sent these
    tpot_ms = 100

    [discovery]                    # engines without the plugin (controlplane/discovery.py)
    file = "workers.toml"          # [[workers]] tables, re-read when the file changes
    interval_s = 1.0

    [profiles.cautious]            # a custom policy built from plugin names
    filters = [{name = "overload", max_requests = 16}]
    scorers = [{name = "least_load", weight = 1.0}]
    picker = "max_score"
"""

from __future__ import annotations

import os

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane import validate as v
from controlplane.auth import AuthConfig, parse_tokens
from controlplane.health import HealthConfig
from kvhash.hashing import HASH_ALGOS
from protos.options import MAX_SLO_MS   # (the headers' limit too)
from controlplane.kvcache.manager import KVCacheConfig
from controlplane.scheduling.base import DP_RANK_RULES
from controlplane.scheduling.pd_flow import PD_FLOWS as PD_FLOW_DECIDERS
from controlplane.workers import Role

PD_FLOWS = tuple(PD_FLOW_DECIDERS)   # the PD-flow deciders' names (controlplane.scheduling.pd_flow)
PARALLEL_PROTOCOLS = ("sglang", "mooncake")
LORA_KEY_FORMATS = ("tuple", "name")
MAX_DP_SIZE = 1024
WORKER_KEYS = ("url", "role", "model", "weight", "id", "bootstrap_port", "labels", "kv_events", "kv_replay",
               "dp_size", "max_num_seqs")
SHARED_KEYS = ("branches", "lookahead", "max_entries")
PROFILE_KEYS = ("filters", "scorers", "picker", "queue", "candidates", "shared", "dp_rank")

# key -> check(value, field) returning the value to store. Every key a file or flag can set is
# here, so nothing reaches the running control plane unchecked (types, ranges, enums).
Check = Callable[[Any, str], Any]


def _optional_host(value: Any, name: str) -> str:
    return "" if value == "" else v.host(value, name)


def _policy(value: Any, name: str) -> str:
    # which names exist is checked against the built-ins and [profiles] by build_profile
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a policy name (a built-in or a [profiles] table), got {v.show(value)}")
    return value.strip()


def _otel_endpoint(value: Any, name: str) -> str:
    """"" (spans off) or an OTLP/HTTP collector: an http(s) URL with a host."""
    from urllib.parse import urlsplit

    text = v.text(value, name, max_len=2048).strip()
    if text:
        url = urlsplit(text)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{name} must be an http(s) URL with a host (an OTLP/HTTP collector), "
                             f"got {v.show(value)}")
    return text


TOP_LEVEL: dict[str, Check] = {
    "listen": v.listen_address,
    "session_listen": lambda x, f: x.strip() if isinstance(x, str) and x.strip() in ("auto", "off")
    else v.listen_address(x, f),
    "http_host": v.host,
    "http_port": lambda x, f: v.int_range(x, f, 0, v.MAX_PORT),
    "policy": _policy,
    "pd_flow": lambda x, f: v.choice(x, f, PD_FLOWS),
    "parallel_protocol": lambda x, f: v.choice(x, f, PARALLEL_PROTOCOLS),
    "metaserver_host": _optional_host,
    "layerwise_timeout_s": lambda x, f: v.positive_seconds(x, f, max_s=86400),
    "prefill_retries": lambda x, f: v.int_range(x, f, 0, 16),
    "heartbeat_interval_s": lambda x, f: v.positive_seconds(x, f, max_s=3600),
    "heartbeat_ttl_s": lambda x, f: v.positive_seconds(x, f, max_s=86400),
    "max_request_age_s": lambda x, f: v.positive_seconds(x, f),
    "session_grace_s": lambda x, f: v.positive_seconds(x, f, allow_zero=True, max_s=3600),
    "engine_api_key": lambda x, f: v.text(x, f, max_len=4096),
    "otel_endpoint": lambda x, f: _otel_endpoint(x, f),
    "otel_service_name": lambda x, f: v.text(x, f, max_len=256),
}
HEALTH: dict[str, Check] = {
    "interval_s": lambda x, f: v.positive_seconds(x, f, max_s=3600),
    "timeout_s": lambda x, f: v.positive_seconds(x, f, max_s=3600),
    "unhealthy_after": lambda x, f: v.int_range(x, f, 1, 1000),
    "metrics_interval_s": lambda x, f: v.positive_seconds(x, f, max_s=3600),
    "poll_metrics": v.boolean,
    "eject_after": lambda x, f: v.int_range(x, f, 1, 1000),
    "eject_base_s": lambda x, f: v.positive_seconds(x, f, max_s=86400),
    "eject_max_s": lambda x, f: v.positive_seconds(x, f, max_s=86400),
}
KV_CACHE: dict[str, Check] = {
    "block_size": lambda x, f: v.int_range(x, f, 1, 4096),
    "hash_algo": lambda x, f: v.choice(x, f, HASH_ALGOS),
    "hash_seed": v.hash_seed,
    "lora_key_format": lambda x, f: v.choice(x, f, LORA_KEY_FORMATS),
    "max_blocks": lambda x, f: v.int_range(x, f, 1, 1_000_000_000),
    "approx_ttl_s": lambda x, f: v.positive_seconds(x, f, max_s=86400),
    "pending_ttl_s": lambda x, f: v.positive_seconds(x, f, allow_zero=True, max_s=3600),
    "routed_stride": lambda x, f: v.int_range(x, f, 1, 1024),
    "replay_timeout_s": lambda x, f: v.positive_seconds(x, f, max_s=600),
    "max_replay_gap": lambda x, f: v.int_range(x, f, 1, 10_000_000),
    "snapshot_interval_s": lambda x, f: v.positive_seconds(x, f, allow_zero=True, max_s=3600),
}

STATE_BACKENDS = ("memory", "redis")
STATE_LEDGERS = ("shared", "local")


def _redis_url(value: Any, name: str) -> str:
    """redis://[user:password@]host[:port][/db], rediss://..., or unix:///path; never echoes a password."""
    allowed = "a redis://host[:port][/db], rediss://... or unix:///path URL"
    if not isinstance(value, str) or not value.strip() or len(value) > v.MAX_URL_LEN \
            or any(c.isspace() or ord(c) < 32 for c in value.strip()):
        raise ValueError(f"{name} must be {allowed}")
    from urllib.parse import urlsplit

    url = value.strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{name} must be {allowed} (the port must be a number from 1 to 65535)") from None
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss"):
        db = parts.path.strip("/")
        if not parts.hostname or (db and not db.isdigit()) or port == 0:
            raise ValueError(f"{name} must be {allowed} (a host is required; the db is a number)")
    elif scheme == "unix":
        if not parts.path:
            raise ValueError(f"{name} must be {allowed} (unix:// needs a socket path)")
    else:
        raise ValueError(f"{name} must be {allowed}, got scheme {v.show(parts.scheme, 20)}")
    return url


def _key_prefix(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 64 or \
            any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{name} must be 1-64 characters without spaces (for example \"omni:\"), "
                         f"got {v.show(value)}")
    return value


STATE: dict[str, Check] = {
    "backend": lambda x, f: v.choice(x, f, STATE_BACKENDS),
    "redis_url": _redis_url,
    "key_prefix": _key_prefix,
    "replica_ttl_s": lambda x, f: v.positive_seconds(x, f, max_s=3600),
    "loads_max_age_s": lambda x, f: v.positive_seconds(x, f, allow_zero=True, max_s=10),
    "write_behind": v.boolean,
    "ledger": lambda x, f: v.choice(x, f, STATE_LEDGERS),
    "flush_interval_s": lambda x, f: v.positive_seconds(x, f, max_s=1),
    "op_timeout_s": lambda x, f: v.positive_seconds(x, f, max_s=30),
    "file": lambda x, f: _tokens_file(x, f),
}


def _tokens_file(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError(f"{name} must be a file path, got {v.show(value)}")
    return value.strip()


AUTH: dict[str, Check] = {
    "admin_tokens": parse_tokens,
    "registry_tokens": parse_tokens,
    "dataplane_tokens": parse_tokens,
    "tokens_file": _tokens_file,
    "tls_cert": _tokens_file,
    "tls_key": _tokens_file,
    "tls_client_ca": _tokens_file,
}


@dataclass
class DiscoveryConfig:
    file: str = ""             # a TOML file of [[workers]] tables, re-read when it changes
    interval_s: float = 1.0    # how often its modification time is checked


DISCOVERY: dict[str, Check] = {
    "file": _tokens_file,
    "interval_s": lambda x, f: v.positive_seconds(x, f, max_s=3600),
}




@dataclass
class SLOConfig:
    """The deployment's latency targets, in milliseconds of wall time (0 = none). Operators
    have one SLO for a deployment: a request that names no ``X-SLO-TTFT-Ms`` /
    ``X-SLO-TPOT-Ms`` of its own is placed as if it had sent these (``Placer._context``), so
    a configured SLO acts exactly as the headers do on every request; a header still wins,
    target by target. Without either, the scorer judges against its defaults (2 s / 100 ms)."""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


SLO: dict[str, Check] = {
    "ttft_ms": lambda x, f: v.number(x, f, 0.0, MAX_SLO_MS),
    "tpot_ms": lambda x, f: v.number(x, f, 0.0, MAX_SLO_MS),
}


@dataclass
class StateConfig:
    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "omni:"
    replica_ttl_s: float = 10.0
    # Placement never waits for Redis by default (issue 19): loads from this replica's copy,
    # refreshed in the background this often (0: read Redis every placement), and charges sent
    # without waiting for Redis to confirm them (false: wait). docs/benchmarks/scaleout.md.
    loads_max_age_s: float = 0.05
    write_behind: bool = True
    ledger: str = "shared"            # "local": this replica's charges in memory, published in batches
    flush_interval_s: float = 0.005   # ledger = "local": how often changed loads are written to Redis
    op_timeout_s: float = 0.5         # a Redis call unanswered this long is an outage (a hung Redis)
    # backend = "memory": where operators' changes (drains, weights, added and removed workers)
    # are kept across restarts (controlplane/admin_state.py); "": in memory only (said at start
    # and in every omni-ctl answer).
    file: str = ""


def _table(value: Any, name: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a table of keys, got {v.show(value)}")
    return value


def _apply(target: object, checks: dict[str, Check], data: dict[Any, Any], section: str, what: str) -> None:
    """Check each key of one section and store it; unknown keys are refused, naming the allowed ones."""
    for key, value in data.items():
        name = f"{section}.{key}" if section else str(key)
        if key not in checks:
            hint = next((f" (it belongs in [{sec}])" for sec, keys in (("health", HEALTH), ("kv_cache", KV_CACHE),
                                                                         ("state", STATE), ("auth", AUTH),
                                                                         ("discovery", DISCOVERY), ("slo", SLO))
                         if not section and key in keys), "")
            raise ValueError(f"unknown {what} {v.show(key)}{hint}: allowed are {', '.join(checks)}")
        setattr(target, key, checks[key](value, name))


def _labels(value: Any, name: str) -> dict[str, str]:
    labels = _table(value, name)
    out = {}
    for k, val in labels.items():
        if not isinstance(k, str) or not k or len(k) > 128:
            raise ValueError(f"{name} keys must be strings of 1-128 characters, got {v.show(k)}")
        if not isinstance(val, (str, int, float, bool)):
            raise ValueError(f"{name}.{k} must be a string or a number, got {v.show(val)}")
        out[k] = v.text(str(val), f"{name}.{k}")
    return out


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
    where: str = field(default="", repr=False, compare=False)  # how errors name it: workers[2], --worker URL

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "worker") -> WorkerSpec:
        """One ``[[workers]]`` table; ``where`` names it in errors (``workers[2]``, ``--worker URL``)."""
        data = _table(data, where)
        unknown = [k for k in data if k not in WORKER_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown worker keys: {', '.join(v.show(k) for k in unknown)} "
                             f"(allowed: {', '.join(WORKER_KEYS)})")
        if "url" not in data:
            raise ValueError(f"{where}.url is missing: every worker needs a url")
        role = data.get("role", "both")
        if not isinstance(role, str):
            raise ValueError(f"{where}.role must be both, prefill or decode, got {v.show(role)}")
        try:
            parsed_role = Role.parse(role)
        except ValueError as exc:
            raise ValueError(f"{where}.role: {exc}") from None
        dp_size = v.int_range(data.get("dp_size", 1), f"{where}.dp_size", 1, MAX_DP_SIZE)
        kv_events = v.kv_endpoint(data.get("kv_events", ""), f"{where}.kv_events", dp_size)
        kv_replay = v.kv_endpoint(data.get("kv_replay", ""), f"{where}.kv_replay", dp_size)
        if kv_replay and not kv_events:
            raise ValueError(f"{where}.kv_replay needs {where}.kv_events: replay only fills gaps in a live stream")
        labels = _labels(data.get("labels"), f"{where}.labels")
        if "max_num_seqs" in data:
            # The engine's --max-num-seqs, for the TTFT prediction's seat wait (prediction.seats_of):
            # kept as the label an engine's registration could carry as well.
            labels["max_num_seqs"] = str(v.int_range(data["max_num_seqs"], f"{where}.max_num_seqs", 1, 1 << 20))
        return cls(url=v.url(data["url"], f"{where}.url"), role=parsed_role,
                   model=v.text(data.get("model", ""), f"{where}.model"),
                   weight=v.weight(data.get("weight", 1.0), f"{where}.weight"),
                   id=v.worker_id(data.get("id", ""), f"{where}.id", allow_empty=True),
                   bootstrap_port=v.int_range(data.get("bootstrap_port", 0), f"{where}.bootstrap_port",
                                              0, v.MAX_PORT),
                   labels=labels, kv_events=kv_events, kv_replay=kv_replay, dp_size=dp_size, where=where)

    @classmethod
    def parse_flag(cls, text: str, role: Role | None = None, flag: str = "--worker") -> WorkerSpec:
        """``URL[,key=value...]`` as given on the command line."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise ValueError(f"{flag} needs a URL, got {v.show(text)}")
        url, *opts = parts
        where = f"{flag} {v.show(url, 80)}"
        data: dict[str, Any] = {"url": url}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep:
                raise ValueError(f"bad worker option {opt!r} in {text!r}: expected key=value")
            key, value = key.strip(), value.strip()
            data[key] = _flag_value(key, value, where)
        if role is not None:
            data["role"] = role.value
        return cls.from_dict(data, where)


def _flag_value(key: str, value: str, where: str) -> Any:
    """Flags arrive as text: numbers are parsed here so the same checks apply as for files."""
    try:
        if key == "weight":
            return float(value)
        if key in ("bootstrap_port", "dp_size", "max_num_seqs"):
            return int(value)
    except ValueError:
        raise ValueError(f"{where}.{key} must be a number, got {v.show(value)}") from None
    return value


def _profiles(value: Any) -> dict[str, dict[str, Any]]:
    """The shape of ``[profiles.NAME]`` tables; plugin names and options are checked by build_profile."""
    profiles = _table(value, "profiles")
    for name, spec in profiles.items():
        where = f"profiles.{name}"
        spec = _table(spec, where)
        unknown = [k for k in spec if k not in PROFILE_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown keys {', '.join(v.show(k) for k in unknown)} "
                             f"(allowed: {', '.join(PROFILE_KEYS)})")
        for kind in ("filters", "scorers"):
            items = spec.get(kind, [])
            if not isinstance(items, list):
                raise ValueError(f"{where}.{kind} must be a list of plugin names or tables, got {v.show(items)}")
            for i, item in enumerate(items):
                _plugin(item, f"{where}.{kind}[{i}]")
                if kind == "scorers" and isinstance(item, dict) and "weight" in item:
                    v.number(item["weight"], f"{where}.{kind}[{i}].weight", 0.0, v.MAX_WEIGHT)
        for single in ("picker", "queue", "candidates"):
            if single in spec:
                _plugin(spec[single], f"{where}.{single}")
        if "shared" in spec:
            _shared(spec["shared"], f"{where}.shared")
        if "dp_rank" in spec and spec["dp_rank"] not in DP_RANK_RULES:
            raise ValueError(f"{where}.dp_rank must be one of {', '.join(DP_RANK_RULES)}, "
                             f"got {v.show(spec['dp_rank'])}")
    return dict(profiles)


def _shared(item: Any, where: str) -> None:
    """``shared``: the options of the shared-prefix rule (controlplane.scheduling.shared)."""
    table = _table(item, where)
    for key, value in table.items():
        if key not in SHARED_KEYS:
            raise ValueError(f"{where}: unknown key {v.show(key)} (allowed: {', '.join(SHARED_KEYS)})")
        v.int_range(value, f"{where}.{key}", 1, 1 << 30)


def _plugin(item: Any, where: str) -> None:
    if isinstance(item, str):
        return
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError(f"{where} must be a plugin name or a table with a name, got {v.show(item)}")
    for k in item:
        if not isinstance(k, str):
            raise ValueError(f"{where}: option names must be strings, got {v.show(k)}")


# /metrics and /health (and the metaserver) listen here unless http_port says otherwise: a
# fixed, documented port a scraper can be pointed at (0 = any free port, for tests).
DEFAULT_HTTP_PORT = 9090


@dataclass
class ControlPlaneConfig:
    listen: str = "127.0.0.1:50051"
    # Data-plane sessions on a plain socket (controlplane/session_socket.py): "auto" = the
    # gRPC host, any free port (data planes ask where); "off" = gRPC sessions only.
    session_listen: str = "auto"
    http_host: str = "127.0.0.1"
    http_port: int = DEFAULT_HTTP_PORT   # /metrics, /health (and the metaserver); 0 = any free port
    policy: str = "predicted_latency"    # the best measured (README "Policies")
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
    session_grace_s: float = 30.0         # a data plane's requests outlive its session this long
    # Sent as "Authorization: Bearer" on every call the control plane makes to an engine
    # (health, model discovery, /metrics, the metaserver's prefill leg). Never logged.
    engine_api_key: str = field(default_factory=lambda: os.environ.get("OMNI_ENGINE_API_KEY", ""), repr=False)
    # OTLP/HTTP collector: spans for placement and queueing, joined to the data plane's
    # trace ("" = off: the SDK is never imported). Needs the otel extra.
    otel_endpoint: str = ""
    otel_service_name: str = "omni-proxy-controlplane"
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    state: StateConfig = field(default_factory=StateConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    # The keys a file or a flag set ("listen", "state.file"...): what was chosen, not defaulted
    # (omni-proxy up binds a private port unless ``listen`` was chosen).
    explicit: set[str] = field(default_factory=set, repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str | Path) -> ControlPlaneConfig:
        """Load a TOML or YAML file; syntax errors name the file and the line."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
                what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ValueError(f"{where}: YAML syntax error: {what}") from None
            if data is None:
                data = {}
        else:
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{path}: TOML syntax error: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the file must hold a table of keys, not {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControlPlaneConfig:
        data = dict(data)
        cfg = cls()
        health = _table(data.pop("health", None), "health")
        workers = data.pop("workers", None) or []
        profiles = data.pop("profiles", None)
        kv = _table(data.pop("kv_cache", None), "kv_cache")
        state = _table(data.pop("state", None), "state")
        auth = _table(data.pop("auth", None), "auth")
        discovery = _table(data.pop("discovery", None), "discovery")
        slo = _table(data.pop("slo", None), "slo")
        cfg.explicit = {str(k) for k in data} | {f"{sec}.{k}" for sec, table in (
            ("health", health), ("kv_cache", kv), ("state", state), ("auth", auth), ("discovery", discovery),
            ("slo", slo)) for k in table}
        _apply(cfg, TOP_LEVEL, data, "", "config key")
        _apply(cfg.health, HEALTH, health, "health", "health key")
        _apply(cfg.kv_cache, KV_CACHE, kv, "kv_cache", "kv_cache key")
        _apply(cfg.state, STATE, state, "state", "state key")
        _apply(cfg.auth, AUTH, auth, "auth", "auth key")
        _apply(cfg.discovery, DISCOVERY, discovery, "discovery", "discovery key")
        _apply(cfg.slo, SLO, slo, "slo", "slo key")
        if not isinstance(workers, list):
            raise ValueError(f"workers must be a list of [[workers]] tables, got {v.show(workers)}")
        cfg.workers = [WorkerSpec.from_dict(w, f"workers[{i}]") for i, w in enumerate(workers)]
        cfg.profiles = _profiles(profiles)
        cfg.check()
        return cfg

    def set(self, key: str, value: Any, name: str) -> None:
        """Set one top-level or ``section.key`` key from a flag, with the file's checks."""
        section, _, sub = key.rpartition(".")
        target, checks = {"": (self, TOP_LEVEL), "health": (self.health, HEALTH),
                          "kv_cache": (self.kv_cache, KV_CACHE), "state": (self.state, STATE),
                          "auth": (self.auth, AUTH), "discovery": (self.discovery, DISCOVERY),
                          "slo": (self.slo, SLO)}[section]
        setattr(target, sub, checks[sub](value, name))
        self.explicit.add(key)

    def check(self) -> None:
        """Checks across keys: run again after flags have added workers."""
        ids: dict[str, str] = {}
        urls: dict[tuple[str, str], str] = {}
        for i, w in enumerate(self.workers):
            where = w.where or f"workers[{i}]"
            if w.id:
                if w.id in ids:
                    raise ValueError(f"{where}.id {w.id!r} is also the id of {ids[w.id]}: worker ids must be unique")
                ids[w.id] = where
            key = (w.url.lower(), w.role.value)
            if key in urls:
                raise ValueError(f"{where}.url {w.url} is listed twice with role {w.role.value} "
                                 f"(also {urls[key]}): list each engine once")
            urls[key] = where
        if self.state.file and self.state.backend != "memory":
            raise ValueError("state.file keeps operators' changes for the memory store; with backend = "
                             f"{self.state.backend!r} the store keeps them: remove state.file")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s must be greater than heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g}), got {self.heartbeat_ttl_s:g}")
