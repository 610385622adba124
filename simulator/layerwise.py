"""Layerwise push prefill/decode, "D first" (vllm-ascend MooncakeLayerwiseConnector).

The proxy sends the request to D first with ``kv_transfer_params = {"do_remote_prefill":
true, "metaserver": URL}``. D allocates blocks and POSTs its receive ticket to the
metaserver (the proxy), which sends the prefill to a P with that ticket as
``kv_transfer_params`` and answers D ``{"status": "ok"}`` once P is done. P pushes the KV
into D while it prefills; in the sim the push is one ``POST /sim/kv/push`` to D after the
prefill, before P answers. D decodes once the push arrived and the metaserver said ok.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from simulator.protocol import KvTransferError

log = logging.getLogger(__name__)

METASERVER_TRIES = 3  # vllm-ascend's _access_metaserver tries three times


@dataclass(frozen=True)
class PushTarget:
    """A decode node's receive ticket, as P finds it in kv_transfer_params."""

    request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int

    @property
    def url(self) -> str:
        host = self.remote_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.remote_port}/sim/kv/push"


@dataclass
class PushWait:
    """A decode request waiting for its KV to be pushed."""

    request_id: str
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    num_tokens: int | None = None


@dataclass
class LayerwiseCounters:
    metaserver_calls_ok: int = 0
    metaserver_calls_failed: int = 0
    pushes_received: int = 0   # D: pushes that matched a waiting request
    pushes_rejected: int = 0   # D: pushes answered 404/409
    pushes_sent: int = 0       # P: pushes D accepted
    pushes_failed: int = 0     # P: pushes that failed (the prefill got an error)


class PushTable:
    """A decode node's requests waiting for pushed KV, by the request id it told the metaserver."""

    def __init__(self) -> None:
        self._waits: dict[str, PushWait] = {}
        self.counters = LayerwiseCounters()

    def __len__(self) -> int:
        return len(self._waits)

    def expect(self, request_id: str) -> PushWait | None:
        """Register a wait; None if a request with that id is already waiting."""
        if request_id in self._waits:
            return None
        wait = PushWait(request_id)
        self._waits[request_id] = wait
        return wait

    def forget(self, wait: PushWait) -> None:
        if self._waits.get(wait.request_id) is wait:
            del self._waits[wait.request_id]

    def deliver(self, request_id: str, num_tokens: int) -> tuple[int, str]:
        """A prefill node pushed KV; returns (HTTP status, message)."""
        wait = self._waits.get(request_id)
        if wait is None:
            self.counters.pushes_rejected += 1
            return 404, f"no request {request_id!r} is waiting for pushed KV here"
        if wait.num_tokens is not None:
            self.counters.pushes_rejected += 1
            return 409, f"KV for {request_id!r} was already pushed"
        wait.num_tokens = num_tokens
        wait.arrived.set()
        self.counters.pushes_received += 1
        return 200, "ok"


async def call_metaserver(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                          timeout: float) -> None:
    """POST D's ticket to the metaserver and wait for ``{"status": "ok"}``; KvTransferError otherwise.

    Connection errors are retried (3 tries in all); an answer that is not ok is not.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: BaseException | None = None
    for _ in range(METASERVER_TRIES):
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=remaining)) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise KvTransferError(f"metaserver {url} answered HTTP {resp.status}: "
                                       f"{raw[:300].decode(errors='replace')}")
                try:
                    answer = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    answer = None
                if not isinstance(answer, dict) or answer.get("status") != "ok":
                    raise KvTransferError(f"metaserver {url} did not answer {{\"status\": \"ok\"}}: "
                                       f"{raw[:300].decode(errors='replace')}")
                return
        except TimeoutError as exc:
            raise KvTransferError(f"metaserver {url} did not answer within {timeout:g}s") from exc
        except aiohttp.ClientConnectionError as exc:
            last = exc
            log.warning("metaserver %s unreachable (%r); retrying", url, exc)
    raise KvTransferError(f"metaserver {url} unreachable after {METASERVER_TRIES} tries: {last!r}")


async def push_kv(session: aiohttp.ClientSession, target: PushTarget, num_tokens: int) -> None:
    """P pushes a prompt's KV into D; KvTransferError if D does not accept it."""
    body = {"request_id": target.request_id, "remote_engine_id": target.remote_engine_id,
            "num_tokens": num_tokens}
    try:
        async with session.post(target.url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                raise KvTransferError(f"KV push of {target.request_id!r} to {target.url} got HTTP "
                                   f"{resp.status}: {text}")
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise KvTransferError(f"KV push of {target.request_id!r} to {target.url} failed: {exc!r}") from exc
