"""Prefill/decode roles, following vLLM's NixlConnector pull protocol.

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

from simulator.config import Role, SimConfig
from simulator.engine import Engine, SimRequest

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
    """What this request does with KV transfer on this node."""

    produce: bool = False
    pull: PullTarget | None = None


def plan_kv(role: Role, params: dict[str, Any] | None, request_id: str) -> KvPlan:
    if not params:
        return KvPlan()
    if role == "prefill" and params.get("do_remote_decode"):
        return KvPlan(produce=True)
    if role == "decode" and params.get("do_remote_prefill"):
        target = _pull_target(params)
        if target is None:
            log.warning("Got invalid KVTransferParams for %s: %s. This request will not utilize "
                        "KVTransfer and will recompute the prompt locally.", request_id, params)
            return KvPlan()
        return KvPlan(pull=target)
    return KvPlan()


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
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass
class LeaseCounters:
    created: int = 0
    pulled: int = 0
    expired: int = 0


class KvLeaseTable:
    """KV blocks a prefill node keeps for decode nodes, each for at most ``lease_s``."""

    def __init__(self, engine: Engine, lease_s: float) -> None:
        self._engine = engine
        self._lease_s = lease_s
        self._leases: dict[str, KvLease] = {}
        self.counters = LeaseCounters()

    def __len__(self) -> int:
        return len(self._leases)

    def ids(self) -> list[str]:
        return list(self._leases)

    def get(self, remote_request_id: str) -> KvLease | None:
        return self._leases.get(remote_request_id)

    def hold(self, req: SimRequest, blocks: int) -> None:
        """Engine hook: ``req`` finished its prefill and hands its blocks to a lease."""
        self._drop(req.request_id)  # a reused request id replaces the old lease
        lease = KvLease(req.request_id, self._engine.block_ids(blocks), req.prompt_tokens)
        lease.timer = asyncio.get_running_loop().call_later(self._lease_s, self._expire, req.request_id, lease)
        self._leases[req.request_id] = lease
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
            self._engine.release_held_blocks(len(lease.block_ids))
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
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError, TypeError) as exc:
        log.warning("KV pull for %s from %s failed (%r); recomputing the prompt locally",
                    request_id, target.url, exc)
    return None
