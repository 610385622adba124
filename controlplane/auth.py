"""Tokens for the control plane's gRPC API, checked by a server interceptor.

Three scopes, each off until it has a token:

* ``admin``: the Admin service (omni-ctl). Admin tokens are also accepted everywhere else.
* ``registry``: Register / Heartbeat / Deregister (engine plugins). When admin tokens are
  configured and registry tokens are not, registration needs an admin token: an open
  registry would let anyone add a worker to a fleet whose admin API is closed.
* ``dataplane``: the Scheduler service (data-plane sessions). Open unless
  ``dataplane_tokens`` is configured.

Clients send ``authorization: Bearer <token>`` metadata. A call without a valid token gets
``UNAUTHENTICATED`` before its handler runs, so it changes nothing. Tokens are never
logged; a token's *name* (``name:token`` in the config, the tokens file or the
environment) is what audit lines show.

Sources, merged: ``[auth] admin_tokens / registry_tokens / dataplane_tokens`` (a list of
``"token"`` or ``"name:token"`` strings, or a table ``{name = "token"}``), ``[auth]
tokens_file`` (lines ``SCOPE NAME TOKEN``; ``#`` comments), and the environment
(``OMNI_ADMIN_TOKENS``, ``OMNI_REGISTRY_TOKENS``, ``OMNI_DATAPLANE_TOKENS``: comma-separated
``token`` or ``name:token``).
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

SCOPES = ("admin", "registry", "dataplane")
ENV_VARS = {"admin": "OMNI_ADMIN_TOKENS", "registry": "OMNI_REGISTRY_TOKENS", "dataplane": "OMNI_DATAPLANE_TOKENS"}
SERVICE_SCOPES = {"omni_proxy.v1.Admin": "admin", "omni_proxy.v1.Registry": "registry",
                  "omni_proxy.v1.Scheduler": "dataplane"}
MAX_TOKEN_LEN = 4096

# The caller of the RPC being served: the token's name ("" when auth is off for that scope).
principal: contextvars.ContextVar[str] = contextvars.ContextVar("omni_principal", default="")


def _check_token(token: Any, where: str) -> str:
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LEN or \
            any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in token):
        # never echo the value: it may be a real token with a typo
        raise ValueError(f"{where} must be a token of 1-{MAX_TOKEN_LEN} printable characters without spaces")
    return token


def _name_token(item: str, where: str, index: int) -> tuple[str, str]:
    name, sep, token = item.partition(":")
    if not sep:
        name, token = f"token{index + 1}", item
    name = name.strip()
    if not name or len(name) > 128:
        raise ValueError(f"{where}: a token's name must be 1-128 characters")
    return name, _check_token(token.strip(), where)


def parse_tokens(value: Any, where: str) -> dict[str, str]:
    """``["tok", "name:tok"]`` or ``{name = "tok"}`` -> {name: token}."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        value = [p for p in value.split(",") if p.strip()]
    if isinstance(value, dict):
        out = {}
        for name, token in value.items():
            if not isinstance(name, str) or not name or len(name) > 128:
                raise ValueError(f"{where}: token names must be strings of 1-128 characters")
            out[name] = _check_token(token, f"{where}.{name}")
        return out
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of \"token\" or \"name:token\" strings, or a table name = token")
    out = {}
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ValueError(f"{where}[{i}] must be a string")
        name, token = _name_token(item.strip(), f"{where}[{i}]", i)
        out[name] = token
    return out


def read_tokens_file(path: str) -> dict[str, dict[str, str]]:
    """Lines ``SCOPE NAME TOKEN`` (scope: admin, registry or dataplane); ``#`` starts a comment."""
    out: dict[str, dict[str, str]] = {s: {} for s in SCOPES}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"auth.tokens_file: cannot read {path}: {exc.strerror or exc}") from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{path}:{n}"
        if len(parts) != 3 or parts[0] not in SCOPES:
            raise ValueError(f"{where}: expected SCOPE NAME TOKEN with SCOPE one of {', '.join(SCOPES)}")
        out[parts[0]][parts[1]] = _check_token(parts[2], where)
    return out


@dataclass
class AuthConfig:
    admin_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    registry_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    dataplane_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    tokens_file: str = ""
    # TLS on the gRPC port (PEM files); with tls_client_ca, clients must present a certificate
    # it signed (mutual TLS), on top of any tokens.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    def resolved(self, environ: dict[str, str] | None = None) -> Tokens:
        """Config, tokens file and environment merged (ValueError on a bad file or variable)."""
        env = os.environ if environ is None else environ
        scopes = {"admin": dict(self.admin_tokens), "registry": dict(self.registry_tokens),
                  "dataplane": dict(self.dataplane_tokens)}
        if self.tokens_file:
            for scope, tokens in read_tokens_file(self.tokens_file).items():
                scopes[scope].update(tokens)
        for scope, var in ENV_VARS.items():
            if env.get(var):
                scopes[scope].update(parse_tokens(env[var], f"${var}"))
        return Tokens(scopes)


def _read_pem(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"auth.{name}: cannot read {path}: {exc.strerror or exc}") from None


def server_credentials(cfg: AuthConfig) -> grpc.ServerCredentials | None:
    """TLS (and mutual TLS with ``tls_client_ca``) for the gRPC port; None: plaintext."""
    if not (cfg.tls_cert or cfg.tls_key or cfg.tls_client_ca):
        return None
    if not (cfg.tls_cert and cfg.tls_key):
        raise ValueError("auth.tls_cert and auth.tls_key go together (and tls_client_ca needs both)")
    cert, key = _read_pem(cfg.tls_cert, "tls_cert"), _read_pem(cfg.tls_key, "tls_key")
    ca = _read_pem(cfg.tls_client_ca, "tls_client_ca") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def server_ssl_context(cfg: AuthConfig) -> ssl.SSLContext | None:
    """The same TLS as :func:`server_credentials`, for the session socket; None: plaintext."""
    if server_credentials(cfg) is None:   # the same checks and messages
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_client_ca:
        ctx.load_verify_locations(cfg.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """A client's side of :func:`server_credentials` (PEM file paths; ca empty: the system roots)."""
    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    if bool(cert) != bool(key):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))


class Tokens:
    """Who may call which service."""

    def __init__(self, scopes: dict[str, dict[str, str]]) -> None:
        self.scopes = {s: dict(scopes.get(s, {})) for s in SCOPES}

    @property
    def enabled(self) -> bool:
        return any(self.scopes.values())

    def required(self, scope: str) -> bool:
        if scope == "registry":
            return bool(self.scopes["registry"] or self.scopes["admin"])
        return bool(self.scopes[scope])

    def accepted(self, scope: str) -> dict[str, str]:
        """Name -> token of every token valid for ``scope`` (admin tokens are valid for all)."""
        out = dict(self.scopes[scope])
        if scope != "admin":
            out.update({f"{n}": t for n, t in self.scopes["admin"].items() if n not in out})
        return out

    def who(self, scope: str, presented: str) -> str | None:
        """The name of the token ``presented`` for ``scope``, or None. Compares in constant time."""
        found = None
        raw = presented.encode()
        for name, token in self.accepted(scope).items():
            if hmac.compare_digest(raw, token.encode()):
                found = name
        return found

    def describe(self) -> str:
        return ", ".join(f"{s}: {len(self.accepted(s))} token(s)" if self.required(s) else f"{s}: open"
                         for s in SCOPES)


def bearer(metadata) -> str:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _deny_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request.

    gRPC reads a unary request whole before it runs a unary handler: a refusal served as one
    would first take in whatever the caller sent (8 calls of 58 MiB without a token took a
    control plane from 62 to 880 MB). As a stream-request handler that never iterates its
    requests, nothing of the message is asked for; the caller gets its status at once. The
    wire format is the same for every kind, so the caller sees only UNAUTHENTICATED."""
    async def deny(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.unary_unary or handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


def _as_principal(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """The same handler, run with :data:`principal` set (unary calls; what admin audit reads)."""
    if not handler.unary_unary:
        return handler
    inner = handler.unary_unary

    async def call(request, context):
        principal.set(name)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to a service whose scope needs a token when none (or a wrong one) is sent."""

    LOG_EVERY_S = 10.0

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens
        self.refused = 0
        self._logged: dict[tuple[str, bool], tuple[float, int]] = {}   # (method, had token) -> (when, suppressed)

    def _log_refusal(self, method: str, peer_had_token: bool) -> None:
        """One WARNING per method and reason every 10 s (a data plane retrying without a token
        would otherwise write one line per attempt)."""
        key = (method, peer_had_token)
        now = time.monotonic()
        last, suppressed = self._logged.get(key, (0.0, 0))
        if last and now - last < self.LOG_EVERY_S:
            self._logged[key] = (last, suppressed + 1)
            return
        self._logged[key] = (now, 0)
        log.warning("refused %s: %s%s", method, "a wrong token" if peer_had_token else "no token",
                    f" ({suppressed} more since the last line)" if suppressed else "")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method or ""
        service = method.lstrip("/").split("/", 1)[0]
        scope = SERVICE_SCOPES.get(service)
        if scope is None or not self.tokens.required(scope):
            return handler
        name = self.who(scope, bearer(handler_call_details.invocation_metadata), method)
        if name is None:
            return _deny_handler(handler, f"{scope} calls need a valid token "
                                          f"(authorization: Bearer <token>)")
        return _as_principal(handler, name)

    def who(self, scope: str, presented: str, method: str) -> str | None:
        """The name of the token ``presented`` for ``scope`` ("" when the scope is open), or
        None: refused, counted and logged (rate-limited). The session socket asks here too."""
        if not self.tokens.required(scope):
            return ""
        name = self.tokens.who(scope, presented) if presented else None
        if name is None:
            self.refused += 1
            self._log_refusal(method, bool(presented))
        return name


def caller(context) -> str:
    """Who made this call, for audit lines: the peer address and the token's name if any."""
    try:
        peer = context.peer() or "?"
    except Exception:   # noqa: BLE001 - an audit line must never fail the call
        peer = "?"
    name = principal.get()
    who = [f"token {name}"] if name else []
    try:
        cn = (context.auth_context() or {}).get("x509_common_name")
        if cn:
            who.append(f"cert {cn[0].decode('utf-8', 'replace')}")
    except Exception:  # noqa: BLE001
        pass
    return f"{peer} ({', '.join(who)})" if who else peer
