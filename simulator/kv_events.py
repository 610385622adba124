"""KV-cache events over ZMQ, as vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``).

Wire format (checked against vllm 0.32.0's code):

* PUB socket; it *binds* when the endpoint contains ``*`` or ``::`` or starts with ``ipc://`` /
  ``inproc://``, and *connects* otherwise (vLLM's heuristic: ``tcp://0.0.0.0:5557`` connects).
  ``tcp://*:0`` binds a free port, reported as ``port``.
* Each engine step with events sends ``[topic, seq (8 bytes big-endian), payload]``; seq counts
  from 0 per publisher. ``payload`` is msgpack of the batch ``[ts, [events...], data_parallel_rank]``.
* Events, ``--kv-events-format map`` (vLLM >= v0.26, after PR #42892; msgspec ``tag=True`` and
  ``omit_defaults``, so ``None``-default fields are left out)::

      {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h|None, "token_ids": [...],
       "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
       "extra_keys": [None|[salt], ...], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
      {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
      {"type": "AllBlocksCleared"}

  ``array`` (older vLLM, ``array_like=True``: every field, in declaration order)::

      ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
       extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]
      ["BlockRemoved", hashes, medium, group_idx]
      ["AllBlocksCleared"]

  Hashes are the 64-bit ints of ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (vLLM's default), or
  the raw digests when that is 0. One BlockRemoved per evicted hash, as vLLM sends them.
* Replay: a ROUTER that always binds. A request ``[client_id, b"", start_seq]`` (a DEALER sends
  ``[b"", start_seq]``) is answered, for each buffered batch with ``seq >= start_seq``, with
  ``[client_id, b"", topic, seq, payload]`` and then ``[client_id, b"", b"", END_SEQ, b""]``
  (vLLM >= v0.26, PR #45177, as 0.32 does); with the ``array`` format the older frames
  ``[client_id, b"", seq, payload]`` and ``[client_id, b"", END_SEQ, b""]``. The buffer keeps
  the last ``buffer_steps`` batches.

Unlike vLLM (a publisher thread fed by a queue) everything runs on the sim's event loop: the
PUB socket never blocks (at the high-water mark ZMQ drops, as it does for vLLM).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvhash.hashing import to_event_hash
from omni_runtime import cancel_and_wait
from simulator.block_pool import Cleared, PoolEvent, Removed, Stored
from simulator.config import SimConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"
KV_CACHE_SPEC_KIND = "full_attention"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest. Also bind a
    tcp endpoint with port 0 (``tcp://127.0.0.1:0``): nobody can connect to port 0, so it can
    only mean "bind a free port" (reported in the ready file)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or (endpoint.startswith("tcp://") and endpoint_port(endpoint) == 0))


def endpoint_port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (``tcp://*:0`` gets a free port)."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://"):
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        port = endpoint_port(bound)
        if port is not None:
            return f"{endpoint.rsplit(':', 1)[0]}:{port}"
    return endpoint


def encode_events(events: list[PoolEvent], *, fmt: str = "map", int_hashes: bool = True) -> list[Any]:
    """Pool events in vLLM's wire form (``fmt`` "map" or "array")."""
    conv = to_event_hash if int_hashes else bytes
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, Stored):
            hashes = [conv(h) for h in ev.block_hashes]
            parent = None if ev.parent_block_hash is None else conv(ev.parent_block_hash)
            extra = [None if k is None else list(k) for k in ev.extra_keys] or None
            if fmt == "map":
                out.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                            "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": None,
                            "medium": MEDIUM_GPU, "lora_name": None, "extra_keys": extra, "group_idx": 0,
                            "kv_cache_spec_kind": KV_CACHE_SPEC_KIND})
            else:
                out.append(["BlockStored", hashes, parent, list(ev.token_ids), ev.block_size, None, MEDIUM_GPU,
                            None, extra, 0, KV_CACHE_SPEC_KIND, None])
        elif isinstance(ev, Removed):
            h = [conv(ev.block_hash)]
            if fmt == "map":
                out.append({"type": "BlockRemoved", "block_hashes": h, "medium": MEDIUM_GPU, "group_idx": 0})
            else:
                out.append(["BlockRemoved", h, MEDIUM_GPU, 0])
        elif isinstance(ev, Cleared):
            out.append({"type": "AllBlocksCleared"} if fmt == "map" else ["AllBlocksCleared"])
    return out


def encode_batch(events: list[Any], ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    """``KVEventBatch`` (array-like envelope in every vLLM version) as msgpack."""
    return msgpack.packb([time.time() if ts is None else ts, events, data_parallel_rank], use_bin_type=True)


class KvEventPublisher:
    """One engine's PUB socket, replay buffer and ROUTER; ``publish`` is called by the engine."""

    def __init__(self, cfg: SimConfig) -> None:
        assert cfg.kv_events_endpoint
        self.cfg = cfg
        self.topic = cfg.kv_events_topic.encode()
        self.fmt = cfg.kv_events_format
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.kv_events_buffer_steps)
        self._seq = 0
        self.events_published = 0
        self.replays_served = 0
        self._ctx = zmq.asyncio.Context()
        self._sync: zmq.Context = zmq.Context.shadow(self._ctx.underlying)
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.endpoint: str = cfg.kv_events_endpoint
        self.replay_endpoint: str | None = cfg.kv_events_replay_endpoint
        self.dp_rank = 0   # put in every batch, as vLLM's publisher of that DP rank does

    @property
    def batches_published(self) -> int:
        return self._seq

    @property
    def port(self) -> int | None:
        return endpoint_port(self.endpoint)

    @property
    def replay_port(self) -> int | None:
        return endpoint_port(self.replay_endpoint)

    def start(self) -> None:
        pub = self._sync.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self.cfg.kv_events_hwm)
        if is_bind_endpoint(self.endpoint):
            self.endpoint = _bind(pub, self.endpoint)
        else:
            pub.connect(self.endpoint)
        self._pub = pub
        if self.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(router, self.replay_endpoint)
            self._router = router
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-events-replay")
        log.info("KV events: PUB %s (%s), replay %s, topic %r, format %s", self.endpoint,
                 "bound" if is_bind_endpoint(self.cfg.kv_events_endpoint or "") else "connected",
                 self.replay_endpoint, self.cfg.kv_events_topic, self.fmt)

    def publish(self, events: list[PoolEvent]) -> None:
        """One batch (one engine step); numbered, sent and kept for replay."""
        if self._pub is None or not events:
            return
        payload = encode_batch(encode_events(events, fmt=self.fmt, int_hashes=self.cfg.kv_events_int_hashes),
                               data_parallel_rank=self.dp_rank)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # only possible for a connecting PUB with no peer yet; vLLM drops too
            pass
        self._buffer.append((seq, payload))
        self.events_published += len(events)

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("Invalid replay request: %d frames", len(frames))
                continue
            client_id, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            # Snapshot: batches published while we send do not join this answer.
            for seq, payload in list(self._buffer):
                if seq >= start:
                    if self.fmt == "map":
                        await router.send_multipart((client_id, b"", self.topic, seq.to_bytes(8, "big"), payload))
                    else:
                        await router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
            if self.fmt == "map":
                await router.send_multipart((client_id, b"", b"", END_SEQ, b""))
            else:
                await router.send_multipart((client_id, b"", END_SEQ, b""))
            self.replays_served += 1

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._ctx.term()
