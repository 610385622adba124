"""KV-index snapshots in Redis: a restarted control-plane replica is warm before it serves.

Every replica answers lookups from its own in-memory index (``KVCache.exact``, fed by KV
events, and ``KVCache.approx``, fed by routing); this module only makes that index survive a
restart. Only with the Redis store (``[state] backend = "redis"``); the memory store does nothing.

**Writing.** Every ``[kv_cache] snapshot_interval_s`` (default 3 s; 0 turns snapshots off), if the
index changed since the last write, a replica writes its whole index as one binary value:

    P kv:snap:<replica_id>   string  the snapshot (below), expiring after SNAPSHOT_TTL_S
    P kv:snaps               zset    replica id -> wall-clock time of its snapshot

One key per replica: replicas never overwrite each other and no lock is needed. A stopping
replica writes a last snapshot, so a clean restart loses nothing. After each write a replica
deletes the snapshots older than its own of replicas whose heartbeat key (``P alive:<id>``,
see ``state/redis.py``) is gone, so restarts (a new replica id each) do not pile them up;
an unchanged index only has its key's expiry renewed.

**Loading.** At start, after the fleet is known and before the subscribers start and the gRPC
server serves, the newest snapshot (by its ``kv:snaps`` time) is loaded into the empty index;
an unreadable one (bad magic, checksum, header, lengths, or another hashing configuration) is
skipped with one log line and the next newest is tried. Only workers in the fleet are loaded:
exact entries only for workers that publish KV events, routed ones for any worker; routed
entries keep their age, so those older than ``approx_ttl_s`` are not loaded and the rest expire
when they would have. Hashes that do not fit 64 bits are not saved.

**Events after a load.** For event-fed workers the snapshot holds the last sequence number each
subscriber had seen (per DP rank and topic). A rank with a replay endpoint starts from it: the
first live message shows a gap, which the subscriber replays (or, when the engine's buffer
no longer covers it, resets that worker: the index is then rebuilt from new events, as without
a snapshot). A rank without replay just follows new events from the restored entries. A
sequence number may be a little ahead of the index when the snapshot was taken during a
replay; re-applying events is harmless, missing a few is the same loss a gap without replay is.

**Format** (little-endian)::

    b"OKVS1" | u32 header length | header (JSON) | u32 crc32 of the body | body

The body is the concatenation of ``array('Q')`` runs; the header lists them in order, each
``[kind, worker_id, dp_rank, bucket, count]`` (kind "e" exact, "a" routed; bucket: the index
of its routing time bucket in ``header["buckets"]``, a list of wall-clock start times, or -1),
plus the hashing settings and the subscribers' sequence numbers. A run lists one slot's blocks
shard by shard, each shard in its LRU order (oldest first), so loading into an index of the same
``max_blocks`` (hence shards) keeps the order eviction follows. The size
is bounded by the index's own bound: at most ``max_blocks`` distinct blocks per index, 8 bytes
per (block, slot) pair.

**Not stalling the loop.** The dump copies the index's keys and values shard by shard (C-level
list copies of one shard, ~8,192 blocks at the default cap, each consistent), yielding to the
loop every ``CHUNK`` entries, then packs them into per-slot arrays in chunks of ``CHUNK``
entries, yielding between chunks, and frees the copies in steps too; the Redis write is
asynchronous. At 1M blocks the longest step went from 40 ms of CPU (the copy in one step, and
freeing it at the end) to ~6 ms (joining the snapshot's bytes). Shards copied at different moments make a
snapshot of no single moment, which loading tolerates: the subscribers' sequence numbers are
read before the copy starts, so what the events changed during it is replayed over it
(re-applying an event is harmless, see above); routed marks whose bucket expired meanwhile
are left out (their bucket is read after the copy). Slot owners are read after the copy too;
if a slot was freed meanwhile (``generation`` moved: it may belong to another worker now)
that index is copied again in one step.

**Stopping.** ``KVSnapshots.start`` runs the writer in a task it owns and ``close`` stops it
with a flag as well as a cancel: a cancel alone can be lost. redis-py sends each command under
``asyncio.wait_for`` when the client has a socket timeout, and before Python 3.12 ``wait_for``
returns the result instead of raising when the cancel lands just after the send finished
(CPython gh-86296). A loop that ended only on ``CancelledError`` then went on writing forever,
and the control plane's ``stop()`` waited for it forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import sys
import time
import zlib
from array import array
from collections.abc import Iterable
from typing import Any

from controlplane.kvcache.index import _STAMP, _STAMP_BITS, PrefixIndex
from controlplane.kvcache.manager import KVCache

log = logging.getLogger(__name__)

MAGIC = b"OKVS1"
SNAPSHOT_TTL_S = 7 * 86400
CHUNK = 2048     # entries packed (or copied) between yields to the loop: a few ms of Python at most
_U32 = struct.Struct("<I")


class CorruptSnapshot(ValueError):
    pass


def hashing_of(kv: KVCache) -> dict[str, Any]:
    c = kv.config
    return {"block_size": c.block_size, "hash_algo": c.hash_algo, "hash_seed": c.hash_seed,
            "lora_key_format": c.lora_key_format}


def index_version(kv: KVCache) -> tuple:
    """Changes whenever the index may have (stores, removals, touches, expiry)."""
    return (*kv.exact.version(), *kv.approx.version(), kv.routed.last_bucket, len(kv.routed.expiry))


def _seqs(kv: KVCache) -> dict[str, dict[str, dict[str, int]]]:
    """worker id -> rank -> topic (hex) -> last seq seen."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for wid, per_rank in kv.event_seqs().items():
        ranks = {str(rank): {t.hex(): s for t, s in seqs.items()} for rank, seqs in enumerate(per_rank) if seqs}
        if ranks:
            out[wid] = ranks
    return out


async def dump(kv: KVCache, *, chunk: int = CHUNK, now: float | None = None) -> bytes:
    """The index as one snapshot (see the module docstring)."""
    exact, approx = kv.exact, kv.approx
    # The sequence numbers first, then the indexes shard by shard (see "Not stalling the
    # loop"), then the routing buckets.
    seqs = _seqs(kv)
    wall = time.time() if now is None else now
    (e_keys, e_vals), e_owner = await _copy(exact, chunk)
    (a_keys, a_vals), a_owner = await _copy(approx, chunk)
    offset = wall - time.monotonic()
    buckets = [(number, start + offset) for number, start, _ in kv.routed.expiry]
    bucket_pos = {number: i for i, (number, _) in enumerate(buckets)}

    runs: dict[tuple[str, int, int], array] = {}   # (kind slot index, slot, bucket) -> hashes

    async def pack(keys: list[int], vals: list[int], kind: str, shift: int) -> None:
        targets: dict[int, list] = {}
        for lo in range(0, len(keys), chunk):
            if lo:
                await asyncio.sleep(0)
            for h, v in zip(keys[lo:lo + chunk], vals[lo:lo + chunk], strict=False):
                t = targets.get(v)
                if t is None:
                    mask = v >> shift
                    b = bucket_pos.get(v & _STAMP, -2) if shift else -1
                    t = []
                    if b != -2:
                        while mask:
                            low = mask & -mask
                            key = (kind, low.bit_length() - 1, b)
                            arr = runs.get(key)
                            if arr is None:
                                arr = runs[key] = array("Q")
                            t.append(arr.append)
                            mask ^= low
                    if len(targets) > 65536:
                        targets.clear()
                    targets[v] = t
                if h >> 64 or h < 0:
                    continue
                for append in t:
                    append(h)

    await pack(e_keys, e_vals, "e", 0)
    await pack(a_keys, a_vals, "a", _STAMP_BITS)
    for copied in (e_keys, e_vals, a_keys, a_vals):   # freed in steps too (2M references: ~20 ms at once)
        while copied:
            del copied[-8 * chunk:]
            await asyncio.sleep(0)
    entries, parts = [], []
    for (kind, slot, b), arr in runs.items():
        owner = (e_owner if kind == "e" else a_owner)[slot]
        if owner is None or not arr:
            continue
        if sys.byteorder != "little":
            arr.byteswap()
        entries.append([kind, owner[0], owner[1], b, len(arr)])
        parts.append(arr)
    header = json.dumps({"ts": wall, "hashing": hashing_of(kv), "buckets": [w for _, w in buckets],
                         "runs": entries, "seqs": seqs, "routed_stride": approx.stride},
                        separators=(",", ":")).encode()
    body, crc, done = bytearray(), 0, 0
    for arr in parts:                 # copied in pieces, yielding between them
        body += arr
        crc = zlib.crc32(memoryview(arr).cast("B"), crc)
        done += len(arr)
        if done >= 8 * chunk:
            done = 0
            await asyncio.sleep(0)
    return b"".join((MAGIC, _U32.pack(len(header)), header, _U32.pack(crc), body))


async def _copy(index: PrefixIndex, chunk: int) -> tuple[tuple[list[int], list[int]], list]:
    """``index.entries()`` and its slots' owners, copied a shard at a time (each consistent),
    yielding to the loop every ``chunk`` entries or so; in one step when a slot was freed
    meanwhile (its bit may name another worker now)."""
    generation = index.generation
    keys: list[int] = []
    vals: list[int] = []
    done = 0
    for shard in index._shards:
        keys += shard
        vals += shard.values()
        done += len(shard)
        if done >= chunk:
            done = 0
            await asyncio.sleep(0)
    if done:
        await asyncio.sleep(0)   # (what follows copies the next index, or packs)
    if index.generation != generation:
        return index.entries(), list(index._key_of)
    return (keys, vals), list(index._key_of)


def parse(blob: bytes) -> tuple[dict[str, Any], list[tuple[str, str, int, int, array]]]:
    """(header, runs as (kind, worker id, rank, bucket, hashes)); CorruptSnapshot if unreadable."""
    try:
        if not blob.startswith(MAGIC):
            raise CorruptSnapshot("bad magic")
        pos = len(MAGIC)
        (hlen,) = _U32.unpack_from(blob, pos)
        pos += 4
        header = json.loads(blob[pos:pos + hlen])
        pos += hlen
        (crc,) = _U32.unpack_from(blob, pos)
        pos += 4
        body = memoryview(blob)[pos:]
        if zlib.crc32(body) != crc:
            raise CorruptSnapshot("checksum mismatch")
        runs, off = [], 0
        for kind, wid, rank, bucket, n in header["runs"]:
            if kind not in ("e", "a") or not isinstance(wid, str) or n < 0 or off + 8 * n > len(body):
                raise CorruptSnapshot("bad run table")
            arr = array("Q")
            arr.frombytes(body[off:off + 8 * n])
            if sys.byteorder != "little":
                arr.byteswap()
            runs.append((kind, wid, int(rank), int(bucket), arr))
            off += 8 * n
        if off != len(body):
            raise CorruptSnapshot("body length does not match the run table")
        float(header["ts"])
        [float(w) for w in header["buckets"]]
        return header, runs
    except CorruptSnapshot:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformation is the same answer
        raise CorruptSnapshot(f"{type(exc).__name__}: {exc}") from None


def load(kv: KVCache, header: dict[str, Any], runs, specs: Iterable, *, now: float | None = None) -> dict[str, int]:
    """Load a parsed snapshot into ``kv`` (whose index should be empty): only workers among
    ``specs``; returns blocks loaded per kind. Resume points for the subscribers are left in
    ``kv.resume_seqs``, used by ``KVCache.watch``."""
    by_id = {s.id: s for s in specs}
    wall = time.time() if now is None else now
    mono = time.monotonic()
    ttl = kv.config.approx_ttl_s
    loaded = {"exact": 0, "approx": 0}
    # routed runs grouped by bucket, oldest bucket first (expiry queue order)
    by_bucket: dict[int, list] = {}
    # Routed marks are read at depths that are multiples of the stride (index.RoutedIndex): marks
    # of another stride would be misread, except every-block ones (stride 1, older snapshots).
    routed_ok = header.get("routed_stride", 1) in (1, kv.approx.stride)
    for kind, wid, rank, bucket, arr in runs:
        spec = by_id.get(wid)
        if spec is None:
            continue
        if kind == "e":
            if not spec.kv_events:
                continue
            kv.exact.store((wid, rank), arr[::-1].tolist(), None)   # store() walks it backwards
            kv.exact.may_have_holes((wid, rank))    # (a slot's blocks, not one chain)
            loaded["exact"] += len(arr)
        elif routed_ok:
            by_bucket.setdefault(bucket, []).append((wid, rank, arr))
    starts = header["buckets"]
    for b in sorted(by_bucket):
        if not 0 <= b < len(starts) or wall - starts[b] >= ttl:
            continue                       # expired meanwhile (or no known bucket)
        kv.routed.last_bucket += 1
        number = kv.routed.last_bucket
        blocks = array("Q")
        for wid, rank, arr in by_bucket[b]:
            blocks.extend(kv.approx.mark((wid, rank), arr[::-1].tolist(), number))   # marks as they were
            loaded["approx"] += len(arr)
        kv.routed.expiry.append((number, mono - (wall - starts[b]), blocks))
    for wid, ranks in (header.get("seqs") or {}).items():
        if wid in by_id and by_id[wid].kv_events:
            for rank, topics in ranks.items():
                kv.resume_seqs[(wid, int(rank))] = {bytes.fromhex(t): int(s) for t, s in topics.items()}
    return loaded


def binary_client(store):
    """A bytes-speaking client on the store's Redis (the store's own decodes replies as text)."""
    import redis.asyncio as aioredis

    pool = store.redis.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(decode_responses=False, socket_timeout=30.0)
    return aioredis.Redis(connection_pool=aioredis.ConnectionPool(connection_class=pool.connection_class,
                                                                   max_connections=2, **kwargs))


class KVSnapshots:
    """Periodic snapshots of one replica's index in Redis, and loading the newest at start."""

    def __init__(self, kv: KVCache, store, interval_s: float) -> None:
        self.kv = kv
        self.interval_s = interval_s
        self.replica_id = store.replica_id
        prefix = store.prefix
        self._k_snap, self._k_index = prefix + "kv:snap:", prefix + "kv:snaps"
        self._k_alive = prefix + "alive:"          # RedisStore's heartbeat keys
        self.redis = binary_client(store)
        self._written: tuple | None = None
        self._failing = False
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.last_bytes = 0
        self.last_dump_s = 0.0
        self.writes = 0

    async def load_newest(self, specs: Iterable) -> str | None:
        """Load the newest readable snapshot; returns the replica id it came from, or None."""
        specs = list(specs)
        try:
            ids = await self.redis.zrevrange(self._k_index, 0, -1)
        except Exception as exc:  # noqa: BLE001 - no Redis: start cold, say why
            log.warning("KV index snapshots: cannot list them (%s): starting with an empty index", exc)
            return None
        for rid in ids:
            rid = rid.decode() if isinstance(rid, bytes) else rid
            try:
                blob = await self.redis.get(self._k_snap + rid)
            except Exception as exc:  # noqa: BLE001
                log.warning("KV index snapshots: cannot read %s's (%s): starting with an empty index", rid, exc)
                return None
            if blob is None:
                continue                   # expired
            try:
                header, runs = parse(blob)
            except CorruptSnapshot as exc:
                log.warning("KV index snapshot of replica %s ignored: unreadable (%s)", rid, exc)
                continue
            if header.get("hashing") != hashing_of(self.kv):
                log.warning("KV index snapshot of replica %s ignored: taken with other hashing settings %s",
                            rid, header.get("hashing"))
                continue
            t0 = time.perf_counter()
            got = load(self.kv, header, runs, specs)
            log.info("KV index loaded from replica %s's snapshot (%.1fs old): %d exact and %d routed entries "
                     "in %.2fs", rid, time.time() - header["ts"], got["exact"], got["approx"],
                     time.perf_counter() - t0)
            return rid
        return None

    async def save(self, *, force: bool = False) -> int:
        """Write a snapshot if the index changed since the last one; returns its size (0: none)."""
        version = index_version(self.kv)
        if version == self._written and not force:
            await self.redis.expire(self._k_snap + self.replica_id, SNAPSHOT_TTL_S)
            return 0
        t0 = time.perf_counter()
        blob = await dump(self.kv)
        self.last_dump_s = time.perf_counter() - t0
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k_snap + self.replica_id, blob, ex=SNAPSHOT_TTL_S)
            pipe.zadd(self._k_index, {self.replica_id: time.time()})
            await pipe.execute()
        self._written = version
        self.last_bytes = len(blob)
        self.writes += 1
        await self._prune()
        return len(blob)

    async def _prune(self) -> None:
        """Delete the snapshots of replicas that are gone (no heartbeat key) and older than
        this one's: a new replica id per process must not leave a snapshot per restart."""
        ours = await self.redis.zscore(self._k_index, self.replica_id)
        if ours is None:
            return
        scored = [(r.decode() if isinstance(r, bytes) else r, score)
                  for r, score in await self.redis.zrange(self._k_index, 0, -1, withscores=True)]
        others = [r for r, score in scored if r != self.replica_id and score < ours]
        if not others:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in others:
                pipe.exists(self._k_alive + r)
            alive = await pipe.execute()
        gone = [r for r, up in zip(others, alive, strict=False) if not up]
        if gone:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(self._k_index, *gone)
                pipe.delete(*[self._k_snap + r for r in gone])
                await pipe.execute()

    def start(self) -> None:
        """Write every ``interval_s`` in a task of its own, until :meth:`close`."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="kv-snapshots")

    async def run(self) -> None:
        # Ends on the flag close() sets, not only on the cancel that follows it: a cancel
        # landing inside a Redis call can be swallowed (see "Stopping" above), and the
        # call then returns normally.
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            if self._stopping:
                return
            try:
                await self.save()
                if self._failing:
                    self._failing = False
                    log.warning("KV index snapshots: writing again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away: try again next time
                if not self._failing:
                    self._failing = True
                    log.warning("KV index snapshots: cannot write (%s); retrying every %.1fs", exc, self.interval_s)

    async def close(self, *, final: bool = True) -> None:
        """Stop the writer (at most the snapshot it is writing is finished, each Redis call
        bounded by the client's socket timeout), then write a last snapshot (``final``, at
        most 5 s) and close the connections."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if final:
            try:
                await asyncio.wait_for(self.save(), 5.0)
            except Exception as exc:  # noqa: BLE001
                log.warning("KV index snapshots: last snapshot not written (%s)", exc)
        await self.redis.aclose()
