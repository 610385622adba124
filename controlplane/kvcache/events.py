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

from dataclasses import dataclass
from typing import Any

import msgpack

MASK64 = (1 << 64) - 1

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


def decode_event(ev: Any) -> KVEvent | None:
    """One event in either wire form; None for an unknown (ignored) event type."""
    tag, f = _fields(ev)
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
    if tag == "BlockRemoved":
        if "block_hashes" not in f:
            raise MalformedEventError("BlockRemoved without block_hashes")
        return BlockRemoved(
            block_hashes=_hashes(f["block_hashes"]),
            medium=_opt(f.get("medium"), str, "medium"),
            group_idx=_opt(f.get("group_idx"), int, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


class BatchReader:
    """One payload decoded an event at a time, so a caller may stop between events.

    Why: a long prompt's batch is thousands of events (4,096 ``BlockRemoved`` of one hash each
    when it is evicted, ~30 ms to decode whole on this project's 2-core machine). Decoded in one
    go on the control plane's event loop it holds every placement that long; read through this,
    the subscriber decodes a slice, lets the loop answer placements, and goes on. The array
    envelope (every vLLM seen) is unpacked as it is read (``msgpack.Unpacker``); a map envelope
    is unpacked whole first. Every error raises :class:`MalformedEventError`, as ``decode_batch``.
    """

    __slots__ = ("_dp", "_events", "_tail", "_unpacker", "remaining", "ts")

    def __init__(self, payload: bytes) -> None:
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
        for _ in range(min(limit, self.remaining)):
            self.remaining -= 1
            if u is not None:
                try:
                    raw = u.unpack()
                except Exception as e:  # noqa: BLE001 - msgpack raises unrelated types
                    raise MalformedEventError(f"not msgpack: {e.__class__.__name__}") from None
            else:
                raw = next(self._events)
            d = decode_event(raw)
            if d is None:
                ignored += 1
            else:
                out.append(d)
        return ignored

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


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one PUB/replay payload. Raises MalformedEventError on anything structurally wrong."""
    reader = BatchReader(payload)
    out: list[KVEvent] = []
    ignored = reader.read(out, reader.remaining)
    dp = reader.finish()
    return KVEventBatch(ts=reader.ts, events=tuple(out), data_parallel_rank=dp, ignored=ignored)
