"""The prompt's vLLM block-hash chain, computed in the data plane.

The data plane has the token ids, and hashing here spreads the cost over the stateless
replicas instead of the one control plane. The engines' hashing settings arrive with the
control-plane session (SessionInfo.kv_hash); nothing is computed when placement does not
use the prefix cache.

Where it runs, by chain length: short chains inline; longer ones in a thread; long ones in a
separate process (``HashProcess``). vLLM's hash is per-block Python (a pickle and a sha256 of
each 16-token block) that holds the GIL: in a thread, a 50k-token prompt still took the event
loop from every other request in 0.5 ms slices for ~5 ms, and a burst of them stretched
placements by tens of ms (bench/burst.py). The process gets the token ids as JSON (orjson
writes 85k ids in ~0.7 ms on the event loop; packing them with ``array("q")`` took ~2.3 ms) and
answers the chain as packed 64-bit integers. When the ids went into the engine's body
(completions), that body's JSON of them is passed on as it is, with the count to hash: no
second dumps and no slice of the list on the loop (~0.9 ms for 70k ids). The process runs at
the bulk priority (``--bulk-nice``, :mod:`dataplane.bulk_priority`; the data plane's own by
default).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import cast

import orjson

from dataplane.bulk_priority import BulkPriority, lower_this_thread
from kvhash.hashing import BlockHashConfig, BlockHasher, LoraKeyFormat, UnreproducibleHashError
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

# Above this many blocks the hashing runs off the event loop (about 1 ms per 1,000 blocks).
INLINE_MAX_BLOCKS = 256
# From this many blocks on it runs in another process (packing the ids costs ~1 % of hashing).
# Not from INLINE_MAX_BLOCKS on, even with the ids' JSON at hand: for 10-16k-token prompts the
# process cost 2.0 ms of CPU per chain against 1.5 ms in a thread (the transfer, the process's
# JSON parse), for ~0.3-1 ms of the loop's GIL turns saved, and the burst did not show a gain.
PROCESS_MIN_BLOCKS = 1024

# In a hashing process: one BlockHasher per hashing configuration (the process's own cache).
_worker_hashers: dict[BlockHashConfig, BlockHasher] = {}

# A LoRA adapter a request names: (its served name, its path). vLLM adds it to every block's
# hash (kvhash's lora_key), so an adapter's blocks never match the base model's.
Lora = tuple[str, str]


def _hash_packed(config: BlockHashConfig, packed: bytes, salt: str | None, lora: Lora | None = None,
                 usable: int | None = None) -> bytes:
    """Runs in the hashing process: the event-form chain of the ids (a JSON array; the first
    ``usable`` of them when given), packed."""
    hasher = _worker_hashers.get(config)
    if hasher is None:
        hasher = _worker_hashers[config] = BlockHasher(config)
    ids = orjson.loads(packed)
    if usable is not None:
        del ids[usable:]
    return array("Q", _event_hashes(hasher, ids, salt, lora)).tobytes()


def _event_hashes(hasher: BlockHasher, ids: list[int], salt: str | None, lora: Lora | None) -> list[int]:
    if lora is None:
        return hasher.event_hashes(ids, cache_salt=salt)
    return hasher.event_hashes(ids, cache_salt=salt, lora_name=lora[0], lora_path=lora[1])


class HashProcess:
    """One process (started on first use, by spawn: the data plane has threads and a loop)
    that hashes long chains, at ``priority``; closed with the data plane, and gone with it if it
    dies."""

    def __init__(self, priority: BulkPriority = 0) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self.priority = priority

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # its one thread hashes: lowering it lowers the process
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=lower_this_thread, initargs=(self.priority,))
        return self._pool

    async def event_hashes(self, config: BlockHashConfig, ids: list[int], salt: str | None,
                           lora: Lora | None = None, *, ids_json: bytes | None = None,
                           usable: int | None = None) -> list[int] | None:
        """The chain, or None when the ids cannot be sent (beyond 64 bits) or the process
        failed (the caller hashes in a thread instead). ``ids_json``: the ids already as JSON,
        of which the process hashes the first ``usable`` (no second dumps here)."""
        if ids_json is None:
            try:
                ids_json = orjson.dumps(ids)
            except orjson.JSONEncodeError:
                return None
            usable = None
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._executor(), _hash_packed, config, ids_json, salt, lora, usable)
        except BrokenProcessPool:
            log.warning("the block-hashing process died; hashing in threads until a new one starts")
            self._pool = None
            return None
        hashes = array("Q")
        hashes.frombytes(out)
        return hashes.tolist()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class PrefixHasher:
    def __init__(self, priority: BulkPriority = 0) -> None:
        self._key: tuple | None = None
        self._hasher: BlockHasher | None = None
        self.process = HashProcess(priority)

    def close(self) -> None:
        self.process.close()

    def _hasher_for(self, cfg: pb.KVHashConfig) -> BlockHasher | None:
        key = (cfg.block_size, cfg.algo, cfg.seed, cfg.seed_set, cfg.lora_key_format)
        if key != self._key:
            self._key = key
            try:
                self._hasher = BlockHasher(BlockHashConfig(
                    block_size=cfg.block_size or 16, algo=cfg.algo or "sha256",
                    python_hash_seed=cfg.seed if cfg.seed_set else None,
                    # BlockHashConfig rejects a format it does not know (ValueError below)
                    lora_key_format=cast(LoraKeyFormat, cfg.lora_key_format or "tuple")))
            except (UnreproducibleHashError, ValueError) as exc:
                log.warning("prefix-cache hashing disabled: %s", exc)
                self._hasher = None
        return self._hasher

    async def chain(self, cfg: pb.KVHashConfig, token_ids: list[int] | None, cache_salt: str | None,
                    lora: Lora | None = None, *, ids_json: bytes | None = None) -> list[int]:
        """The chain vLLM computes for the prompt; ``lora``: the adapter the request names;
        ``ids_json``: ``token_ids`` as JSON, when the caller has it (the hashing process then
        takes those bytes)."""
        if not cfg.enabled or not token_ids:
            return []
        hasher = self._hasher_for(cfg)
        if hasher is None:
            return []
        salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
        # vLLM always computes at least the last prompt token, so it can reuse at most
        # (n - 1) // block_size cached blocks: hash exactly those, so that a predicted hit is
        # one the engine can really have.
        usable = (len(token_ids) - 1) // max(cfg.block_size, 1) * max(cfg.block_size, 1)
        if not usable:
            return []
        blocks = usable // max(cfg.block_size, 1)
        if blocks >= PROCESS_MIN_BLOCKS and ids_json is not None:
            chain = await self.process.event_hashes(hasher.config, token_ids, salt, lora, ids_json=ids_json,
                                                    usable=usable)
            if chain is not None:
                return chain
        ids = token_ids[:usable]
        if blocks <= INLINE_MAX_BLOCKS:
            return _event_hashes(hasher, ids, salt, lora)
        if blocks >= PROCESS_MIN_BLOCKS and ids_json is None:
            chain = await self.process.event_hashes(hasher.config, ids, salt, lora)
            if chain is not None:
                return chain
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _event_hashes, hasher, ids, salt, lora)
