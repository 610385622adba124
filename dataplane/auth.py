"""Client API keys for the data plane (``--api-keys FILE``).

The file holds one key per line, optionally ``name:key`` (the name appears in logs, the key
never); blank lines and ``#`` comments are skipped. It is re-read when its modification
time or size changes (checked at most once a second, on request). Clients send
``Authorization: Bearer <key>``, as with OpenAI; a missing or wrong key gets 401 with an
OpenAI error body. ``/health`` and ``/metrics`` stay open. The client's Authorization
header is never sent to the engines (they get ``--engine-api-key``), unless
``--forward-client-auth``.

A refused request is logged (INFO: the peer's address and why, never what it sent) and
counted (``omni_dp_auth_failures_total{reason}``). Logs name a client by :func:`key_id`:
its key's name, or a short hash of the token it sent; never the key.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import time

from dataplane.errors import error_response
from dataplane.messages import Request

log = logging.getLogger(__name__)

# Probes and scrapes stay open: a kubelet or Prometheus has no client key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/liveness", "/readiness", "/livez", "/readyz", "/version"})
# The client's Authorization header, set only with --forward-client-auth (dataplane.upstream reads it).
client_authorization: contextvars.ContextVar[str] = contextvars.ContextVar("client_authorization", default="")
RELOAD_CHECK_S = 1.0


def grpc_credentials(ca: str = "", cert: str = "", key: str = ""):
    """TLS to the control plane (PEM paths; mutual TLS with cert and key), or None: plaintext."""
    if not (ca or cert or key):
        return None
    import grpc

    from omni_runtime import StartupError

    def read(path: str, flag: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise StartupError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None

    if bool(cert) != bool(key):
        raise StartupError("--controlplane-tls-cert and --controlplane-tls-key go together")
    return grpc.ssl_channel_credentials(root_certificates=read(ca, "--controlplane-tls-ca"),
                                        private_key=read(key, "--controlplane-tls-key"),
                                        certificate_chain=read(cert, "--controlplane-tls-cert"))


def ssl_context(ca: str = "", cert: str = "", key: str = ""):
    """The same TLS as :func:`grpc_credentials`, for the control plane's session socket.

    Called after :func:`grpc_credentials`, which has already refused unreadable files."""
    if not (ca or cert or key):
        return None
    import ssl

    ctx = ssl.create_default_context(cafile=ca or None)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def parse_keys(text: str, where: str = "api keys") -> dict[str, str]:
    """key -> name."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, key = line.rpartition(":")
        if not sep:
            name, key = f"key{n}", line
        key, name = key.strip(), name.strip() or f"key{n}"
        if not key or any(c.isspace() for c in key):
            log.error("%s line %d: skipped (a key has no spaces)", where, n)
            continue
        out[key] = name
    return out


class ApiKeys:
    def __init__(self, path: str) -> None:
        self.path = path
        self._keys: dict[str, str] = {}
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self.reload(force=True)

    def reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp and not force:
                return
            with open(self.path) as f:
                keys = parse_keys(f.read(), self.path)
        except OSError as exc:
            if force and self._stamp is None:
                from omni_runtime import StartupError

                raise StartupError(f"--api-keys: cannot read {self.path}: {exc.strerror or exc}") from None
            log.error("--api-keys %s: not re-read (%s); the keys read before stay", self.path, exc.strerror or exc)
            return
        self._stamp = stamp
        if self._keys and keys != self._keys:
            log.info("--api-keys %s: reloaded, %d keys", self.path, len(keys))
        self._keys = keys

    def who(self, presented: str) -> str | None:
        self.reload()
        found = None
        raw = presented.encode()
        for key, name in self._keys.items():
            if hmac.compare_digest(raw, key.encode()):
                found = name
        return found


def presented_key(request: Request) -> str:
    value = request.headers.get("Authorization", "")
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_id(request: Request) -> str | None:
    """The client's key, as logs may name it: the name ``--api-keys`` gives it (set by the
    middleware once checked), else ``key-<12 hex>`` (a SHA-256 prefix of the Authorization
    header it sent), else None. Never the key itself."""
    name = request.get("api_key_name")
    if name:
        return name
    authorization = request.headers.get("Authorization")
    if authorization:
        return "key-" + hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return None


def middleware(keys: ApiKeys | None, forward: bool = False, failures=None):
    """``failures``: a Prometheus counter labelled by ``reason`` (missing, invalid), or None."""
    async def require_key(request: Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        if forward:
            client_authorization.set(request.headers.get("Authorization", ""))
        if keys is None:
            return await handler(request)
        presented = presented_key(request)
        name = keys.who(presented) if presented else None
        if name is None:
            reason = "invalid" if presented else "missing"
            if failures is not None:
                failures.labels(reason).inc()
            log.info("401 %s %s from %s: %s API key (client %s)", request.method, request.path[:200],
                     request.remote or "unknown", reason, key_id(request) or "without Authorization")
            return error_response(401, "missing or invalid API key: send Authorization: Bearer <key>",
                                  headers={"WWW-Authenticate": "Bearer"})
        request["api_key_name"] = name
        return await handler(request)

    return require_key
