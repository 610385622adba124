"""Prefill/decode roles: which KV-transfer flow a request takes, and vLLM's NIXL pull flow.

``plan_kv`` reads a request and decides its flow on this node:

* pull (vLLM NixlConnector, sequential P then D): below;
* bootstrap (SGLang rooms, vLLM MooncakeConnector; parallel P and D): ``bootstrap``;
* layerwise push (vllm-ascend MooncakeLayerwiseConnector; D first): ``layerwise``.

Pull flow:

A prefill node (kv_producer) asked for ``do_remote_decode`` keeps the prompt's KV blocks
after answering and hands the decode node a ``kv_transfer_params`` ticket. A decode node
(kv_consumer) given a valid ticket pulls the KV from the prefill node instead of computing
the prompt; an invalid ticket or a failed pull falls back to local prefill, as vLLM does.
The pull itself goes over the sim's HTTP port (``POST /sim/kv/pull``) so that the prefill
node really frees its blocks when, and only when, a decode node takes them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from simulator.bootstrap import BootstrapRooms, BootstrapSource, RoomOffer, room_key
from simulator.config import Role, SimConfig
from simulator.engine import Engine, HeldKv, SimRequest
from simulator.layerwise import PushTarget
from simulator.protocol import ApiError

log = logging.getLogger(__name__)

_PULL_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True)
class PullTarget:
    """Where a decode node fetches a prompt's KV from."""

    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[Any]

    @property
    def url(self) -> str:
        return f"http://{self.remote_host}:{self.remote_port}/sim/kv/pull"


@dataclass(frozen=True)
class KvPlan:
    """What this request does with KV transfer on this node (at most one flow is set)."""

    # Prefill side.
    produce: bool = False                  # pull flow: keep a lease, return a NIXL ticket
    lease_room: str | None = None          # ... also reachable by Mooncake bootstrap fetch as this room
    bootstrap_room: str | None = None      # SGLang: offer the room, answer once D took it
    push: tuple[PushTarget, ...] = ()      # layerwise: push the KV to these decode tickets
    # Decode side.
    pull: PullTarget | None = None         # pull flow: NIXL ticket from P's response
    fetch: BootstrapSource | None = None   # bootstrap flow: long-poll P's bootstrap port
    metaserver: str | None = None          # layerwise: post our ticket here, then wait for the push

    @property
    def prefill_only(self) -> bool:
        """This node computes the prompt and samples one token for a decode node."""
        return self.produce or self.bootstrap_room is not None or bool(self.push)


def plan_kv(role: Role, params: dict[str, Any] | None, request_id: str, body: dict[str, Any] | None = None,
            base_id: str = "") -> KvPlan:
    """Decide the request's flow; ApiError (400) for fields no engine would accept.

    ``request_id`` is the engine-side id (``cmpl-<base>-0`` / ``chatcmpl-<base>``), ``base_id``
    the X-Request-Id, ``body`` the request (SGLang puts its bootstrap fields at top level).
    """
    body = body or {}
    if role == "prefill":
        if body.get("bootstrap_room") is not None:
            return KvPlan(bootstrap_room=room_key(_single(body, "bootstrap_room", (int, str))))
        if params and params.get("do_remote_decode"):
            if params.get("remote_host") is not None and params.get("remote_port") is not None:
                return KvPlan(push=_push_targets(params, request_id))
            return KvPlan(produce=True, lease_room=room_key(params.get("transfer_id") or base_id))
        return KvPlan()
    if role == "decode":
        if params and params.get("do_remote_prefill"):
            if params.get("metaserver") is not None:
                url = params["metaserver"]
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ApiError(400, "kv_transfer_params.metaserver must be an http(s) URL",
                                   "kv_transfer_params")
                return KvPlan(metaserver=url)
            if "bootstrap_server_host" in params:
                host, port = params.get("bootstrap_server_host"), params.get("bootstrap_server_port")
                if not isinstance(host, str) or not host or type(port) is not int:
                    log.warning("Got invalid KVTransferParams for %s: %s (bootstrap_server_host/port). "
                                "This request will not utilize KVTransfer.", request_id, params)
                    return KvPlan()
                return KvPlan(fetch=BootstrapSource(host, port, params.get("transfer_id") or base_id))
            target = _pull_target(params)
            if target is None:
                log.warning("Got invalid KVTransferParams for %s: %s. This request will not utilize "
                            "KVTransfer and will recompute the prompt locally.", request_id, params)
                return KvPlan()
            return KvPlan(pull=target)
        if body.get("bootstrap_room") is not None or body.get("bootstrap_host") is not None:
            room = _single(body, "bootstrap_room", (int, str))
            host = _single(body, "bootstrap_host", (str,))
            port = _single(body, "bootstrap_port", (int,))
            return KvPlan(fetch=BootstrapSource(host, port, room))
        return KvPlan()
    return KvPlan()


def _single(body: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    """A SGLang bootstrap field: a value, or a list of one (a batch of one prompt)."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != 1:
            raise ApiError(400, f"The simulator serves one prompt per request; {name} has "
                                f"{len(value)} entries.", name)
        value = value[0]
    if value is None:
        raise ApiError(400, f"{name} is required for a bootstrap (parallel) prefill/decode request", name)
    if isinstance(value, bool) or not isinstance(value, types):
        want = " or ".join(t.__name__ for t in types)
        raise ApiError(400, f"{name} must be {want}", name)
    return value


def _push_targets(params: dict[str, Any], request_id: str) -> tuple[PushTarget, ...]:
    """Layerwise P: D's ticket, or one per child in ``batch_kv_transfer_params``."""
    batch = params.get("batch_kv_transfer_params")
    if batch is None:
        return (_push_target(params, request_id),)
    if not isinstance(batch, dict) or not batch:
        raise ApiError(400, "kv_transfer_params.batch_kv_transfer_params must be a non-empty object "
                            "{child_request_id: kv_transfer_params}", "kv_transfer_params")
    targets = []
    for child_id, child in batch.items():
        if not isinstance(child, dict):
            raise ApiError(400, f"batch_kv_transfer_params[{child_id!r}] must be an object", "kv_transfer_params")
        targets.append(_push_target(child, child_id))
    return tuple(targets)


def _push_target(params: dict[str, Any], default_id: str) -> PushTarget:
    host, port, engine = params.get("remote_host"), params.get("remote_port"), params.get("remote_engine_id")
    rid = params.get("request_id") or default_id
    if not isinstance(host, str) or not host or type(port) is not int or not isinstance(engine, str) \
            or not isinstance(rid, str):
        raise ApiError(400, "a layerwise (push) prefill needs kv_transfer_params with string remote_host, "
                            "int remote_port, string remote_engine_id and string request_id",
                       "kv_transfer_params")
    return PushTarget(request_id=rid, remote_engine_id=engine, remote_host=host, remote_port=port)


def _pull_target(params: dict[str, Any]) -> PullTarget | None:
    if any(params.get(name) is None for name in _PULL_FIELDS):
        return None
    port = params["remote_port"]
    if type(port) is not int or not isinstance(params["remote_block_ids"], list):
        return None
    if not all(isinstance(params[n], str) for n in ("remote_engine_id", "remote_request_id", "remote_host")):
        return None
    return PullTarget(remote_request_id=params["remote_request_id"],
                      remote_engine_id=params["remote_engine_id"], remote_host=params["remote_host"],
                      remote_port=port, remote_block_ids=params["remote_block_ids"])


@dataclass
class KvLease:
    remote_request_id: str
    block_ids: list[int]
    num_tokens: int
    held: HeldKv | None = field(default=None, repr=False)
    # The prefill's prefix-cache hits (vLLM adds them to the ticket so D can report them).
    cached_tokens: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    offer: RoomOffer | None = field(default=None, repr=False)


@dataclass
class LeaseCounters:
    created: int = 0
    pulled: int = 0
    expired: int = 0


class KvLeaseTable:
    """KV blocks a prefill node keeps for decode nodes, each for at most ``lease_s``."""

    def __init__(self, engine: Engine, lease_s: float, rooms: BootstrapRooms | None = None) -> None:
        self._engine = engine
        self._lease_s = lease_s
        self._rooms = rooms
        self._leases: dict[str, KvLease] = {}
        self.counters = LeaseCounters()

    def __len__(self) -> int:
        return len(self._leases)

    def ids(self) -> list[str]:
        return list(self._leases)

    def get(self, remote_request_id: str) -> KvLease | None:
        return self._leases.get(remote_request_id)

    def hold(self, req: SimRequest, held: HeldKv, room: str | None = None) -> None:
        """Engine hook: ``req`` finished its prefill and hands its blocks to a lease.

        With ``room`` the lease is also offered as that bootstrap room, so a MooncakeConnector
        decode node can fetch it by request id instead of by NIXL ticket.
        """
        rid = req.request_id
        self._drop(rid)  # a reused request id replaces the old lease
        lease = KvLease(rid, held.block_ids, req.prompt_tokens, held=held, cached_tokens=req.cached_tokens)
        lease.timer = asyncio.get_running_loop().call_later(self._lease_s, self._expire, rid, lease)
        if room is not None and self._rooms is not None:
            lease.offer = self._rooms.offer(room, lease.num_tokens, lease.block_ids, lambda: self.take(rid))
        self._leases[rid] = lease
        self.counters.created += 1

    def take(self, remote_request_id: str) -> KvLease | None:
        """A decode node pulled the KV: free the blocks now."""
        lease = self._drop(remote_request_id)
        if lease is not None:
            self.counters.pulled += 1
        return lease

    def clear(self) -> None:
        for rid in list(self._leases):
            self._drop(rid)

    def _expire(self, remote_request_id: str, lease: KvLease) -> None:
        if self._leases.get(remote_request_id) is lease:
            self._drop(remote_request_id)
            self.counters.expired += 1
            log.info("KV lease for %s expired after %.1fs without a pull", remote_request_id, self._lease_s)

    def _drop(self, remote_request_id: str) -> KvLease | None:
        lease = self._leases.pop(remote_request_id, None)
        if lease is not None:
            if lease.timer is not None:
                lease.timer.cancel()
            if lease.offer is not None and self._rooms is not None:
                self._rooms.withdraw(lease.offer)
            if lease.held is not None:
                self._engine.release_held(lease.held)
        return lease


def producer_params(cfg: SimConfig, port: int, lease: KvLease) -> dict[str, Any]:
    """The ticket a prefill node returns, in NixlConnector's field names."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": lease.block_ids,
        "remote_engine_id": cfg.engine_id,
        "remote_request_id": lease.remote_request_id,
        "remote_host": cfg.advertised_host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": lease.num_tokens,
        "remote_prefill_cached_tokens": lease.cached_tokens,
    }


@dataclass
class PullCounters:
    ok: int = 0
    failed: int = 0


async def pull_kv(session: aiohttp.ClientSession, target: PullTarget, request_id: str) -> int | None:
    """Ask the prefill node for the KV; returns the token count it held, or None to recompute."""
    body = {"remote_request_id": target.remote_request_id, "remote_engine_id": target.remote_engine_id}
    try:
        async with session.post(target.url, json=body) as resp:
            if resp.status == 200:
                data = await resp.json()
                return int(data["num_tokens"])
            log.warning("KV pull for %s from %s got HTTP %d; recomputing the prompt locally",
                        request_id, target.url, resp.status)
    except (TimeoutError, aiohttp.ClientError, KeyError, ValueError, TypeError) as exc:
        log.warning("KV pull for %s from %s failed (%r); recomputing the prompt locally",
                    request_id, target.url, exc)
    return None
