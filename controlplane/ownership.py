"""Who may register, heartbeat and deregister a worker id: the engine that registered it.

The Registry service (engine plugins, ``registry`` tokens) and the Admin service (operators,
``admin`` tokens) are different powers. Before this check a registry token could
``Register`` a configured worker's id with another URL (its traffic went there),
``Deregister`` it, or ``Heartbeat`` a made-up load for it. Now:

* Workers that came from the config, an operator (``omni-ctl add``) or the discovery file
  change only through admin calls and the file: every Registry call for their id is refused
  with ``PERMISSION_DENIED``.
* A registered worker belongs to its first registration: the token it was made with (its
  name, when registry tokens are configured) and an *owner key*, a secret the engine sends
  (or the control plane makes, when none is sent) and gets back in ``RegisterResponse``. The
  spec keeps the key's SHA-256, so it is shared by every replica through the state store.
  Registering the id again, heartbeats and deregistration need the same key and token:
  another registration is refused with ``ALREADY_EXISTS`` (the id is freed when its owner
  deregisters, when its heartbeats stop for the worker's TTL, or by ``omni-ctl remove``),
  a heartbeat or deregistration with ``PERMISSION_DENIED``.

The engine plugin keeps one key for its life, so it registers its own id again after a
control-plane restart (the new one knows nothing, or knows the key from the shared store).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import grpc

from controlplane.workers import WorkerSpec

REGISTRY_SOURCE = "registry"
MAX_KEY_LEN = 256


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str


def new_key() -> str:
    return secrets.token_urlsafe(24)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_key(key: str) -> str:
    """The key as sent, or ValueError (never echoes it)."""
    if len(key) > MAX_KEY_LEN or any(ord(c) < 33 or ord(c) == 127 for c in key):
        raise ValueError(f"owner_key must be at most {MAX_KEY_LEN} printable characters without spaces")
    return key


def _owned(spec: WorkerSpec, key: str, principal: str) -> bool:
    return (bool(key) and hmac.compare_digest(key_hash(key), spec.owner_key)
            and hmac.compare_digest(principal.encode(), spec.owner.encode()))


def _not_registered(spec: WorkerSpec, what: str) -> Refusal:
    return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                   f"worker {spec.id} comes from {spec.source}, not from a registration: {what} is refused; "
                   f"it changes only through admin calls (omni-ctl)")


def may_register(existing: WorkerSpec | None, key: str, principal: str, url: str) -> Refusal | None:
    """None: this registration may create or overwrite ``existing``."""
    if existing is None:
        return None
    if existing.source != REGISTRY_SOURCE:
        return _not_registered(existing, "registering its id")
    if not existing.owner_key:
        # Registered before owner keys existed (an older replica): the same engine may claim it.
        return None if existing.url == url and existing.owner == principal else \
            Refusal(grpc.StatusCode.ALREADY_EXISTS, _held(existing))
    if _owned(existing, key, principal):
        return None
    return Refusal(grpc.StatusCode.ALREADY_EXISTS, _held(existing))


def may_change(existing: WorkerSpec, key: str, principal: str, what: str) -> Refusal | None:
    """None: this heartbeat or deregistration comes from ``existing``'s owner."""
    if existing.source != REGISTRY_SOURCE:
        return _not_registered(existing, what)
    if not existing.owner_key or _owned(existing, key, principal):
        return None
    return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                   f"worker {existing.id} is registered by another engine: {what} needs the owner key its "
                   f"registration returned{' and its token' if existing.owner else ''}")


def _held(spec: WorkerSpec) -> str:
    ttl = f", when its heartbeats stop for {spec.heartbeat_ttl_s:g}s" if spec.heartbeat_ttl_s > 0 else ""
    return (f"worker id {spec.id} is registered by another engine ({spec.url}): it is freed when that "
            f"engine deregisters{ttl}, or by an operator (omni-ctl remove)")
