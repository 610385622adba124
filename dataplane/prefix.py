"""The prompt's vLLM block-hash chain, computed in the data plane.

The data plane has the token ids, and hashing here spreads the cost over the stateless
replicas instead of the one control plane. The engines' hashing settings arrive with the
control-plane session (SessionInfo.kv_hash); nothing is computed when placement does not
use the prefix cache.
"""

from __future__ import annotations

import asyncio
import logging

from kvhash.hashing import BlockHashConfig, BlockHasher, UnreproducibleHashError
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

# Above this many blocks the hashing runs off the event loop (about 1 ms per 1,000 blocks).
INLINE_MAX_BLOCKS = 256


class PrefixHasher:
    def __init__(self) -> None:
        self._key: tuple | None = None
        self._hasher: BlockHasher | None = None

    def _hasher_for(self, cfg: pb.KVHashConfig) -> BlockHasher | None:
        key = (cfg.block_size, cfg.algo, cfg.seed, cfg.seed_set, cfg.lora_key_format)
        if key != self._key:
            self._key = key
            try:
                self._hasher = BlockHasher(BlockHashConfig(
                    block_size=cfg.block_size or 16, algo=cfg.algo or "sha256",
                    python_hash_seed=cfg.seed if cfg.seed_set else None,
                    lora_key_format=cfg.lora_key_format or "tuple"))
            except (UnreproducibleHashError, ValueError) as exc:
                log.warning("prefix-cache hashing disabled: %s", exc)
                self._hasher = None
        return self._hasher

    async def chain(self, cfg: pb.KVHashConfig, token_ids: list[int] | None, cache_salt: str | None) -> list[int]:
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
        ids = token_ids[:usable]
        if usable // max(cfg.block_size, 1) <= INLINE_MAX_BLOCKS:
            return hasher.event_hashes(ids, cache_salt=salt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: hasher.event_hashes(ids, cache_salt=salt))
