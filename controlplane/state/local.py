"""Redis for specs and for sharing loads; this replica's ledger in its own memory (``[state] ledger = "local"``).

With the shared ledger (``RedisStore`` behind ``ResilientStore``) every placement waits
for Redis: a data plane's session is served in arrival order, so each round trip to Redis
holds up every message behind it on that session, and placement latency and throughput
follow Redis round trips rather than the placement's own work. Here placement never waits
for Redis:

* **This replica's reservations are authoritative in memory** (a ``MemoryStore``: every
  ledger call is atomic on the event loop, as with the memory backend). Records, releases,
  ends, orphans and claims of the requests it placed happen there.
* **They are published to Redis in batches**: every ``flush_interval_s`` (while something
  changed) one pipeline writes this replica's per-worker loads, as absolute values, to its
  own hash ``P lload:<replica>`` (field: worker id, value ``"requests tokens prefill_tokens
  prefills"``). The hash expires ``replica_ttl_s`` after this replica stops refreshing it, so
  **a dead replica's reservations vanish** by themselves. Absolute values make a lost or
  repeated write harmless: the next one puts the figures right.
* **Other replicas' loads are read in one call every ``refresh_s``** (a Lua script sums
  every other live replica's hash) and added to this replica's own figures in ``loads()``.
  That call also refreshes this replica's TTL and says whether its hash is still there.
* **Redis lost**: placement goes on from this replica's ledger and the other replicas'
  last figures (dropped once they are older than ``replica_ttl_s``: their hashes would have
  expired by then too); ``available`` is False meanwhile. Once Redis answers again, the
  whole hash is rewritten (also when Redis restarted empty without this replica noticing a
  failure: the refresh reports the hash missing) and the other replicas' figures re-read.

Trade-offs against the shared ledger (why it is an option, not the default):

* another replica sees this one's charges up to ``flush_interval_s + refresh_s`` late
  (the load mirror, ``loads_max_age_s``, has the same staleness for the shared ledger);
* a request's record lives only on the replica that placed it: a report that reaches
  another replica (a data plane that failed over mid-request) is not applied there, and a
  reconnecting data plane can claim only what the replica it reaches placed. The placing
  replica releases such requests after ``session_grace_s`` (their session ended); when it
  died, its loads vanish after ``replica_ttl_s``. With the shared ledger another replica
  would claim and end them;
* a restarted replica starts with an empty ledger (as with the memory backend).

Every replica of a deployment must use the same ``ledger``: a shared-ledger replica does
not read the per-replica hashes, a local-ledger one does not read the shared load hashes.
Specs, spec sync, heartbeats and KV snapshots are the Redis store's, unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from controlplane.state.base import Charge, RequestRecord, StoreUnavailable
from controlplane.state.memory import MemoryStore
from controlplane.state.redis import _UNAVAILABLE, RedisStore, _reraise_cancel
from controlplane.workers import IDLE, Load

log = logging.getLogger(__name__)

# ARGV: P, this replica, its ttl (ms). Sums every other replica's per-worker loads; drops
# replicas whose hash expired from the set; refreshes this replica's TTL.
# Returns {own hash exists (0/1), {worker, requests, tokens, prefill_tokens, prefills, ...}}.
_OTHERS = r"""
local P, me, ttl = ARGV[1], ARGV[2], ARGV[3]
local sums, order = {}, {}
for _, rep in ipairs(redis.call('SMEMBERS', P .. 'lreps')) do
  if rep ~= me then
    local h = redis.call('HGETALL', P .. 'lload:' .. rep)
    if #h == 0 then
      redis.call('SREM', P .. 'lreps', rep)
    else
      for i = 1, #h, 2 do
        local wid = h[i]
        local s = sums[wid]
        if not s then s = {0, 0, 0, 0}; sums[wid] = s; table.insert(order, wid) end
        local j = 1
        for x in string.gmatch(h[i + 1], '%-?%d+') do
          if j <= 4 then s[j] = s[j] + tonumber(x) end
          j = j + 1
        end
      end
    end
  end
end
local own = redis.call('PEXPIRE', P .. 'lload:' .. me, ttl)
local flat = {}
for _, wid in ipairs(order) do
  local s = sums[wid]
  table.insert(flat, wid)
  for j = 1, 4 do table.insert(flat, s[j]) end
end
return {own, flat}
"""


def _encode(load: Load) -> str:
    return f"{load.requests} {load.tokens} {load.prefill_tokens} {load.prefills}"


def _plus(a: Load, b: Load) -> Load:
    return Load(a.requests + b.requests, a.tokens + b.tokens, a.prefill_tokens + b.prefill_tokens,
                a.prefills + b.prefills)


class LocalLedgerStore:
    """``StateStore``: specs in Redis, this replica's ledger in memory, loads shared through Redis."""

    def __init__(self, shared: RedisStore, *, flush_interval_s: float = 0.005, refresh_s: float = 0.05,
                 retry_s: float = 0.5) -> None:
        self.shared = shared
        self.local = MemoryStore()
        self.local.load_listeners.append(self._changed)
        self.flush_interval_s = flush_interval_s
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.available = True
        self.outages = 0
        self.flushes = 0
        self.refreshes = 0
        P, me = shared.prefix, shared.replica_id
        self._k_own, self._k_reps = f"{P}lload:{me}", f"{P}lreps"
        self._others: dict[str, Load] = {}
        # own + others for the workers others hold load on (the rest: own alone), kept
        # current on every change, so loads() is a lookup as with MemoryStore.
        self._sum: dict[str, Load] = {}
        # Called with (worker id, new total load) on every change, as MemoryStore does: the
        # fleet's least-loaded order (Placer registers Fleet.note_load) follows it.
        self.load_listeners: list = []
        self._others_at = float("-inf")    # when the other replicas' figures were read
        self._dirty: set[str] = set()
        self._resync = True                # the next flush rewrites the whole hash
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._down_since = 0.0

    def __getattr__(self, name: str):
        # specs, watch_specs, spec_version, heartbeat, sweep, replica_id, prefix, redis...
        return getattr(self.shared, name)

    # ------------------------------------------------------------------ specs: Redis

    async def put_spec(self, spec) -> None:
        await self.shared.put_spec(spec)

    async def remove_spec(self, worker_id: str):
        return await self.shared.remove_spec(worker_id)

    async def specs(self):
        return await self.shared.specs()

    # ------------------------------------------------------------------ ledger: memory (never awaits Redis)

    def _changed(self, worker_id: str, load: Load) -> None:
        theirs = self._others.get(worker_id)
        if theirs is not None:
            load = self._sum[worker_id] = _plus(load, theirs)
        for listener in self.load_listeners:
            listener(worker_id, load)
        self._dirty.add(worker_id)
        wake = self._wake
        if wake is not None and not wake.is_set():
            wake.set()

    def _ensure_syncing(self) -> None:
        if self._task is None and not self._closed:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._sync_loop())

    async def reserve(self, record: RequestRecord, charges: tuple[Charge, ...], *, charged: bool = False,
                      **notes) -> RequestRecord:
        self._ensure_syncing()
        return await self.local.reserve(record, charges, charged=charged, **notes)

    async def release(self, request_id: str, *, leg: str = "", worker_id: str = "") -> RequestRecord | None:
        return await self.local.release(request_id, leg=leg, worker_id=worker_id)

    async def end(self, request_id: str) -> RequestRecord | None:
        return await self.local.end(request_id)

    async def settle_prefill(self, request_id: str) -> RequestRecord | None:
        return await self.local.settle_prefill(request_id)

    async def get(self, request_id: str) -> RequestRecord | None:
        return await self.local.get(request_id)

    async def records(self) -> list[RequestRecord]:
        return await self.local.records()

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        if self._task is None:
            self._ensure_syncing()
        own, total = self.local.load_map, self._sum
        return {wid: total[wid] if wid in total else own.get(wid, IDLE) for wid in worker_ids}

    def own_loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        """This replica's share alone (what it publishes)."""
        own = self.local.load_map
        return {wid: own.get(wid, IDLE) for wid in worker_ids}

    async def forget_worker(self, worker_id: str) -> Load:
        theirs = self._others.pop(worker_id, IDLE)
        self._sum.pop(worker_id, None)
        return _plus(await self.local.forget_worker(worker_id), theirs)

    async def orphan(self, session: str, now: float) -> int:
        return await self.local.orphan(session, now)

    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        return await self.local.claim(session, request_ids)

    async def orphans(self, cutoff: float) -> list[str]:
        return await self.local.orphans(cutoff)

    # ------------------------------------------------------------------ publishing and reading loads

    async def _pipeline(self, commands: list[tuple]) -> list:
        wire = self.shared.wire
        if wire is not None:
            return await wire.pipeline(commands)
        async with self.shared.redis.pipeline(transaction=False) as pipe:   # rediss://: redis-py
            for c in commands:
                pipe.execute_command(*c)
            return await pipe.execute()

    async def flush(self) -> None:
        """Write what changed since the last flush (everything after a resync) to Redis."""
        own = self.local.load_map
        if self._resync:
            resync, dirty = True, set(own)
        else:
            resync, dirty = False, self._dirty
        self._dirty = set()
        self._resync = False
        sets: list[str] = []
        dels: list[str] = []
        for wid in dirty:
            load = own.get(wid)
            if load is None or load == IDLE:
                dels.append(wid)
            else:
                sets += (wid, _encode(load))
        commands: list[tuple] = [("DEL", self._k_own)] if resync else []
        if sets:
            commands.append(("HSET", self._k_own, *sets))
        if dels and not resync:
            commands.append(("HDEL", self._k_own, *dels))
        commands += [("PEXPIRE", self._k_own, self.shared.replica_ttl_ms),
                     ("SADD", self._k_reps, self.shared.replica_id)]
        try:
            await self._pipeline(commands)
        except BaseException:
            self._resync = True   # what this flush carried is lost: rewrite everything next time
            raise
        self.flushes += 1

    async def refresh(self) -> None:
        """Read the other replicas' loads (one call); refreshes this replica's TTL."""
        started = time.monotonic()
        own, flat = await self.shared.wire.script(_OTHERS, [], [self.shared.prefix, self.shared.replica_id,
                                                                 self.shared.replica_ttl_ms]) \
            if self.shared.wire is not None else \
            await self.shared.redis.eval(_OTHERS, 0, self.shared.prefix, self.shared.replica_id,
                                         self.shared.replica_ttl_ms)
        self._set_others({flat[i]: Load(*(max(0, int(x)) for x in flat[i + 1:i + 5]))
                          for i in range(0, len(flat), 5)})
        self._others_at = started
        self.refreshes += 1
        if not int(own) and not self._resync and any(load != IDLE for load in self.local.load_map.values()):
            # Our hash is gone (expired while we were away, or Redis restarted empty): rewrite it.
            self._resync = True
            if self._wake is not None:
                self._wake.set()

    def _set_others(self, others: dict[str, Load]) -> None:
        """New figures for the other replicas: totals recomputed, listeners told of changes."""
        own, old = self.local.load_map, self._sum
        total = {wid: _plus(own.get(wid, IDLE), theirs) for wid, theirs in others.items()}
        self._others, self._sum = others, total
        if self.load_listeners:
            for wid in set(old) | set(total):
                now = total[wid] if wid in total else own.get(wid, IDLE)
                if old.get(wid, own.get(wid, IDLE)) != now:
                    for listener in self.load_listeners:
                        listener(wid, now)

    async def sync_now(self) -> None:
        """Flush and refresh at once (tests, and a clean stop)."""
        self._ensure_syncing()
        await self.flush()
        await self.refresh()

    async def _sync_loop(self) -> None:
        next_refresh = 0.0
        wake = self._wake
        assert wake is not None   # made with this task (_ensure_syncing)
        while True:
            _reraise_cancel()
            try:
                if self._dirty or self._resync:
                    await self.flush()
                now = time.monotonic()
                if now >= next_refresh:
                    await self.refresh()
                    next_refresh = now + self.refresh_s
                self._ok()
            except (StoreUnavailable, *_UNAVAILABLE) as exc:
                _reraise_cancel()
                self._lost(exc)
                if self._others and time.monotonic() - self._others_at > self.shared.replica_ttl_ms / 1000:
                    self._set_others({})   # their hashes would have expired by now too
                await asyncio.sleep(self.retry_s)
                continue
            except Exception:  # noqa: BLE001 - a bug must not stop publishing for good
                log.exception("local ledger sync failed")
                self._resync = True
                await asyncio.sleep(self.retry_s)
                continue
            if self._dirty or self._resync:
                await asyncio.sleep(self.flush_interval_s)   # batch what comes meanwhile
                continue
            wake.clear()
            timeout = max(0.0, next_refresh - time.monotonic())
            try:
                await asyncio.wait_for(wake.wait(), timeout)
                await asyncio.sleep(self.flush_interval_s)
            except TimeoutError:
                pass

    def _lost(self, exc: BaseException) -> None:
        self._resync = True
        if self.available:
            self.available = False
            self.outages += 1
            self._down_since = time.monotonic()
            log.error("state store unavailable (%s: %s): placing from this replica's ledger; other replicas' "
                      "loads as last read", type(exc).__name__, exc)

    def _ok(self) -> None:
        if not self.available:
            self.available = True
            log.warning("state store is back after %.1fs: this replica's loads republished",
                        time.monotonic() - self._down_since)

    # ------------------------------------------------------------------ lifecycle

    async def maintain(self, interval_s: float | None = None, *, orphan: bool = True) -> None:
        self._ensure_syncing()
        await self.shared.maintain(interval_s, orphan=orphan)

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.shared.close()
