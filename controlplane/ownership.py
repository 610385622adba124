"""Who may register, heartbeat and deregister a worker id: the engine that registered it.

The Registry service (engine plugins, ``registry`` tokens) and the Admin service (operators,
``admin`` tokens) are different powers. Before this check a registry token could
``Register`` a configured worker's id with another URL (its traffic went there),
``Deregister`` it, or ``Heartbeat`` a made-up load for it. Now:

* Workers that came from the config, an operator (``omni-ctl add``) or the discovery file
  change only through admin calls and the file: every Registry call for their id is refused
  with ``PERMISSION_DENIED``.
* A registered worker belongs to its first registration: the token it was made with (its
  name, when registry tokens are configured) and the *owner key* the engine sent with it (a
  secret; ``RegisterResponse.owner_key`` echoes it). The spec keeps the key's SHA-256, so
  every replica knows it through the state store. Registering the id again, heartbeats and
  deregistration need the same token and key: another registration is refused with
  ``ALREADY_EXISTS`` (the id is freed when its owner deregisters, when its heartbeats stop
  for the worker's TTL, or by ``omni-ctl remove``), a heartbeat or deregistration with
  ``PERMISSION_DENIED``.
* A registration without a key (an engine plugin older than owner keys) is bound to its
  token alone: calls with that token may heartbeat and deregister it, and register it again
  at the same URL. So is a spec written before owner keys existed, whose owner is unknown.

The engine plugin makes one key for its life, so it registers its own id again after a
control-plane restart (the new one knows nothing, or knows the key from the shared store),
and engines sharing one registry token cannot touch each other's ids.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import grpc

from controlplane.workers import WorkerSpec

REGISTRY_SOURCE = "registry"
MAX_KEY_LEN = 256


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_key(key: str) -> str:
    """The key as sent, or ValueError (never echoes it)."""
    if len(key) > MAX_KEY_LEN or any(ord(c) < 33 or ord(c) == 127 for c in key):
        raise ValueError(f"owner_key must be at most {MAX_KEY_LEN} printable characters without spaces")
    return key


def _owned(spec: WorkerSpec, key: str, principal: str) -> bool:
    """Whether a call with ``key`` and the token named ``principal`` is ``spec``'s owner."""
    if not spec.owner_key:       # registered without a key: bound to its token (if known)
        return not spec.owner or hmac.compare_digest(principal.encode(), spec.owner.encode())
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
    if _owned(existing, key, principal) and (existing.owner_key or existing.url == url):
        return None              # (keyless: only the same engine, at the same URL, again)
    return Refusal(grpc.StatusCode.ALREADY_EXISTS, _held(existing))


def may_change(existing: WorkerSpec, key: str, principal: str, what: str) -> Refusal | None:
    """None: this heartbeat or deregistration comes from ``existing``'s owner."""
    if existing.source != REGISTRY_SOURCE:
        return _not_registered(existing, what)
    if _owned(existing, key, principal):
        return None
    needs = "the owner key its registration sent" if existing.owner_key else ""
    if existing.owner:
        needs = f"{needs} and its token" if needs else "the token it registered with"
    return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                   f"worker {existing.id} is registered by another engine: {what} needs {needs}")


def _held(spec: WorkerSpec) -> str:
    ttl = f", when its heartbeats stop for {spec.heartbeat_ttl_s:g}s" if spec.heartbeat_ttl_s > 0 else ""
    return (f"worker id {spec.id} is registered by another engine ({spec.url}): it is freed when that "
            f"engine deregisters{ttl}, or by an operator (omni-ctl remove)")
