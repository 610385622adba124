"""Redis-backed state: specs and the ledger shared by several control-plane replicas.

Same protocol as :class:`~controlplane.state.memory.MemoryStore` (``StateStore``), same
results for the same calls; every ledger operation is one Lua script, so it is atomic in
Redis exactly as a MemoryStore method is atomic on the event loop.

Keys (``P`` is ``key_prefix``, default ``omni:``; several deployments share one Redis
by using different prefixes)::

    P spec              hash  worker id -> spec (orjson)            durable
    P spec:ver          int   bumped on every spec change
    P spec:changed      pub/sub channel: "put <id> <ver>" / "del <id> <ver>"
    P epoch             str   made once per store's life: its loss means Redis lost its data
    P load:<worker>     hash  requests, tokens, prefill_tokens, prefills (integers >= 0)
    P rec:<request>     hash  one RequestRecord (fields as text; charges as JSON)
    P ended:<request>   str   tombstone of an end that found no record (``end(tombstone_s=)``)
    P sess:<session>    set   request ids owned by a data-plane session
    P orphans           zset  request id -> orphaned_at (wall clock)
    P rep:<replica>     set   request ids whose reservations a replica owns
    P replicas          set   replica ids that own (or owned) records

Every record is in its replica's ``rep:`` set, or in ``orphans`` once a sweep took it from a
replica that stopped: ``records()`` reads those (no set of every id for a reserve and an end
to keep: two calls from Lua less per request).
    P alive:<replica>   key   the replica's heartbeat, expiring after ``replica_ttl_s``

Scripts build keys from the prefix, so they touch undeclared keys: use a standalone
Redis (or Sentinel). For Redis Cluster, put a hash tag in the prefix (``{omni}:``) so
every key lands in one slot.

**Loads that expire with their replica.** Each record carries the id of the replica that
reserved it (or last claimed it). A replica refreshes ``alive:<id>`` with
:meth:`RedisStore.heartbeat` (every ``replica_ttl_s / 3`` or so); any replica may call
:meth:`RedisStore.sweep`, which releases (or orphans) the records of every replica whose
heartbeat key has expired. :meth:`RedisStore.maintain` does both in a loop.

**Clocks.** Callers pass ``time.monotonic()`` values (``created_at``, ``placed_at``,
``orphaned_at``, the ``orphans`` cutoff). Monotonic clocks of two processes are
unrelated, so the store keeps wall-clock time in Redis and converts on the way in and out
with a per-instance offset: every replica reads times in its own monotonic frame, and
two replicas compare them correctly up to the hosts' wall-clock skew.

**Redis lost.** Every method raises :class:`StoreUnavailable` when Redis cannot be
reached (refused, reset, timed out, loading, read-only replica). The client reconnects
by itself on the next call: there is nothing to reopen. A connection error is retried
twice within ~50 ms first (a pooled connection that a Redis restart broke); ``reserve``
carries an operation token so that such a retry can never charge twice. A timeout is not
retried: the operation may or may not have happened, and the caller is told so.

**Wiring a replica** (what ``ControlPlane`` must do with ``backend = "redis"``):

1. ``await store.heartbeat()`` before the first placement, then run
   ``store.maintain(orphan=True)`` as a task on *every* replica (all or none: a replica
   that does not heartbeat looks dead to the others' sweeps). Orphaning (not releasing)
   the dead replica's requests lets its data planes, failing over to another replica,
   claim them back; ``Lifecycle.release_orphans`` frees the rest after ``session_grace_s``.
2. Run ``controlplane.state.sync.SpecSync(store, fleet, events=registry.events)`` (built
   by ``controlplane/compose.py``) so specs changed on another replica (drain, weight, add,
   remove) reach this fleet and the same worker hooks as this replica's own changes.
3. Worker heartbeats (``registry.heartbeat``) reach one replica only: expire registered
   workers only on the replica that sees their heartbeats (or share them in Redis),
   otherwise every other replica removes them after ``heartbeat_ttl_s``.
4. Catch :class:`StoreUnavailable` around placement and lifecycle calls: place from the
   fleet and a local ledger meanwhile, and say so in ``/health`` and ``/metrics``
   (``SpecSync.connected``); the client reconnects by itself.
5. ``await store.close()`` in ``ControlPlane.stop``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hiredis import ReplyError as hiredis_error

from controlplane.state import redis_wire
from controlplane.state.base import Charge, RequestRecord, StoreUnavailable
from controlplane.state.owned import OwnedRecords
from controlplane.workers import IDLE, Load, Role, WorkerSpec

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "omni:"

# While this replica writes reserves, its load copy rides along a refresh once it is this
# old (RedisStore._refresh_with_writes): others' charges show up sooner in a burst.
RIDE_REFRESH_S = 0.01
# Records of this replica's write-behind reserves kept for their ends (RedisStore._mine).
MINE_MAX = 1 << 17

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError, asyncio.TimeoutError)

# ---------------------------------------------------------------------------- Lua

# Shared by the scripts: P is the key prefix (ARGV[1]).
_LUA_COMMON = r"""
local P = ARGV[1]
-- Every load this call changes is read once (HMGET, at its first change), changed here and
-- written once when the call ends (flush): a turn's reserves and ends of one worker cost two
-- calls from Lua, not four HINCRBYs each and a read for every end (a call from Lua costs
-- ~1.5 us of redis-server's time on top of the command), and they often cancel out (an end
-- and the next placement on the worker it freed: no write at all).
local touched_list = {}
local cur, base, present = {}, {}, {}   -- worker -> its four amounts now, as read; whether it exists

local function load_of(wid)
  local v = cur[wid]
  if v then return v end
  local raw = redis.call('HMGET', P .. 'load:' .. wid, 'requests', 'tokens', 'prefill_tokens', 'prefills')
  present[wid] = (raw[1] or raw[2] or raw[3] or raw[4]) and true or false   -- (a hash is never empty)
  v = {tonumber(raw[1] or '0') or 0, tonumber(raw[2] or '0') or 0, tonumber(raw[3] or '0') or 0,
       tonumber(raw[4] or '0') or 0}
  cur[wid], base[wid] = v, {v[1], v[2], v[3], v[4]}
  table.insert(touched_list, wid)
  return v
end

-- MemoryStore._add, call by call as the HINCRBYs it replaces did them: a missing load entry
-- is created by increments only (a worker removed while its requests ran has nothing left to
-- release); a lowered amount is clamped at 0.
local function addload(wid, r, t, p)
  local v = load_of(wid)
  local pf = 0
  if p > 0 then pf = 1 elseif p < 0 then pf = -1 end
  if r >= 0 and t >= 0 and p >= 0 then
    if r ~= 0 or t ~= 0 or p ~= 0 then present[wid] = true end
    v[1], v[2], v[3], v[4] = v[1] + r, v[2] + t, v[3] + p, v[4] + pf
    return
  end
  if not present[wid] then return end
  local d = {r, t, p, pf}
  for i = 1, 4 do
    if d[i] < 0 and v[i] + d[i] < 0 then v[i] = 0 else v[i] = v[i] + d[i] end
  end
end

-- Write the loads this call changed (every script that changes one calls it before it returns).
local function flush()
  for _, wid in ipairs(touched_list) do
    local v, b = cur[wid], base[wid]
    if present[wid] and (v[1] ~= b[1] or v[2] ~= b[2] or v[3] ~= b[3] or v[4] ~= b[4]) then
      redis.call('HSET', P .. 'load:' .. wid, 'requests', v[1], 'tokens', v[2], 'prefill_tokens', v[3],
                 'prefills', v[4])
    end
  end
end

local function drop(c)
  local p = 0
  if c[4] ~= 0 then p = -c[4] end
  addload(c[1], -1, -c[3], p)
end

local function decode_charges(raw)
  if not raw then return {} end
  local list = cjson.decode(raw)
  if type(list) ~= 'table' then return {} end
  return list
end

local function charges_of(rk)
  return decode_charges(redis.call('HGET', rk, 'charges'))
end

-- A field of a record read with HGETALL (field, value, field, value...): no second read.
local function field(rec, name)
  for j = 1, #rec, 2 do
    if rec[j] == name then return rec[j + 1] end
  end
  return nil
end

local function encode(list)
  if #list == 0 then return '[]' end
  return cjson.encode(list)
end

-- Forget a record everywhere but in the load hashes (its session, replica and orphaned_at).
local function unlink(rid, rk, sess, rep, orphaned)
  if sess and sess ~= '' then redis.call('SREM', P .. 'sess:' .. sess, rid) end
  if rep and rep ~= '' then redis.call('SREM', P .. 'rep:' .. rep, rid) end
  if (tonumber(orphaned or '0') or 0) ~= 0 then   -- (only orphaned records are there)
    redis.call('ZREM', P .. 'orphans', rid)
  end
  redis.call('DEL', rk)
end

-- {x, {worker, requests, tokens, prefill_tokens, prefills, ...}}: the loads this call
-- changed, as they are now (a replica's load mirror takes them without another read); writes
-- them first.
local function result(x)
  flush()
  local flat = {}
  for _, wid in ipairs(touched_list) do
    local v = cur[wid]
    table.insert(flat, wid)
    if present[wid] then
      for j = 1, 4 do table.insert(flat, v[j]) end
    else
      for _ = 1, 4 do table.insert(flat, false) end   -- (no such entry: nil, as HMGET says)
    end
  end
  return {x, flat}
end

-- End a request: false if it has no record, else the record as HGETALL reads it (``whole``),
-- or true (the fields an end needs, no more: write-behind ends answer from the replica's copy).
local function end_record(rid, whole)
  local rk = P .. 'rec:' .. rid
  local rec, charges, sess, rep, orphaned
  if whole then
    rec = redis.call('HGETALL', rk)
    if #rec == 0 then return false end
    charges, sess, rep, orphaned = field(rec, 'charges'), field(rec, 'session'), field(rec, 'replica'),
                                   field(rec, 'orphaned_at')
  else
    local f = redis.call('HMGET', rk, 'charges', 'session', 'replica', 'orphaned_at', 'op')
    if not (f[1] or f[2] or f[3] or f[5]) then return false end   -- (every record has an op)
    charges, sess, rep, orphaned, rec = f[1], f[2], f[3], f[4], true
  end
  for _, c in ipairs(decode_charges(charges)) do drop(c) end
  unlink(rid, rk, sess, rep, orphaned)
  return rec
end
"""

# A reserve whose arguments start at ARGV[i]: request id, op token, session, orphaned_at (wall
# clock, '' for none), the charges a new record ends up with (JSON), n fields, fields... (but the
# request id and the session: the script writes them from these arguments), n notes, notes...,
# n charges, (worker, leg, tokens, prefill_tokens) * n. The replica and its alive key's ttl
# (ms) are ARGV[2] and ARGV[3], once per call (every reserve of a turn's call is the same
# replica's).
# Returns the record's key (false: a late reserve of a request that had ended, see
# end(tombstone_s=)) and the index after its arguments.
# A new record (every placement's) is written with one HSET holding its final charges, which
# the caller encoded: no read of what was just written, no JSON in Lua (a call from Lua costs
# ~1.5 us of redis-server's time on top of the command, 45 arguments ~6 us, cjson ~4 us).
_RESERVE_AT = r"""
local announced = {}   -- replicas whose alive key and membership this call has set already

local function reserve_at(i)
  local rid, op, rep, ttl = ARGV[i], ARGV[i + 1], ARGV[2], ARGV[3]
  local fi = i + 5
  local nf = tonumber(ARGV[fi])
  local ni = fi + 1 + 2 * nf
  local nn = tonumber(ARGV[ni])
  local ci = ni + 1 + 2 * nn
  local nc = tonumber(ARGV[ci])
  local after = ci + 1 + 4 * nc
  local rk = P .. 'rec:' .. rid
  local exists = false
  if redis.call('EXISTS', rk, P .. 'ended:' .. rid) > 0 then   -- (neither: a new request, one call)
    exists = redis.call('EXISTS', rk) == 1
    if not exists then return false, after end
    if redis.call('HGET', rk, 'op') == op then return rk, after end   -- a retried call that already happened
  end
  if not exists then
    redis.call('HSET', rk, 'request_id', rid, 'session', ARGV[i + 2], 'replica', rep, 'charges', ARGV[i + 4],
               'op', op, unpack(ARGV, fi + 1, fi + 2 * nf))
    redis.call('SADD', P .. 'rep:' .. rep, rid)
    if not announced[rep] then   -- (once per call: a turn's reserves share one)
      announced[rep] = true
      redis.call('SADD', P .. 'replicas', rep)
      redis.call('SET', P .. 'alive:' .. rep, '1', 'PX', ttl, 'NX')
    end
    local sess, orphaned = ARGV[i + 2], ARGV[i + 3]
    if sess ~= '' then redis.call('SADD', P .. 'sess:' .. sess, rid) end
    if (tonumber(orphaned) or 0) ~= 0 then redis.call('ZADD', P .. 'orphans', orphaned, rid) end
  else
    for j = 1, nn do redis.call('HSET', rk, ARGV[ni + 2 * j - 1], ARGV[ni + 2 * j]) end
  end
  local list = exists and charges_of(rk) or nil
  for j = 0, nc - 1 do
    local b = ci + 1 + 4 * j
    local c = {ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])}
    if list then table.insert(list, c) end
    addload(c[1], 1, c[3], c[4])
  end
  if list then redis.call('HSET', rk, 'charges', encode(list), 'op', op) end
  return rk, after
end
"""

# ARGV: P, replica, alive ttl ms, then a reserve's arguments (above)
_RESERVE = _LUA_COMMON + _RESERVE_AT + r"""
local rk = reserve_at(4)
if not rk then return result(false) end
return result(redis.call('HGETALL', rk))
"""

# Write-behind (see RedisStore.reserve and end): the reserves and ends of one loop turn in one
# call, in the order they were made. ARGV: P, replica, alive ttl ms, then per call 'r' and a
# reserve's arguments, or 'e' and a request id. Nobody reads the records, only the loads they
# changed (each once).
_BEHIND = _LUA_COMMON + _RESERVE_AT + r"""
local i, n = 4, #ARGV
while i <= n do
  if ARGV[i] == 'r' then
    local _
    _, i = reserve_at(i + 1)
  else
    end_record(ARGV[i + 1], false)
    i = i + 2
  end
end
return result(false)
"""

# ARGV: P, request id, leg ('' = any), worker id ('' = any)
_RELEASE = _LUA_COMMON + r"""
local rid, leg, wid = ARGV[2], ARGV[3], ARGV[4]
local rk = P .. 'rec:' .. rid
if redis.call('EXISTS', rk) == 0 then return result(false) end
local keep, changed = {}, false
for _, c in ipairs(charges_of(rk)) do
  if (leg == '' or c[2] == leg) and (wid == '' or c[1] == wid or string.sub(c[1], 1, #wid + 1) == wid .. '#') then
    drop(c); changed = true
  else
    table.insert(keep, c)
  end
end
if changed then redis.call('HSET', rk, 'charges', encode(keep)) end
return result(redis.call('HGETALL', rk))
"""

# ARGV: P, request id, tombstone ttl ms ('0': none)
_END = _LUA_COMMON + r"""
local rec = end_record(ARGV[2], true)
if not rec and tonumber(ARGV[3]) > 0 then
  redis.call('SET', P .. 'ended:' .. ARGV[2], '1', 'PX', ARGV[3])   -- a reserve still on its way charges nothing
end
return result(rec)
"""

# ARGV: P, request id
_SETTLE = _LUA_COMMON + r"""
local rk = P .. 'rec:' .. ARGV[2]
if redis.call('EXISTS', rk) == 0 then return result(false) end
local list, changed = charges_of(rk), false
for _, c in ipairs(list) do
  if c[4] ~= 0 then
    addload(c[1], 0, 0, -c[4]); c[4] = 0; changed = true
  end
end
if changed then redis.call('HSET', rk, 'charges', encode(list)) end
return result(redis.call('HGETALL', rk))
"""

# ARGV: P, session, now (wall clock)
_ORPHAN = _LUA_COMMON + r"""
local sk = P .. 'sess:' .. ARGV[2]
local ids = redis.call('SMEMBERS', sk)
redis.call('DEL', sk)
for _, rid in ipairs(ids) do
  local rk = P .. 'rec:' .. rid
  if redis.call('EXISTS', rk) == 1 then
    redis.call('HSET', rk, 'session', '', 'orphaned_at', ARGV[3])
    redis.call('ZADD', P .. 'orphans', ARGV[3], rid)
  end
end
return #ids
"""

# ARGV: P, session, replica, request ids...
_CLAIM = _LUA_COMMON + r"""
local sess, rep = ARGV[2], ARGV[3]
local claimed = 0
for i = 4, #ARGV do
  local rid = ARGV[i]
  local rk = P .. 'rec:' .. rid
  local f = redis.call('HMGET', rk, 'session', 'orphaned_at', 'replica')
  local owned = f[1] and f[1] ~= '' and (tonumber(f[2] or '0') or 0) == 0
  if redis.call('EXISTS', rk) == 1 and not owned then
    if f[1] and f[1] ~= '' then redis.call('SREM', P .. 'sess:' .. f[1], rid) end
    redis.call('HSET', rk, 'session', sess, 'orphaned_at', '0.0', 'replica', rep)
    redis.call('ZREM', P .. 'orphans', rid)
    redis.call('SADD', P .. 'sess:' .. sess, rid)
    if f[3] ~= rep then
      if f[3] and f[3] ~= '' then redis.call('SREM', P .. 'rep:' .. f[3], rid) end
      redis.call('SADD', P .. 'rep:' .. rep, rid)
      redis.call('SADD', P .. 'replicas', rep)
    end
    claimed = claimed + 1
  end
end
return claimed
"""

# KEYS: the load hashes; one command for any number of candidates (a pipeline of HMGETs
# costs the client a command each).
_LOADS = r"""
local out = {}
for i, k in ipairs(KEYS) do
  local v = redis.call('HMGET', k, 'requests', 'tokens', 'prefill_tokens', 'prefills')
  out[4 * i - 3], out[4 * i - 2], out[4 * i - 1], out[4 * i] = v[1], v[2], v[3], v[4]
end
return out
"""

# ARGV: P, worker id
_FORGET = r"""
local k = ARGV[1] .. 'load:' .. ARGV[2]
local v = redis.call('HMGET', k, 'requests', 'tokens', 'prefill_tokens', 'prefills')
redis.call('DEL', k)
return v
"""

# ARGV: P, worker id
_REMOVE_SPEC = r"""
local P = ARGV[1]
local old = redis.call('HGET', P .. 'spec', ARGV[2])
if not old then return false end
redis.call('HDEL', P .. 'spec', ARGV[2])
local ver = redis.call('INCR', P .. 'spec:ver')
redis.call('PUBLISH', P .. 'spec:changed', 'del ' .. ARGV[2] .. ' ' .. ver)
return old
"""

# ARGV: P, worker id, spec
_PUT_SPEC = r"""
local P = ARGV[1]
redis.call('HSET', P .. 'spec', ARGV[2], ARGV[3])
local ver = redis.call('INCR', P .. 'spec:ver')
redis.call('PUBLISH', P .. 'spec:changed', 'put ' .. ARGV[2] .. ' ' .. ver)
return ver
"""

# ARGV: P, a new epoch. The store's epoch, set to the new one if it has none (a new or
# emptied Redis).
_SPEC_EPOCH = r"""
local k = ARGV[1] .. 'epoch'
local e = redis.call('GET', k)
if e then return e end
redis.call('SET', k, ARGV[2])
return ARGV[2]
"""

# ARGV: P, replica, mode ('end' | 'orphan'), now (wall clock, for 'orphan')
# Releases the records of a replica whose heartbeat expired; re-checked here, atomically.
_SWEEP = _LUA_COMMON + r"""
local rep, mode, now = ARGV[2], ARGV[3], ARGV[4]
if redis.call('EXISTS', P .. 'alive:' .. rep) == 1 then return {} end
local rsk = P .. 'rep:' .. rep
local ids = redis.call('SMEMBERS', rsk)
local done = {}
for _, rid in ipairs(ids) do
  local rk = P .. 'rec:' .. rid
  if mode == 'end' then
    if end_record(rid, true) then table.insert(done, rid) end
  elseif redis.call('EXISTS', rk) == 1 then
    local s = redis.call('HGET', rk, 'session')
    if s and s ~= '' then redis.call('SREM', P .. 'sess:' .. s, rid) end
    local o = tonumber(redis.call('HGET', rk, 'orphaned_at') or '0') or 0
    if o == 0 then
      redis.call('HSET', rk, 'session', '', 'orphaned_at', now)
      redis.call('ZADD', P .. 'orphans', now, rid)
    end
    redis.call('HSET', rk, 'replica', '')
    table.insert(done, rid)
  end
end
redis.call('DEL', rsk)
redis.call('SREM', P .. 'replicas', rep)
flush()
return done
"""

# ---------------------------------------------------------------------------- encoding

_INT_FIELDS = frozenset({"prompt_tokens", "max_tokens", "flow", "work_ahead_tokens", "decode_batch", "pull_tokens"})
_TIME_FIELDS = frozenset({"created_at", "placed_at", "orphaned_at", "decode_placed_at"})   # monotonic <-> wall clock
_FLOAT_FIELDS = frozenset({"predicted_ttft_s"}) | _TIME_FIELDS
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(WorkerSpec))
_LOAD_FIELDS = ("requests", "tokens", "prefill_tokens", "prefills")
# (field, 1: a time, 2: a float, 3: an int, 0: text) for every record field but the charges,
# in the order RedisStore._encode_record writes them
# (nor the request id and the session: the reserve script writes them from its own arguments)
_FIELD_KINDS = tuple((f, 1 if f in _TIME_FIELDS else 2 if f in _FLOAT_FIELDS else 3 if f in _INT_FIELDS else 0)
                     for f in _RECORD_FIELDS if f not in ("charges", "request_id", "session"))


def encode_spec(spec: WorkerSpec) -> bytes:
    data = {f: getattr(spec, f) for f in _SPEC_FIELDS}
    data["role"] = spec.role.value
    data["labels"] = dict(spec.labels)
    return orjson.dumps(data)


def decode_spec(raw: str | bytes) -> WorkerSpec:
    data = orjson.loads(raw)
    # Fields a newer replica wrote that this one does not know are ignored.
    data = {k: v for k, v in data.items() if k in _SPEC_FIELDS}
    data["role"] = Role(data["role"])
    return WorkerSpec(**data)


def _charges_json(charges: Iterable[Charge]) -> bytes:
    return orjson.dumps([[c.worker_id, c.leg, int(c.tokens), int(c.prefill_tokens)] for c in charges])


def _sum_load(load: Load, sign: int, requests: int, tokens: int, prefill_tokens: int, prefills: int) -> Load:
    """``load`` plus (``sign`` 1) or less (-1) these amounts, each at least 0."""
    r = load.requests + sign * requests
    t = load.tokens + sign * tokens
    p = load.prefill_tokens + sign * prefill_tokens
    n = load.prefills + sign * prefills
    return Load(r if r > 0 else 0, t if t > 0 else 0, p if p > 0 else 0, n if n > 0 else 0)


def _load(values: list[Any]) -> Load:
    """A load as HMGET (or a script, as integers) gives its four amounts: every reply and
    refresh of the load copy decodes one per worker (no generator: ~1 us less each)."""
    r, t, p, n = values
    if r is None and t is None:
        return IDLE
    return Load(int(r or 0), int(t or 0), int(p or 0), int(n or 0))


def safe_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True, slots=True)
class SpecChange:
    """One spec change another replica (or this one) made: ``kind`` is "put" or "del"."""

    kind: str
    worker_id: str
    version: int


def _unavailable(method):
    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except _UNAVAILABLE as exc:
            _reraise_cancel()
            raise StoreUnavailable(f"redis at {self.url_for_logs} unavailable ({type(exc).__name__}: {exc})") from exc
    return wrapper


def _reraise_cancel() -> None:
    """A cancel that arrived during a redis call can surface as a timeout or connection
    error (the socket read is abandoned): it must stay a cancel, or a cancelled loop would
    take it for an outage and go on forever."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():
        raise asyncio.CancelledError


class RedisStore:
    """``StateStore`` on Redis. One instance per control-plane replica (``replica_id``)."""

    def __init__(self, url: str = DEFAULT_URL, *, key_prefix: str = DEFAULT_PREFIX, replica_id: str = "",
                 replica_ttl_s: float = 10.0, socket_timeout_s: float = 1.0, max_connections: int = 32,
                 client: aioredis.Redis | None = None, fast_path: bool = True, loads_max_age_s: float = 0.0,
                 write_behind: bool = False) -> None:
        self.url_for_logs = safe_url(url)
        self.prefix = key_prefix
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.replica_ttl_ms = max(1, int(replica_ttl_s * 1000))
        self._ops = itertools.count(1)
        # Monotonic -> wall clock, fixed for this instance (see "Clocks" above).
        self._wall_offset = time.time() - time.monotonic()
        if client is None:
            # Callers queue for a free connection instead of failing when a burst needs more
            # than max_connections at once; connections are freed within the socket timeout.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=max(5.0, 2 * socket_timeout_s), decode_responses=True,
                socket_timeout=socket_timeout_s, socket_connect_timeout=max(2.0, socket_timeout_s),
                retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), 2, supported_errors=(RedisConnectionError,)),
                health_check_interval=30)
            client = aioredis.Redis(connection_pool=pool)
        # Any: redis-py types the asyncio client's replies as the sync client's (a value or an
        # awaitable of it, bytes or str whatever decode_responses says).
        self.redis: Any = client
        # The ledger's hot calls (loads, reserve, release, end, settle, get) on a lean
        # pipelining connection; redis-py for the rest (see redis_wire). TLS: redis-py only.
        self.wire = (redis_wire.WireClient(url, timeout_s=socket_timeout_s,
                                           connect_timeout_s=max(2.0, socket_timeout_s))
                     if fast_path and redis_wire.supported(url) else None)
        # Load mirror (off at 0): loads() answers from memory; the copy is refreshed in the
        # background once it is loads_max_age_s old. Its own reserves and releases update the
        # copy at once (write-behind) or from the scripts' replies; other replicas' show up
        # within loads_max_age_s and a round trip.
        self.loads_max_age_s = loads_max_age_s
        # Older than this, a placement waits for the refresh (which fails over to the local
        # ledger when Redis is out); younger, it is answered from the copy at once.
        self.mirror_wait_s = max(10 * loads_max_age_s, 0.5)
        self._mirror: dict[str, Load] = {}
        self._mirror_gen: dict[str, int] = {}
        self._mirror_tick = 0
        self._mirror_at = float("-inf")
        self._watched: set[str] = set()
        self._refreshing: asyncio.Future | None = None
        # This replica's write-behind charges sent but not yet answered, in order, and their sum
        # per worker: a load that Redis reports (a script's reply, a refresh) lacks them, so the
        # mirror adds them back, or it would forget this replica's newest charges until their
        # replies came (placing more on a worker than the loads allow, in a burst).
        # (charges, +1 for a reserve or -1 for an end): each write-behind call until answered.
        self._behind: deque[tuple[tuple[Charge, ...], int]] = deque()
        self._riding = False   # a refresh sent with this replica's writes is on its way
        self._unconfirmed: dict[str, list[int]] = {}
        # Write-behind reserve (off by default): see reserve().
        self.write_behind = write_behind and self.wire is not None
        self.write_behind_failures = 0
        # Write-behind ends: the records this replica reserved, as it last knew them (its own
        # calls' answers keep them current), so an end answers from here and is sent without
        # waiting for Redis; bounded (the oldest go first: their end is then awaited), and
        # indexed by session (an orphaned session drops its own, not a scan of them all).
        self._mine = OwnedRecords(MINE_MAX)
        # Told of each write-behind end Redis did not confirm (its request id, the error): a
        # lost end would leave its load in Redis, so the ResilientStore keeps it and replays it.
        # Unset, the loss is logged.
        self.lost_ends: Callable[[str, BaseException], None] | None = None
        r = self.redis
        self._reserve = r.register_script(_RESERVE)
        self._release = r.register_script(_RELEASE)
        self._end = r.register_script(_END)
        self._settle = r.register_script(_SETTLE)
        self._orphan = r.register_script(_ORPHAN)
        self._claim = r.register_script(_CLAIM)
        self._forget = r.register_script(_FORGET)
        self._loads = r.register_script(_LOADS)
        self._put_spec = r.register_script(_PUT_SPEC)
        self._remove_spec = r.register_script(_REMOVE_SPEC)
        self._sweep = r.register_script(_SWEEP)
        self._spec_epoch = r.register_script(_SPEC_EPOCH)
        P = key_prefix
        self._k_spec, self._k_ver, self.spec_channel = P + "spec", P + "spec:ver", P + "spec:changed"
        self._k_load, self._k_rec, self._k_rep = P + "load:", P + "rec:", P + "rep:"
        # What the reserve scripts' arguments start with: every call's are this replica's.
        self._behind_head: list[Any] = [P, self.replica_id, self.replica_ttl_ms]
        self._k_orphans, self._k_replicas, self._k_alive = P + "orphans", P + "replicas", P + "alive:"

    async def close(self) -> None:
        if self.wire is not None:
            await self.wire.close()
        await self.redis.aclose(close_connection_pool=True)

    async def _script(self, script, source: str, args: list[Any], keys: list[str] | None = None) -> Any:
        if self.wire is not None:
            return await self.wire.script(source, keys or [], args)
        return await script(keys=keys or [], args=args)

    async def _script_soon(self, script, source: str, args: list[Any]) -> Any:
        """A per-request ledger call (end, release, settle): sent with the rest of this loop
        turn's (``WireClient.script_soon``: one write for every placement's and report's call)."""
        if self.wire is not None:
            return await self.wire.script_soon(source, [], args)
        return await script(keys=[], args=args)

    @_unavailable
    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # ------------------------------------------------------------------ clocks and records

    def _to_wall(self, t: float) -> float:
        return t + self._wall_offset if t else 0.0

    def _from_wall(self, t: float) -> float:
        return t - self._wall_offset if t else 0.0

    def _encode_record(self, record: RequestRecord) -> list[str | bytes]:
        """Every field but the charges (and the request id and session, the script's own
        arguments) that is not at its zero value, as ``_encode_fields`` writes them, without
        building a dict of them and checking each name first (every placement's reserve runs
        it; tests/test_state_redis.py checks it against ``_encode_fields`` and every field of
        ``_FIELD_KINDS``). A new record is written with these alone: a field missing in Redis
        reads as its zero value, in ``_record`` and in every script, so the fields a new
        request leaves at 0 cost no argument, no encoding and no hash entry."""
        out: list[str | bytes] = []
        off = self._wall_offset
        r = record   # (field by field, in _FIELD_KINDS's order: 40 % less than a loop over it)
        if r.model:
            out += ("model", r.model)
        if r.prompt_tokens:
            out += ("prompt_tokens", str(int(r.prompt_tokens)))
        if r.max_tokens:
            out += ("max_tokens", str(int(r.max_tokens)))
        if r.flow:
            out += ("flow", str(int(r.flow)))
        if r.created_at:
            out += ("created_at", repr(float(r.created_at) + off))
        if r.orphaned_at:
            out += ("orphaned_at", repr(float(r.orphaned_at) + off))
        if r.placed_at:
            out += ("placed_at", repr(float(r.placed_at) + off))
        if r.predicted_ttft_s:
            out += ("predicted_ttft_s", repr(float(r.predicted_ttft_s)))
        if r.work_ahead_tokens:
            out += ("work_ahead_tokens", str(int(r.work_ahead_tokens)))
        if r.decode_batch:
            out += ("decode_batch", str(int(r.decode_batch)))
        if r.decode_placed_at:
            out += ("decode_placed_at", repr(float(r.decode_placed_at) + off))
        if r.pull_tokens:
            out += ("pull_tokens", str(int(r.pull_tokens)))
        return out

    def _encode_fields(self, fields: dict[str, Any]) -> list[str | bytes]:
        out: list[str | bytes] = []
        for key, value in fields.items():
            if key == "charges" or key not in _RECORD_FIELDS:
                raise TypeError(f"not a RequestRecord note: {key!r}")
            if key in _TIME_FIELDS:
                value = repr(self._to_wall(float(value)))
            elif key in _FLOAT_FIELDS:
                value = repr(float(value))
            elif key in _INT_FIELDS:
                value = str(int(value))
            out += (key, value)
        return out

    def _record(self, flat: list[str] | dict[str, str] | None) -> RequestRecord | None:
        """A record as HGETALL (or a script) returned it; a missing field is at its zero
        value. One positional constructor call (every report's end decodes one): the
        field order is ``RequestRecord``'s (tests/test_state_redis.py checks the round trip
        of a record whose every field differs)."""
        if not flat:
            return None
        if isinstance(flat, dict):
            data = flat
        else:
            it = iter(flat)
            data = dict(zip(it, it, strict=False))
        g = data.get
        off = self._wall_offset
        raw = g("charges")
        charges: tuple[Charge, ...] = ()
        if raw:
            items = orjson.loads(raw)
            if isinstance(items, list):
                charges = tuple(Charge(str(w), str(leg), int(t), int(p)) for w, leg, t, p in items)

        def wall(key: str) -> float:   # a wall-clock time back to this replica's monotonic clock
            t = float(g(key) or 0.0)
            return t - off if t else 0.0

        return RequestRecord(g("request_id", ""), g("model", ""), int(g("prompt_tokens") or 0),
                             int(g("max_tokens") or 0), g("session", ""), int(g("flow") or 0), charges,
                             wall("created_at"), wall("orphaned_at"), wall("placed_at"),
                             float(g("predicted_ttft_s") or 0.0), int(g("work_ahead_tokens") or 0),
                             int(g("decode_batch") or 0), wall("decode_placed_at"), int(g("pull_tokens") or 0))

    def _sent_behind(self, charges: tuple[Charge, ...], sign: int) -> None:
        """A write-behind reserve (+1) or end (-1) is on its way: the load mirror counts it now,
        and adds it to every load Redis reports until its own reply comes."""
        self._behind.append((charges, sign))
        unconfirmed, mirror = self._unconfirmed, self._mirror
        for c in charges:
            wid = c.worker_id
            u = unconfirmed.get(wid)
            if u is None:   # (the load's four amounts, and how many calls on their way touch it)
                u = unconfirmed[wid] = [0, 0, 0, 0, 0]
            p = 1 if c.prefill_tokens > 0 else 0
            u[0] += sign
            u[1] += sign * c.tokens
            u[2] += sign * c.prefill_tokens
            u[3] += sign * p
            u[4] += 1
            cur = mirror.get(wid)
            if cur is not None:   # (_sum_load inline: a reserve and an end each)
                self._mirror_tick += 1
                self._mirror_gen[wid] = self._mirror_tick
                r = cur.requests + sign
                t = cur.tokens + sign * c.tokens
                pt = cur.prefill_tokens + sign * c.prefill_tokens
                n = cur.prefills + sign * p
                mirror[wid] = Load(r if r > 0 else 0, t if t > 0 else 0, pt if pt > 0 else 0, n if n > 0 else 0)

    def _answered_behind(self) -> None:
        """The oldest write-behind call's reply came (replies, and so these callbacks, come in
        the order sent): Redis's loads include it from now on."""
        charges, sign = self._behind.popleft()
        unconfirmed = self._unconfirmed
        for c in charges:
            u = unconfirmed[c.worker_id]
            u[0] -= sign
            u[1] -= sign * c.tokens
            u[2] -= sign * c.prefill_tokens
            u[3] -= sign if c.prefill_tokens > 0 else 0
            u[4] -= 1
            if not u[4]:
                del unconfirmed[c.worker_id]

    def _behind_call(self, args: list[Any], end_of: str | None) -> bool:
        """Send a write-behind reserve (``end_of`` None) or end (of that request) in the call
        that carries this loop turn's others (``_BEHIND``: one script call and one reply for
        all of them, redis_wire.Batch); False when no connection is open (the caller then
        awaits Redis)."""
        assert self.wire is not None
        batch = self.wire.batch_nowait(_BEHIND, self._behind_head, args)
        if batch is None:
            return False
        if not batch.ops:
            batch.future.add_done_callback(functools.partial(self._behind_done, batch.ops))
        batch.ops.append(end_of)
        return True

    def _behind_done(self, ops: list[str | None], fut: asyncio.Future) -> None:
        """The reply to one call of write-behind reserves and ends (``ops``: None for a
        reserve, the request id for an end, in order)."""
        if self.loads_max_age_s:
            for _ in ops:
                self._answered_behind()
        exc: BaseException | None = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if exc is None and isinstance(fut.result(), hiredis_error):
            exc = redis_wire.error_of(fut.result())
            if isinstance(exc, NoScriptError) and self.wire is not None:
                self.wire.unloaded(_BEHIND)   # Redis's script cache was flushed: EVAL it next time
        if exc is None:
            self._mirror_reply(fut.result()[1])
            return
        # Nothing of it or a part of it ran (an error stops a script where it is): a reserve is
        # counted lost (Redis may lack its charge), an end handed to lost_ends (replaying an
        # end that did run finds no record: harmless).
        for request_id in ops:
            self.write_behind_failures += 1
            if request_id is None:
                log.warning("a write-behind reserve failed (%s: %s); Redis lacks that charge",
                            type(exc).__name__, str(exc)[:200])
            elif self.lost_ends is not None:
                self.lost_ends(request_id, exc)
            else:
                log.warning("a write-behind end failed (%s: %s); Redis may keep request %s's load until "
                            "the replica sweep", type(exc).__name__, str(exc)[:200], request_id)

    def _ledger_reply(self, reply: list) -> RequestRecord | None:
        record, flat = reply
        self._mirror_reply(flat)
        return self._record(record)

    def _mirror_reply(self, flat: list) -> None:
        """The loads a ledger script changed, as they are now, into the load mirror."""
        if self.loads_max_age_s and flat:
            gen, watched, mirror, tick = self._mirror_gen, self._watched, self._mirror, self._mirror_tick
            for i in range(0, len(flat), 5):
                wid = flat[i]
                tick += 1
                gen[wid] = tick
                if wid in watched:
                    mirror[wid] = self._reported(wid, flat[i + 1:i + 5])
            self._mirror_tick = tick

    def _reported(self, wid: str, values: list[Any]) -> Load:
        """A load as Redis reported it (HMGET's or a script's four amounts), plus this replica's
        charges still on their way there (less its ends on their way): ``_with_unconfirmed``
        of ``_load`` building one Load (every reply's every worker)."""
        r, t, p, n = values
        u = self._unconfirmed.get(wid)
        if u is None:
            if r is None and t is None:
                return IDLE
            return Load(int(r or 0), int(t or 0), int(p or 0), int(n or 0))
        r, t, p, n = int(r or 0) + u[0], int(t or 0) + u[1], int(p or 0) + u[2], int(n or 0) + u[3]
        return Load(r if r > 0 else 0, t if t > 0 else 0, p if p > 0 else 0, n if n > 0 else 0)

    def _with_unconfirmed(self, wid: str, load: Load) -> Load:
        """A load as Redis reported it, plus this replica's charges still on their way there
        (less its ends on their way)."""
        u = self._unconfirmed.get(wid)
        if u is None:
            return load
        return _sum_load(load, 1, u[0], u[1], u[2], u[3])

    def _remember(self, record: RequestRecord | None, request_id: str) -> None:
        """What this replica's own call learnt of a request it reserved (write-behind ends)."""
        mine = self._mine
        if request_id in mine:
            if record is None:
                mine.pop(request_id)
            else:
                mine.put(record)

    # ------------------------------------------------------------------ specs

    @_unavailable
    async def put_spec(self, spec: WorkerSpec) -> None:
        await self._put_spec(args=[self.prefix, spec.id, encode_spec(spec)])

    @_unavailable
    async def remove_spec(self, worker_id: str) -> WorkerSpec | None:
        raw = await self._remove_spec(args=[self.prefix, worker_id])
        return decode_spec(raw) if raw else None

    @_unavailable
    async def specs(self) -> list[WorkerSpec]:
        return [decode_spec(raw) for raw in (await self.redis.hgetall(self._k_spec)).values()]

    # -- operators' removals (controlplane/admin_state.py): every replica refuses the removed
    # engine's registration, not only the one that answered omni-ctl remove
    @_unavailable
    async def put_fence(self, worker_id: str, record: dict) -> None:
        await self.redis.hset(self.prefix + "fences", worker_id, orjson.dumps(record).decode())

    @_unavailable
    async def drop_fence(self, worker_id: str) -> None:
        await self.redis.hdel(self.prefix + "fences", worker_id)

    @_unavailable
    async def fences(self) -> dict[str, dict]:
        return {wid: orjson.loads(raw) for wid, raw in (await self.redis.hgetall(self.prefix + "fences")).items()}

    @_unavailable
    async def spec_version(self) -> int:
        """Bumped by every spec change: poll it to know when to re-read ``specs()``."""
        return int(await self.redis.get(self._k_ver) or 0)

    @_unavailable
    async def specs_versioned(self) -> tuple[int, list[WorkerSpec]]:
        """The specs and the version they are at, read together (one MULTI)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            ver, specs = await pipe.get(self._k_ver).hgetall(self._k_spec).execute()
        return int(ver or 0), [decode_spec(raw) for raw in specs.values()]

    @_unavailable
    async def spec_epoch(self) -> str:
        """An id of this store's contents, made when the first replica reads it: a Redis that
        restarted without its data (or was flushed) has none, and the next call makes a
        new one. A replica that sees the epoch change knows the specs it read before were
        lost, not removed (``SpecSync`` writes them back)."""
        return str(await self._spec_epoch(args=[self.prefix, uuid.uuid4().hex]))

    async def watch_specs(self) -> AsyncIterator[SpecChange]:
        """Spec changes as they happen (Redis pub/sub), from any replica, this one included.

        Pub/sub loses what is published while the connection is down: when this raises
        :class:`StoreUnavailable`, re-read every spec (``specs_versioned``) before watching
        again. ``controlplane.state.sync.SpecSync`` does that.
        """
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            try:
                await pubsub.subscribe(self.spec_channel)
            except _UNAVAILABLE as exc:
                _reraise_cancel()
                raise StoreUnavailable(f"redis at {self.url_for_logs}: cannot subscribe ({exc})") from exc
            while True:
                # A cancel swallowed by redis-py (in subscribe, or a reconnect or health
                # check inside get_message) must not leave this waiting for a message
                # forever: the next read blocks without a timeout, and its canceller waits.
                _reraise_cancel()
                try:
                    msg = await pubsub.get_message(timeout=None)
                except _UNAVAILABLE as exc:
                    _reraise_cancel()
                    raise StoreUnavailable(f"redis at {self.url_for_logs}: spec channel lost ({exc})") from exc
                if msg is None or msg.get("type") != "message":
                    continue
                kind, _, rest = str(msg["data"]).partition(" ")
                wid, _, ver = rest.rpartition(" ")
                yield SpecChange(kind, wid, int(ver) if ver.isdigit() else 0)
        finally:
            try:
                await pubsub.aclose()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    # ------------------------------------------------------------------ ledger

    async def reserve(self, record: RequestRecord, charges: tuple[Charge, ...], *, charged: bool = False,
                      **notes) -> RequestRecord | None:
        # (Not wrapped by _unavailable: a write-behind reserve awaits nothing; _reserve_now is.)
        # A new record's charges as it ends up with them (the script writes them as they are):
        # its own (``charged``: ``charges``, added to the loads by the script), or a template's
        # own, kept but not added to any load as MemoryStore does, and ``charges``.
        args: list[Any] = ["r", record.request_id, f"{self.replica_id}:{next(self._ops)}", record.session,
                           repr(self._to_wall(record.orphaned_at)) if record.orphaned_at else "",
                           _charges_json(record.charges if charged else record.charges + tuple(charges))]
        enc = self._encode_record(record)
        args += [len(enc) // 2, *enc]
        enc = self._encode_fields(notes)
        args += [len(enc) // 2, *enc]
        args.append(len(charges))
        for c in charges:
            args += (c.worker_id, c.leg, int(c.tokens), int(c.prefill_tokens))
        if self.write_behind and self.wire is not None:   # (write-behind runs on the wire client)
            if self._behind_call(args, None):
                if self.loads_max_age_s:   # this replica sees its own charge at once
                    if not self._riding and time.monotonic() - self._mirror_at > RIDE_REFRESH_S:
                        self._refresh_with_writes()
                    self._sent_behind(charges, 1)
                if not charged:
                    record = dataclasses.replace(record, charges=record.charges + tuple(charges), **notes)
                self._mine.put(record)
                return record
        return await self._reserve_now(record, args)

    @_unavailable
    async def _reserve_now(self, record: RequestRecord, args: list[Any]) -> RequestRecord | None:
        """A reserve answered by Redis (``args``: ``reserve``'s). None for a late reserve of a
        request that had already ended (see end(tombstone_s=))."""
        args[0:1] = self._behind_head
        answered = self._ledger_reply(await self._script(self._reserve, _RESERVE, args))
        if answered is not None and self.write_behind:
            self._mine.put(answered)
        else:
            self._remember(answered, record.request_id)
        return answered

    @_unavailable
    async def release(self, request_id: str, *, leg: str = "", worker_id: str = "") -> RequestRecord | None:
        record = self._ledger_reply(
            await self._script_soon(self._release, _RELEASE, [self.prefix, request_id, leg, worker_id]))
        self._remember(record, request_id)
        return record

    async def end(self, request_id: str, *, tombstone_s: float = 0.0) -> RequestRecord | None:
        """With ``tombstone_s``, an end that finds no record leaves a tombstone for that long:
        a reserve of that request arriving later charges nothing. For ends whose reserve may
        still be on its way (one that timed out against a stalled Redis runs when Redis
        wakes up, perhaps after the end): ``ResilientStore`` passes it.

        **Write-behind** (with ``write_behind``, for a request this replica reserved): the
        end is answered at once with the record as this replica last knew it, and sent with
        the loop turn's other calls; the load mirror drops its charges at once. One Redis
        did not confirm goes to ``lost_ends`` (the ResilientStore replays it)."""
        if not tombstone_s and self.write_behind:
            record = self._mine.pop(request_id)
            if record is not None:
                if self._behind_call(["e", request_id], request_id):
                    if self.loads_max_age_s:
                        self._sent_behind(record.charges, -1)
                    return record
        return await self._end_now(request_id, tombstone_s)

    @_unavailable
    async def _end_now(self, request_id: str, tombstone_s: float) -> RequestRecord | None:
        ttl_ms = str(max(0, int(tombstone_s * 1000)))
        return self._ledger_reply(await self._script_soon(self._end, _END, [self.prefix, request_id, ttl_ms]))

    @_unavailable
    async def settle_prefill(self, request_id: str) -> RequestRecord | None:
        record = self._ledger_reply(await self._script_soon(self._settle, _SETTLE, [self.prefix, request_id]))
        self._remember(record, request_id)
        return record

    @_unavailable
    async def get(self, request_id: str) -> RequestRecord | None:
        if self.wire is not None:
            record = self._record(await self.wire.call_soon("HGETALL", self._k_rec + request_id))
        else:
            record = self._record(await self.redis.hgetall(self._k_rec + request_id))
        self._remember(record, request_id)
        return record

    @_unavailable
    async def records(self) -> list[RequestRecord]:
        # Every record is in its replica's set, or orphaned by a sweep (see the module's keys).
        replicas = await self.redis.smembers(self._k_replicas)
        async with self.redis.pipeline(transaction=False) as pipe:
            for rep in replicas:
                pipe.smembers(self._k_rep + rep)
            pipe.zrange(self._k_orphans, 0, -1)
            *owned, orphaned = await pipe.execute()
        ids = set(orphaned).union(*owned)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(self._k_rec + rid)
            rows = await pipe.execute()
        return [r for r in map(self._record, rows) if r is not None]

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        # Every placement's: from the load copy when it is fresh and holds every worker (no
        # wrapper, no list, no second pass over the ids), else _loads_waiting, which may wait for Redis.
        if self.loads_max_age_s and time.monotonic() - self._mirror_at <= self.loads_max_age_s:
            if not isinstance(worker_ids, (list, tuple)):
                worker_ids = list(worker_ids)
            mirror = self._mirror
            try:
                return {w: mirror[w] for w in worker_ids}
            except KeyError:
                pass
        return await self._loads_waiting(worker_ids)

    @_unavailable
    async def _loads_waiting(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        ids = list(worker_ids)
        if not ids:
            return {}
        if not self.loads_max_age_s:
            return await self._read_loads(ids)
        mirror = self._mirror
        age = time.monotonic() - self._mirror_at
        if age > self.loads_max_age_s or not all(w in mirror for w in ids):
            self._watched.update(ids)
            if self._refreshing is None:   # one refresh for a burst of placements
                self._refreshing = asyncio.ensure_future(self._refresh_mirror())
                self._refreshing.add_done_callback(self._refreshed)
            # Stale but not old, and every worker in it: answer now, fresher next time. A
            # placement never waits for the refresh that keeps the copy current; only one
            # that finds a worker missing, or a copy older than mirror_wait_s (Redis has not
            # answered a refresh for that long), waits for Redis.
            if age > self.mirror_wait_s or not all(w in mirror for w in ids):
                await asyncio.shield(self._refreshing)
        return {w: mirror.get(w, IDLE) for w in ids}

    def _refresh_with_writes(self) -> None:
        """Refresh the copy in the write that carries this turn's reserves (no send of its
        own): while this replica places, other replicas' charges reach it within
        ``RIDE_REFRESH_S`` and a round trip instead of ``loads_max_age_s``."""
        ids = list(self._watched)
        assert self.wire is not None
        fut = self.wire.pipeline_nowait([("HMGET", self._k_load + wid, *_LOAD_FIELDS) for wid in ids])
        if fut is None:
            return
        self._riding = True
        fut.add_done_callback(functools.partial(self._rode, ids, time.monotonic(), self._mirror_tick))

    def _rode(self, ids: list[str], started: float, tick: int, fut: asyncio.Future) -> None:
        self._riding = False
        if fut.cancelled() or fut.exception() is not None:
            return   # (an outage: the next placement's loads() finds out)
        rows = fut.result()
        if any(isinstance(row, hiredis_error) for row in rows):
            return
        gen = self._mirror_gen
        for wid, row in zip(ids, rows, strict=False):
            if gen.get(wid, 0) <= tick:   # not changed by one of our own calls meanwhile
                self._mirror[wid] = self._reported(wid, row)
        self._mirror_at = max(self._mirror_at, started)

    def _refreshed(self, fut: asyncio.Future) -> None:
        self._refreshing = None
        if not fut.cancelled():
            fut.exception()   # retrieved here; the waiters got it too

    async def _refresh_mirror(self) -> None:
        started, tick = time.monotonic(), self._mirror_tick
        ids = list(self._watched)
        fresh = await self._read_loads(ids)
        gen = self._mirror_gen
        for wid, load in fresh.items():
            if gen.get(wid, 0) <= tick:   # not changed by one of our own calls meanwhile
                self._mirror[wid] = self._with_unconfirmed(wid, load)
        self._mirror_at = started

    async def _read_loads(self, ids: list[str]) -> dict[str, Load]:
        prefix = self._k_load
        if self.wire is not None:   # HMGETs in one write: ~0.2 us each in Redis, a Lua call ~10 us
            if len(ids) == 1:
                return {ids[0]: _load(await self.wire.call("HMGET", prefix + ids[0], *_LOAD_FIELDS))}
            rows = await self.wire.pipeline([("HMGET", prefix + wid, *_LOAD_FIELDS) for wid in ids])
            return {wid: _load(row) for wid, row in zip(ids, rows, strict=False)}
        if len(ids) == 1:
            return {ids[0]: _load(await self.redis.hmget(prefix + ids[0], _LOAD_FIELDS))}
        flat = await self._script(self._loads, _LOADS, [], [prefix + wid for wid in ids])
        return {wid: _load(flat[4 * i:4 * i + 4]) for i, wid in enumerate(ids)}

    @_unavailable
    async def forget_worker(self, worker_id: str) -> Load:
        self._mirror.pop(worker_id, None)
        self._watched.discard(worker_id)
        return _load(await self._forget(args=[self.prefix, worker_id]))

    @_unavailable
    async def orphan(self, session: str, now: float) -> int:
        # (their records change owner: their ends are awaited, answered with Redis's record)
        self._mine.pop_session(session)   # O(its own records: state/owned.py)
        return int(await self._orphan(args=[self.prefix, session, repr(self._to_wall(now))]))

    @_unavailable
    async def claim(self, session: str, request_ids: Iterable[str]) -> int:
        ids = list(request_ids)
        if not ids:
            return 0
        for rid in ids:
            self._mine.pop(rid)
        return int(await self._claim(args=[self.prefix, session, self.replica_id, *ids]))

    @_unavailable
    async def orphans(self, cutoff: float) -> list[str]:
        return list(await self.redis.zrangebyscore(self._k_orphans, "(0", repr(self._to_wall(cutoff))))

    # ------------------------------------------------------------------ replicas

    @_unavailable
    async def heartbeat(self) -> None:
        """This replica is alive for ``replica_ttl_s`` more; call every ttl/3 or so."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k_alive + self.replica_id, "1", px=self.replica_ttl_ms)
            pipe.sadd(self._k_replicas, self.replica_id)
            await pipe.execute()

    @_unavailable
    async def sweep(self, *, orphan_at: float | None = None) -> list[str]:
        """Release what replicas whose heartbeat expired held; returns the request ids.

        With ``orphan_at`` (a ``time.monotonic()`` value), their records are orphaned at
        that time instead: a data plane that fails over to another replica can still claim
        them, and ``Lifecycle.release_orphans`` releases the rest after the session grace.
        """
        replicas = [r for r in await self.redis.smembers(self._k_replicas) if r != self.replica_id]
        if not replicas:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for rep in replicas:
                pipe.exists(self._k_alive + rep)
            alive = await pipe.execute()
        mode, now = ("end", "0") if orphan_at is None else ("orphan", repr(self._to_wall(orphan_at)))
        released: list[str] = []
        for rep, up in zip(replicas, alive, strict=False):
            if not up:
                done = await self._sweep(args=[self.prefix, rep, mode, now])
                if done:
                    log.warning("replica %s stopped heartbeating: %s %d of its requests", rep,
                                "released" if mode == "end" else "orphaned", len(done))
                released += done
        return released

    async def maintain(self, interval_s: float | None = None, *, orphan: bool = True) -> None:
        """Heartbeat and sweep forever (run it as a task; cancel it to stop).

        Redis being away is logged once per outage and retried every interval.
        """
        interval = interval_s if interval_s is not None else self.replica_ttl_ms / 3000
        down = False
        while True:
            _reraise_cancel()   # redis-py can swallow a cancel that lands mid-call
            try:
                await self.heartbeat()
                await self.sweep(orphan_at=time.monotonic() if orphan else None)
                if down:
                    log.warning("redis at %s is back", self.url_for_logs)
                down = False
            except StoreUnavailable as exc:
                _reraise_cancel()
                if not down:
                    log.error("%s", exc)
                down = True
            _reraise_cancel()   # not a whole interval later: stop() waits for this task
            await asyncio.sleep(interval)
