"""Decode vLLM ``KVEventBatch`` msgpack payloads into typed events.

vLLM encodes the batch with msgspec. Versions differ in ways a fleet may mix at once:

* events are *arrays* ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window]`` in older vLLM
  (``array_like=True``; trailing fields absent in even older ones), and *maps* with the tag under
  ``"type"`` after vLLM PR #42892 (``omit_defaults``: absent keys mean ``None``);
* the envelope is an array ``[ts, events, data_parallel_rank]`` in every capture seen, but one
  stored source declares it as a map, so both are accepted;
* block hashes are ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or raw digests
  (bytes). Both are folded to the 64-bit event form: last 8 bytes, big-endian, which is what vLLM
  itself does for the int form. Negative ints (i64 readers) are folded the same way.

Unknown event types and unknown/extra fields are ignored so newer engines keep working. Anything
structurally wrong raises :class:`MalformedEventError`; the caller counts it and moves on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

MASK64 = (1 << 64) - 1
_INT_ONLY = {int}

# Positional field names of the array form, in declaration order (vllm/distributed/kv_events.py).
BLOCK_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                       "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                       "kv_cache_spec_sliding_window")
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedEventError(ValueError):
    """A payload that is not a decodable KVEventBatch; counted by the caller, never fatal."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that became cached. ``parent_block_hash`` is None when the run starts at block 0."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the engine's prefix cache."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset (``/reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published message. ``ignored`` counts events of types this decoder does not know."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    ignored: int = 0


def fold_hash(h: Any) -> int:
    """Event-form 64-bit hash from an int or a raw digest (last 8 bytes, big-endian)."""
    if type(h) is int:
        return h & MASK64
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not b:
            raise MalformedEventError("empty block hash")
        return int.from_bytes(b[-8:], "big")
    raise MalformedEventError(f"block hash of type {type(h).__name__}")


def _opt_hash(h: Any) -> int | None:
    return None if h is None else fold_hash(h)


def _hashes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise MalformedEventError("block_hashes is not a list")
    # vLLM's default form (ints already in 0..2^64-1) checked and copied in C: a long prompt's
    # BlockStored has thousands of them, and an eviction is a BlockRemoved of one per block.
    if len(v) == 1:
        h = v[0]
        return (h,) if type(h) is int and 0 <= h <= MASK64 else (fold_hash(h),)
    if v and set(map(type, v)) == _INT_ONLY and min(v) >= 0 and max(v) <= MASK64:
        return tuple(v)
    return tuple(fold_hash(h) for h in v)


def _opt(v: Any, kind: type | tuple[type, ...], name: str) -> Any:
    if v is None or isinstance(v, kind):
        return v
    raise MalformedEventError(f"{name} has type {type(v).__name__}")


def _fields(ev: Any) -> tuple[str | None, dict[str, Any]]:
    """(tag, fields) for either wire form; tag None means not an event at all."""
    if isinstance(ev, dict):
        tag = ev.get("type")
        if not isinstance(tag, str):
            raise MalformedEventError("event map without a string 'type'")
        return tag, ev
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        tag = ev[0]
        names = (BLOCK_STORED_FIELDS if tag == "BlockStored"
                 else BLOCK_REMOVED_FIELDS if tag == "BlockRemoved" else ())
        return tag, dict(zip(names, ev[1:], strict=False))  # extra trailing values are dropped
    raise MalformedEventError(f"event of type {type(ev).__name__}")


def _removed(f: dict[str, Any]) -> tuple[Sequence[int], str | None, int | None]:
    """A ``BlockRemoved``'s fields, checked: (hashes in the event form, medium, group_idx). The
    hashes are the decoded list itself when it is one hash of vLLM's default form."""
    hs = f.get("block_hashes")
    if hs is None and "block_hashes" not in f:
        raise MalformedEventError("BlockRemoved without block_hashes")
    medium, group = f.get("medium"), f.get("group_idx")
    if medium is not None and type(medium) is not str or group is not None and type(group) is not int:
        medium, group = _opt(medium, str, "medium"), _opt(group, int, "group_idx")   # raises, or a subclass
    if type(hs) is list and len(hs) == 1 and type(hs[0]) is int and 0 <= hs[0] <= MASK64:
        return hs, medium, group
    return _hashes(hs), medium, group


def decode_event(ev: Any) -> KVEvent | None:
    """One event in either wire form; None for an unknown (ignored) event type."""
    if type(ev) is dict:        # vLLM's current form: no copy of the fields needed
        tag = ev.get("type")
        if type(tag) is str:
            return _build(tag, ev)
    tag, f = _fields(ev)
    return _build(tag, f)


def _build(tag: str | None, f: dict[str, Any]) -> KVEvent | None:
    """The event named ``tag`` from its fields by name (both wire forms end up here)."""
    if tag == "BlockRemoved":   # first: an eviction is one per block
        hs, medium, group = _removed(f)
        return BlockRemoved(tuple(hs), medium, group)
    if tag == "BlockStored":
        if "block_hashes" not in f:
            raise MalformedEventError("BlockStored without block_hashes")
        tokens = f.get("token_ids") or ()
        if not isinstance(tokens, (list, tuple)):
            raise MalformedEventError("token_ids is not a list")
        block_size = f.get("block_size")
        if type(block_size) is not int or block_size <= 0:
            raise MalformedEventError(f"bad block_size {block_size!r}")
        extra = f.get("extra_keys")
        if extra is not None and not isinstance(extra, (list, tuple)):
            raise MalformedEventError("extra_keys is not a list")
        return BlockStored(
            block_hashes=_hashes(f["block_hashes"]),
            parent_block_hash=_opt_hash(f.get("parent_block_hash")),
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_id=_opt(f.get("lora_id"), int, "lora_id"),
            medium=_opt(f.get("medium"), str, "medium"),
            lora_name=_opt(f.get("lora_name"), str, "lora_name"),
            extra_keys=None if extra is None else tuple(extra),
            group_idx=_opt(f.get("group_idx"), int, "group_idx"),
            kv_cache_spec_kind=_opt(f.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


# msgpack's first byte of an object -> the length of its header if a map (fixmap, map 16, map 32)
# or an array (fixarray, array 16, array 32), else 0.
_MAP_HEADER = bytes(1 if 0x80 <= b <= 0x8F else 3 if b == 0xDE else 5 if b == 0xDF else 0 for b in range(256))
_ARRAY_HEADER = bytes(1 if 0x90 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else 0 for b in range(256))
_STORED = msgpack.packb("BlockStored")
_TYPE_STORED = msgpack.packb("type") + _STORED


class BatchReader:
    """One payload decoded an event at a time, so a caller may stop between events.

    Why: a long prompt's batch is thousands of events (4,096 ``BlockRemoved`` of one hash each
    when it is evicted, ~30 ms to decode whole on this project's 2-core machine). Decoded in one
    go on the control plane's event loop it holds every placement that long; read through this,
    the subscriber decodes a slice, lets the loop answer placements, and goes on. The array
    envelope (every vLLM seen) is unpacked as it is read (``msgpack.Unpacker``); a map envelope
    is unpacked whole first. Every error raises :class:`MalformedEventError`, as ``decode_batch``.

    ``tokens=False`` leaves every event's ``token_ids`` empty without building them: vLLM sends
    a block's tokens with it (16 ints a block: 65,536 for a long prompt's ``BlockStored``, ~1.5 ms
    for msgpack to build as one list and as long to copy) and the control plane never reads
    them. Each event of the array envelope is then read field by field and the tokens' array is
    skipped in C (``Unpacker.skip``); whether they are a list is still checked, their items are
    not (as before, except that text inside them is no longer decoded). Everything else decodes
    exactly as with ``tokens=True``, which builds and keeps them.

    ``merge_removals=True`` returns a run of ``BlockRemoved`` events of one medium and group read
    by one :meth:`read` as one event with all their hashes, in order: vLLM sends one per evicted
    block, and a Python object per block is most of what decoding them costs. Applied to an index
    it is the same (removals commute with removals; the run ends at any other event).
    """

    __slots__ = ("_dp", "_events", "_merge", "_payload", "_skip_tokens", "_stored_until", "_tail", "_unpacker",
                 "remaining", "ts")

    def __init__(self, payload: bytes, *, tokens: bool = True, merge_removals: bool = False) -> None:
        self._payload = payload
        self._skip_tokens = not tokens
        self._merge = merge_removals
        # No BlockStored's tag past this offset (one C search): the events after it are unpacked
        # whole without looking at them first.
        self._stored_until = payload.rfind(_STORED) + 1 if not tokens else 0
        self._unpacker: msgpack.Unpacker | None = None
        self._events: Any = None        # an iterator over the map envelope's events
        self._tail = 0                   # array envelope: items after the events
        self._dp: Any = None
        u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
        try:
            u.feed(payload)
            n = u.read_array_header()
        except Exception:  # noqa: BLE001 - msgpack raises unrelated types   # not an array (a map envelope, or garbage): unpack it whole
            ts, evs, self._dp = self._whole(payload)
            self._events = iter(evs)
            self.remaining = len(evs)
        else:
            if n < 2:
                raise MalformedEventError("batch of type list")
            try:
                ts = u.unpack()
            except Exception as e:  # noqa: BLE001 - msgpack raises unrelated types
                raise MalformedEventError(f"not msgpack: {e.__class__.__name__}") from None
            try:
                self.remaining = u.read_array_header()
            except Exception:  # noqa: BLE001 - msgpack raises unrelated types
                raise MalformedEventError("batch events is not a list") from None
            self._unpacker, self._tail = u, n - 2
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            raise MalformedEventError("batch ts is not a number")
        self.ts = float(ts)

    @staticmethod
    def _whole(payload: bytes) -> tuple[Any, list[Any] | tuple[Any, ...], Any]:
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as e:  # noqa: BLE001 - msgpack raises unrelated types  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
            raise MalformedEventError(f"not msgpack: {e.__class__.__name__}") from None
        if not isinstance(obj, dict):
            raise MalformedEventError(f"batch of type {type(obj).__name__}")
        evs = obj.get("events")
        if not isinstance(evs, (list, tuple)):
            raise MalformedEventError("batch events is not a list")
        return obj.get("ts"), evs, obj.get("data_parallel_rank")

    def read(self, out: list[KVEvent], limit: int) -> int:
        """Decode up to ``limit`` more events into ``out``; returns how many were of unknown types."""
        ignored = 0
        u = self._unpacker
        merge = self._merge
        run: list[int] | None = None            # merge_removals: the hashes of the current run
        run_of: tuple[Any, Any] = (None, None)  # its (medium, group_idx)
        for _ in range(min(limit, self.remaining)):
            self.remaining -= 1
            if u is not None:
                try:
                    if u.tell() < self._stored_until and self._stored_next(u):
                        d = self._fields_read(u)
                    else:
                        raw = u.unpack()
                        if merge and type(raw) is dict and raw.get("type") == "BlockRemoved":
                            hs, medium, group = _removed(raw)
                            if run is not None and run_of == (medium, group):
                                run += hs
                            else:
                                if run is not None:
                                    out.append(BlockRemoved(tuple(run), *run_of))
                                run, run_of = list(hs), (medium, group)
                            continue
                        d = decode_event(raw)
                except MalformedEventError:
                    raise
                except Exception as e:  # noqa: BLE001 - msgpack raises unrelated types
                    raise MalformedEventError(f"not msgpack: {e.__class__.__name__}") from None
            else:
                d = decode_event(next(self._events))
            if self._skip_tokens and type(d) is BlockStored and d.token_ids:
                d = dataclasses.replace(d, token_ids=())   # read whole: a map envelope, an unusual encoding
            if run is not None:
                out.append(BlockRemoved(tuple(run), *run_of))
                run = None
            if d is None:
                ignored += 1
            else:
                out.append(d)
        if run is not None:
            out.append(BlockRemoved(tuple(run), *run_of))
        return ignored

    def _stored_next(self, u: msgpack.Unpacker) -> bool:
        """Whether the next event is a ``BlockStored`` as vLLM (msgspec) encodes it: a map whose
        first key is ``type`` or an array, then the tag. Only those are read field by field;
        every other event is unpacked whole, in one C call (cheaper for a ``BlockRemoved`` of
        one hash). Either way decodes the same."""
        pos, p = u.tell(), self._payload
        if pos >= len(p):
            return False
        b = p[pos]
        n = _MAP_HEADER[b]
        if n:
            return p.startswith(_TYPE_STORED, pos + n)
        n = _ARRAY_HEADER[b]
        return bool(n) and p.startswith(_STORED, pos + n)

    def _fields_read(self, u: msgpack.Unpacker) -> KVEvent | None:
        """The next event, read field by field with its tokens skipped (see ``_tokens``)."""
        b = self._first(u)
        if _MAP_HEADER[b]:
            f: dict[Any, Any] = {}
            for _ in range(u.read_map_header()):
                k = u.unpack()
                f[k] = self._tokens(u) if k == "token_ids" else u.unpack()
            tag = f.get("type")
            if not isinstance(tag, str):
                raise MalformedEventError("event map without a string 'type'")
            return _build(tag, f)
        if _ARRAY_HEADER[b]:
            n = u.read_array_header()
            tag = u.unpack() if n else None
            if not isinstance(tag, str):
                raise MalformedEventError("event of type list")
            names = (BLOCK_STORED_FIELDS if tag == "BlockStored"
                     else BLOCK_REMOVED_FIELDS if tag == "BlockRemoved" else ())
            f = {}
            for i in range(n - 1):
                name = names[i] if i < len(names) else None
                if name is None:
                    u.unpack()          # extra trailing values are dropped (unpacked: still checked)
                else:
                    f[name] = self._tokens(u) if name == "token_ids" else u.unpack()
            return _build(tag, f)
        return decode_event(u.unpack())     # not an event: decode_event says what is wrong

    def _first(self, u: msgpack.Unpacker) -> int:
        """The next object's first byte (what it is)."""
        pos = u.tell()
        if pos >= len(self._payload):
            raise MalformedEventError("not msgpack: OutOfData")
        return self._payload[pos]

    def _tokens(self, u: msgpack.Unpacker) -> Any:
        """A ``token_ids`` value: an array is skipped (and stands as empty), anything else is
        unpacked for ``_build`` to judge, as if read whole."""
        if _ARRAY_HEADER[self._first(u)]:
            u.skip()
            return ()
        return u.unpack()

    def finish(self) -> int | None:
        """After the last event: the batch's data-parallel rank (the payload must end there)."""
        if self.remaining:
            raise MalformedEventError("events left unread")
        dp = self._dp
        u = self._unpacker
        if u is not None:
            try:
                if self._tail:
                    dp = u.unpack()
                    for _ in range(self._tail - 1):
                        u.skip()
                u.unpack()
            except msgpack.OutOfData:
                pass    # the payload ended where it should
            except Exception as e:  # noqa: BLE001 - msgpack raises unrelated types
                raise MalformedEventError(f"not msgpack: {e.__class__.__name__}") from None
            else:
                raise MalformedEventError("not msgpack: ExtraData")
        if dp is not None and type(dp) is not int:
            raise MalformedEventError("data_parallel_rank is not an int")
        return dp


def decode_batch(payload: bytes, *, tokens: bool = True, merge_removals: bool = False) -> KVEventBatch:
    """Decode one PUB/replay payload. Raises MalformedEventError on anything structurally wrong.
    ``tokens=False``: every ``token_ids`` left empty, never built; ``merge_removals``: runs of
    ``BlockRemoved`` as one event (see :class:`BatchReader`)."""
    reader = BatchReader(payload, tokens=tokens, merge_removals=merge_removals)
    out: list[KVEvent] = []
    ignored = reader.read(out, reader.remaining)
    dp = reader.finish()
    return KVEventBatch(ts=reader.ts, events=tuple(out), data_parallel_rank=dp, ignored=ignored)
