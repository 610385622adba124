"""The registration agent: register, heartbeat, re-register, deregister. No vLLM import.

One daemon thread per engine. It waits until the engine answers ``/health`` locally, then
registers with the first control plane (of ``OMNI_CONTROLPLANE``'s comma-separated list) that
answers, retrying with backoff while none does (``omni_runtime.retry``, the policy of every retried
thing: full jitter, 0.5 s doubling to 30 s).
It never raises into the engine and never blocks it: every gRPC call has a deadline and runs
on this thread. Heartbeats carry the engine's running/waiting requests (read from its own
``/metrics``), at the interval the control plane answered. A heartbeat answered
``known=false`` (the control plane restarted, or expired us) registers again; a heartbeat
that fails goes to the next control plane next time (registering there only if it answers
known=false). ``stop()`` deregisters
(bounded by a deadline) and ends the thread.

The worker id belongs to this agent's first registration: the agent makes an owner key once
(``secrets``), sends it with every Register, Heartbeat and Deregister, and so registers its
own id again after a control-plane restart. Another engine registering the same id (or a
configured worker's) is refused by the control plane (controlplane/ownership.py): a
registration refused with ALREADY_EXISTS (the id is still held by an earlier registration,
until its heartbeats expire) is retried with backoff; a heartbeat refused with
PERMISSION_DENIED (the id now belongs to someone else) registers again.

A registration refused with INVALID_ARGUMENT, FAILED_PRECONDITION or PERMISSION_DENIED (for
example block size or hash algorithm that cannot match the control plane's ``[kv_cache]``) is logged as one
ERROR line with the control plane's message. The next address is tried at once; once all
have refused, all are tried again every ``refused_retry_s`` (60 s), in case a control
plane's configuration changes.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc

from omni_runtime.retry import Retry
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc

log = logging.getLogger("vllm.omni_proxy")  # under "vllm": vLLM's log handlers and format

ROLES = {"both": pb.ROLE_BOTH, "prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}
_WILDCARD = {"", "*", "0.0.0.0", "::", "[::]"}


@dataclass
class EngineFacts:
    """What the engine is, read from its configuration (``facts.py`` for vLLM)."""

    host: str                          # the HTTP listen host ("" / 0.0.0.0: every interface)
    port: int
    models: list[str]                  # served model names, first one registered
    block_size: int = 0
    prefix_caching: bool = False
    hash_algo: str = ""
    hash_seed: str | None = None       # PYTHONHASHSEED, None when unset
    kv_events: str = ""                # the publisher's endpoint as configured (may be tcp://*:5557)
    kv_replay: str = ""
    dp_size: int = 1
    kv_connector: str = ""
    kv_role: str = ""                  # kv_producer | kv_consumer | kv_both | ""
    kv_capacity_tokens: int = 0
    max_batched_tokens: int = 0
    max_num_seqs: int = 0              # --max-num-seqs (0: unknown)
    engine_version: str = ""
    tls: bool = False                  # the engine serves https

    @property
    def local_url(self) -> str:
        host = "127.0.0.1" if self.host in _WILDCARD else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


@dataclass
class Settings:
    """The plugin's environment (the names of deploy/kubernetes/overlays/example/vllm-engines.yaml)."""

    controlplanes: list[str]
    role: str = ""                     # "" : from the KV connector's role
    advertise_url: str = ""
    worker_id: str = ""
    token: str = ""
    kv_events: str | None = None       # None: derived; "" / "none": not announced
    kv_replay: str | None = None
    weight: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_ttl_s: float = 0.0
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    rpc_timeout_s: float = 5.0
    health_timeout_s: float = 2.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings | None:
        """None when OMNI_CONTROLPLANE is unset (the plugin then does nothing). Raises ValueError."""
        env = os.environ if env is None else env
        cps = [a.strip() for a in env.get("OMNI_CONTROLPLANE", "").split(",") if a.strip()]
        if not cps:
            return None
        role = env.get("OMNI_ROLE", "").strip().lower()
        if role and role not in ROLES:
            raise ValueError(f"OMNI_ROLE must be both, prefill or decode, got {role!r}")
        labels = {}
        for item in env.get("OMNI_LABELS", "").split(","):
            if not item.strip():
                continue
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"OMNI_LABELS must be k=v,k=v, got {item!r}")
            labels[key.strip()] = value.strip()
        try:
            weight = float(env.get("OMNI_WEIGHT") or 0.0)
            ttl = float(env.get("OMNI_HEARTBEAT_TTL_S") or 0.0)
        except ValueError as exc:
            raise ValueError(f"OMNI_WEIGHT / OMNI_HEARTBEAT_TTL_S must be numbers: {exc}") from None
        if weight < 0 or ttl < 0:
            raise ValueError("OMNI_WEIGHT and OMNI_HEARTBEAT_TTL_S must be >= 0")
        return cls(controlplanes=cps, role=role, advertise_url=env.get("OMNI_ADVERTISE_URL", "").strip(),
                   worker_id=env.get("OMNI_WORKER_ID", "").strip(), token=env.get("OMNI_TOKEN", "").strip(),
                   kv_events=env.get("OMNI_KV_EVENTS"), kv_replay=env.get("OMNI_KV_REPLAY"), weight=weight,
                   labels=labels, heartbeat_ttl_s=ttl, tls_ca=env.get("OMNI_TLS_CA", ""),
                   tls_cert=env.get("OMNI_TLS_CERT", ""), tls_key=env.get("OMNI_TLS_KEY", ""))


def role_for(settings: Settings, facts: EngineFacts) -> str:
    if settings.role:
        return settings.role
    return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(facts.kv_role, "both")


def _host_toward(address: str) -> str:
    """This machine's address on the route toward ``address`` (no packet is sent)."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]") or "127.0.0.1", int(port or 50051), type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return socket.gethostbyname(socket.gethostname())


def advertise_url(settings: Settings, facts: EngineFacts) -> str:
    if settings.advertise_url:
        url = settings.advertise_url
        return url if "://" in url else "http://" + url
    host = facts.host
    if host in _WILDCARD:
        host = _host_toward(settings.controlplanes[0])
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if facts.tls else 'http'}://{host}:{facts.port}"


def public_endpoint(endpoint: str, advertised: str) -> str:
    """A ZMQ bind endpoint as the control plane must connect to it: tcp://*:5557 ->
    tcp://<advertised host>:5557. ipc:// and explicit hosts stay as they are."""
    if not endpoint:
        return ""
    m = re.fullmatch(r"tcp://(\[[^\]]*\]|[^:]*):(\d+)", endpoint)
    if not m or m.group(1).strip("[]") not in {h.strip("[]") for h in _WILDCARD}:
        return endpoint
    host = urlsplit(advertised).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{m.group(2)}"


def build_request(settings: Settings, facts: EngineFacts) -> pb.RegisterRequest:
    url = advertise_url(settings, facts)
    events = settings.kv_events
    if events is None:
        events = public_endpoint(facts.kv_events, url)
    replay = settings.kv_replay
    if replay is None:
        replay = public_endpoint(facts.kv_replay, url) if events else ""
    if events.lower() == "none":
        events, replay = "", ""
    labels = dict(settings.labels)
    if len(facts.models) > 1:
        labels.setdefault("served_models", ",".join(facts.models))
    if facts.max_num_seqs > 0:
        # The control plane's TTFT prediction counts the engine's seats (prediction.seats_of);
        # an operator's --label max_num_seqs wins.
        labels.setdefault("max_num_seqs", str(facts.max_num_seqs))
    engine = pb.EngineFacts(
        block_size=facts.block_size, prefix_caching=facts.prefix_caching, hash_algo=facts.hash_algo,
        hash_seed=facts.hash_seed or "", hash_seed_set=facts.hash_seed is not None,
        kv_capacity_tokens=facts.kv_capacity_tokens, max_batched_tokens=facts.max_batched_tokens,
        kv_connector=facts.kv_connector, kv_role=facts.kv_role, engine_version=facts.engine_version)
    return pb.RegisterRequest(
        url=url, role=ROLES[role_for(settings, facts)], model=facts.models[0] if facts.models else "",
        weight=settings.weight, worker_id=settings.worker_id, labels=labels,
        heartbeat_ttl_s=settings.heartbeat_ttl_s, kv_events=events, kv_replay=replay or "",
        dp_size=max(facts.dp_size, 1), engine=engine)


_METRIC = re.compile(r"^(vllm:num_requests_(?:running|waiting))(?:\{[^}]*\})?\s+(\S+)", re.M)


def read_load(local_url: str, timeout: float = 2.0) -> tuple[int, int]:
    """(running, waiting) from the engine's /metrics, summed over engines; (-1, -1) unknown."""
    try:
        with urllib.request.urlopen(local_url + "/metrics", timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return -1, -1
    found: dict[str, float | None] = {"vllm:num_requests_running": None, "vllm:num_requests_waiting": None}
    for name, value in _METRIC.findall(text):
        try:
            found[name] = (found[name] or 0.0) + float(value)
        except ValueError:
            continue
    run, wait = found["vllm:num_requests_running"], found["vllm:num_requests_waiting"]
    return (-1 if run is None else int(run)), (-1 if wait is None else int(wait))


def engine_healthy(local_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(local_url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Agent:
    """Registers one engine and keeps it registered, on a daemon thread."""

    # Registration failed (no control plane answered, the id still held): the pause before the
    # next try, by failures in a row. Waited on the stop event, so only its delays are used.
    REGISTER_RETRY = Retry(attempts=sys.maxsize, base_s=0.5, max_s=30.0)

    def __init__(self, settings: Settings, facts: EngineFacts, *, refused_retry_s: float = 60.0,
                 load_reader=read_load) -> None:
        self.settings = settings
        self.facts = facts
        self.request = build_request(settings, facts)
        # Proves to the control plane that the worker id is ours (controlplane/ownership.py).
        self.owner_key = secrets.token_urlsafe(24)
        self.request.owner_key = self.owner_key
        self.refused_retry_s = refused_retry_s
        self.read_load = load_reader
        self.worker_id = ""
        self.interval_s = 2.0
        self.registrations = 0           # successful Register calls (tests, logs)
        self.heartbeats = 0
        self.last_error = ""
        self.refused = ""                # the control plane's message while it refuses us
        self._cp = 0                     # index into settings.controlplanes
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.RegistryStub | None = None
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._hb_failing = False
        self._lock = threading.Lock()    # one RPC at a time: the thread or stop()
        self._thread: threading.Thread | None = None
        self._metadata = (("authorization", f"Bearer {settings.token}"),) if settings.token else None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> Agent:
        self._thread = threading.Thread(target=self._run, name="omni-proxy-register", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 3.0) -> bool:
        """Deregister (if registered) and end the thread. True when a Deregister succeeded."""
        if self._stop.is_set():
            self._stopped.wait(timeout)           # another caller is deregistering: let it finish
            return False
        self._stop.set()
        try:
            return self._deregister(timeout)
        finally:
            self._stopped.set()

    def _deregister(self, timeout: float) -> bool:
        ok = False
        if self._lock.acquire(timeout=timeout):
            try:
                if self.worker_id and self._stub is not None:
                    try:
                        self._stub.Deregister(pb.DeregisterRequest(worker_id=self.worker_id,
                                                                   owner_key=self.owner_key),
                                              timeout=timeout, metadata=self._metadata)
                        ok = True
                        log.info("omni-proxy: deregistered worker %s from %s", self.worker_id, self._address)
                    except grpc.RpcError as exc:
                        log.warning("omni-proxy: deregister %s failed: %s", self.worker_id, _describe(exc))
                    self.worker_id = ""
                if self._channel is not None:
                    self._channel.close()
            finally:
                self._lock.release()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return ok

    # -- internals --------------------------------------------------------------------
    @property
    def _address(self) -> str:
        return self.settings.controlplanes[self._cp % len(self.settings.controlplanes)]

    def _connect(self) -> None:
        if self._channel is not None:
            self._channel.close()
        s = self.settings
        if s.tls_ca or s.tls_cert:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            creds = grpc.ssl_channel_credentials(root_certificates=read(s.tls_ca) if s.tls_ca else None,
                                                 private_key=read(s.tls_key) if s.tls_key else None,
                                                 certificate_chain=read(s.tls_cert) if s.tls_cert else None)
            self._channel = grpc.secure_channel(self._address, creds)
        else:
            self._channel = grpc.insecure_channel(self._address)
        self._stub = pb_grpc.RegistryStub(self._channel)

    def _next_cp(self) -> None:
        self._cp += 1
        self._connect()

    def _wait(self, seconds: float) -> bool:
        """Sleep; True when stopped meanwhile."""
        return self._stop.wait(seconds)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - never take the engine down
            log.exception("omni-proxy: registration agent failed; the engine keeps serving unregistered")

    def _loop(self) -> None:
        local = self.facts.local_url
        while not engine_healthy(local, self.settings.health_timeout_s):
            if self._wait(1.0):
                return
        with self._lock:
            if self._stop.is_set():
                return
            self._connect()
        failures = 0
        while not self._stop.is_set():
            if not self.worker_id:
                wait = self._register()
                if wait is None:
                    failures = 0
                    continue
                if wait == "backoff":
                    failures += 1
                    wait = self.REGISTER_RETRY.delay(failures)
                if self._wait(wait):
                    return
                continue
            if self._wait(self.interval_s):
                return
            self._heartbeat()

    def _register(self):
        """None on success; seconds to wait, or "backoff"."""
        with self._lock:
            if self._stop.is_set():
                return 0.0
            address = self._address
            try:
                resp = self._stub.Register(self.request, timeout=self.settings.rpc_timeout_s,
                                           metadata=self._metadata)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                self.last_error = _describe(exc)
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.PERMISSION_DENIED):
                    n = len(self.settings.controlplanes)
                    if self.refused != self.last_error:
                        log.error("omni-proxy: control plane %s REFUSED this engine (%s): %s; not registered%s",
                                  address, self.request.url, exc.details(),
                                  "" if n == 1 else ", trying the next address")
                    self.refused = self.last_error
                    # The next address at once; once every one has refused, every refused_retry_s.
                    self._next_cp()
                    return self.refused_retry_s if self._cp % n == 0 else 0.0
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("omni-proxy: control plane %s refused the token (OMNI_TOKEN): %s", address,
                              exc.details())
                else:
                    log.warning("omni-proxy: register with %s failed: %s; retrying", address, self.last_error)
                self._next_cp()
                return "backoff"
            self.worker_id = resp.worker_id
            if resp.owner_key and resp.owner_key != self.owner_key:   # an older control plane sends none
                self.owner_key = self.request.owner_key = resp.owner_key
            self.interval_s = resp.heartbeat_interval_s if resp.heartbeat_interval_s > 0 else 2.0
            self.registrations += 1
            self.refused = ""
            role = pb.Role.Name(self.request.role).lower().removeprefix("role_")
            log.info("omni-proxy: registered with %s as worker %s (%s, %s, model %s, block size %d, "
                     "KV capacity %d tokens), heartbeat every %.1f s", address, self.worker_id, self.request.url,
                     role, self.request.model, self.facts.block_size, self.facts.kv_capacity_tokens,
                     self.interval_s)
            return None

    def _heartbeat(self) -> None:
        running, waiting = self.read_load(self.facts.local_url)
        with self._lock:
            if self._stop.is_set() or not self.worker_id or self._stub is None:
                return
            try:
                resp = self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, running=running,
                                                                waiting=waiting, owner_key=self.owner_key),
                                            timeout=self.settings.rpc_timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                if getattr(exc, "code", lambda: None)() == grpc.StatusCode.PERMISSION_DENIED:
                    # The id is no longer ours (an operator removed it and another engine took it).
                    log.warning("omni-proxy: control plane %s refused our heartbeat for %s: %s; registering again",
                                self._address, self.worker_id, exc.details())
                    self.worker_id = ""
                    return
                # Keep the registration: the next heartbeat goes to the next address (replicas
                # share the fleet) and registers again only if that one answers known=false.
                self.last_error = _describe(exc)
                if not self._hb_failing:
                    log.warning("omni-proxy: heartbeat to %s failed: %s; trying the next control plane",
                                self._address, self.last_error)
                self._hb_failing = True
                self._next_cp()
                return
            if self._hb_failing:
                log.info("omni-proxy: heartbeats answered again by %s", self._address)
                self._hb_failing = False
            self.heartbeats += 1
            if not resp.known:
                log.warning("omni-proxy: control plane %s does not know worker %s (restarted?); registering again",
                            self._address, self.worker_id)
                self.worker_id = ""


def _describe(exc: grpc.RpcError) -> str:
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # noqa: BLE001
        return str(exc)
