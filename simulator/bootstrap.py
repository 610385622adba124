"""Parallel ("bootstrap") prefill/decode: SGLang's bootstrap rooms and vLLM's MooncakeConnector.

In this flow a proxy sends the request to P and D at the same time. They meet at a
*room*: SGLang's ``bootstrap_room`` (an int the router picks), or for vLLM's
MooncakeConnector the ``X-Request-Id`` both sides share (or ``transfer_id`` when the
proxy sends one). P offers the room's KV once its prefill is done; D fetches it from P's
bootstrap port with ``POST /sim/bootstrap/pull {"room": R}``, a long-poll that returns as
soon as P has offered that room, so either side may arrive first.

What P does while it waits differs, as in the real engines:

* SGLang: P answers its own client only after D took the KV (``RoomHold``), or with a 500
  ``bootstrap peer never came`` after ``bootstrap_timeout_s``.
* vLLM MooncakeConnector: P answers at once and keeps the blocks (``delay_free_blocks``)
  until D reads them or the lease expires; here the NIXL lease doubles as the room's offer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from simulator.engine import Engine, HeldKv, SimRequest
from simulator.protocol import KvTransferError

log = logging.getLogger(__name__)


def room_key(room: Any) -> str:
    """Rooms are compared as strings, so an int room and its JSON string form meet."""
    return str(room)


@dataclass(eq=False)
class RoomOffer:
    """KV a prefill node has ready for one room."""

    room: str
    num_tokens: int
    block_ids: list[int]
    on_take: Callable[[], object]   # what it returns is not used
    taken: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Arrival:
    """Wakes the long-polls waiting for one room."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0


@dataclass
class BootstrapCounters:
    transfers: int = 0        # P: rooms whose KV a decode peer took
    timeouts: int = 0         # P: SGLang holds that ended without a peer
    pull_timeouts: int = 0    # P: long-polls that ended without an offer (answered 404)
    pulls_ok: int = 0         # D: fetches that got the KV
    pulls_failed: int = 0     # D: fetches that failed (the request got an error)


class BootstrapRooms:
    """A prefill node's rooms: offered KV, and long-polls waiting for a room to be offered."""

    def __init__(self) -> None:
        self._offers: dict[str, RoomOffer] = {}
        self._arrivals: dict[str, _Arrival] = {}
        self._producers: set[str] = set()  # SGLang rooms a P handler is working on
        self.holds_waiting = 0            # SGLang P handlers waiting for their peer
        self.pulls_waiting = 0            # long-polls waiting for P
        self.counters = BootstrapCounters()

    def offered(self) -> list[str]:
        return list(self._offers)

    # ---- prefill side ----------------------------------------------------------------

    def claim(self, room: str) -> bool:
        """A SGLang prefill starts on ``room``; False if the room is already in use here."""
        if room in self._producers or room in self._offers:
            return False
        self._producers.add(room)
        return True

    def unclaim(self, room: str) -> None:
        self._producers.discard(room)

    def offer(self, room: str, num_tokens: int, block_ids: list[int], on_take: Callable[[], object]) -> RoomOffer:
        """Make ``room``'s KV available; wakes any decode fetch already waiting for it."""
        old = self._offers.get(room)
        if old is not None:
            log.warning("bootstrap room %s offered again; the earlier KV is no longer reachable by room", room)
        offer = RoomOffer(room, num_tokens, block_ids, on_take)
        self._offers[room] = offer
        arrival = self._arrivals.pop(room, None)
        if arrival is not None:
            arrival.event.set()
        return offer

    def withdraw(self, offer: RoomOffer) -> bool:
        """Take an untaken offer back (timeout, abort, lease ended); True if it was still there."""
        if self._offers.get(offer.room) is offer:
            del self._offers[offer.room]
            return True
        return False

    # ---- the long-poll a decode node calls -------------------------------------------

    async def take(self, room: str, timeout: float) -> RoomOffer | None:
        """Wait up to ``timeout`` for ``room``'s KV and take it (freeing P's blocks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            offer = self._offers.pop(room, None)
            if offer is not None:
                offer.on_take()
                offer.taken.set()
                self.counters.transfers += 1
                return offer
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.counters.pull_timeouts += 1
                return None
            arrival = self._arrivals.setdefault(room, _Arrival())
            arrival.waiters += 1
            self.pulls_waiting += 1
            try:
                await asyncio.wait_for(arrival.event.wait(), remaining)
            except TimeoutError:
                pass
            finally:
                self.pulls_waiting -= 1
                arrival.waiters -= 1
                if arrival.waiters == 0 and self._arrivals.get(room) is arrival:
                    del self._arrivals[room]


class RoomHold:
    """Engine hook for a SGLang prefill: keep the finished prompt's blocks and offer them."""

    def __init__(self, engine: Engine, rooms: BootstrapRooms, room: str) -> None:
        self._engine = engine
        self._rooms = rooms
        self.room = room
        self.offer: RoomOffer | None = None
        self._held: HeldKv | None = None

    def __call__(self, req: SimRequest, held: HeldKv) -> None:
        self._held = held
        self.offer = self._rooms.offer(self.room, req.prompt_tokens, held.block_ids, self._taken)

    def _taken(self) -> None:
        self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._engine.release_held(held)

    async def wait_for_peer(self, timeout: float) -> bool:
        """True once a decode peer took the KV; False after ``timeout`` (the KV is then freed)."""
        assert self.offer is not None
        self._rooms.holds_waiting += 1
        try:
            await asyncio.wait_for(self.offer.taken.wait(), timeout)
            return True
        except TimeoutError:
            self._rooms.counters.timeouts += 1
            return False
        finally:
            self._rooms.holds_waiting -= 1
            self.close()

    def close(self) -> None:
        """Free the KV unless a peer took it; safe to call more than once."""
        if self.offer is not None and self._rooms.withdraw(self.offer):
            self._release()
        self._rooms.unclaim(self.room)


# ---- decode side --------------------------------------------------------------------

@dataclass(frozen=True)
class BootstrapSource:
    """Where a decode node fetches a room's KV from."""

    host: str
    port: int
    room: Any  # sent back as given (int for SGLang, the request id string for Mooncake)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}/sim/bootstrap/pull"


async def fetch_room(session: aiohttp.ClientSession, src: BootstrapSource, timeout: float) -> int:
    """Long-poll P for the room's KV; returns its token count or raises KvTransferError."""
    body = {"room": src.room, "timeout_s": timeout}
    try:
        async with session.post(src.url, json=body, timeout=aiohttp.ClientTimeout(total=timeout + 5)) as resp:
            if resp.status == 200:
                data = await resp.json()
                return int(data["num_tokens"])
            text = (await resp.text())[:300]
            raise KvTransferError(f"KV fetch for bootstrap room {src.room!r} from {src.url} got HTTP "
                               f"{resp.status}: {text}")
    except TimeoutError as exc:
        raise KvTransferError(f"KV fetch for bootstrap room {src.room!r} from {src.url} timed out") from exc
    except (aiohttp.ClientError, KeyError, ValueError, TypeError) as exc:
        raise KvTransferError(f"KV fetch for bootstrap room {src.room!r} from {src.url} failed: {exc!r}") from exc
