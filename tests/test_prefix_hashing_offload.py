"""The data plane's block-hash chain is the same wherever it is computed: inline, in a
thread, or in the hashing process (long prompts), and the process goes with the hasher."""

from __future__ import annotations

import random

import pytest

from dataplane import prefix
from dataplane.prefix import PrefixHasher
from kvhash.hashing import BlockHashConfig, BlockHasher
from protos import omni_proxy_pb2 as pb

CFG = pb.KVHashConfig(enabled=True, block_size=16, algo="sha256", seed="0", seed_set=True)


def expected(ids: list[int], salt: str | None) -> list[int]:
    hasher = BlockHasher(BlockHashConfig(block_size=16, algo="sha256", python_hash_seed="0"))
    usable = (len(ids) - 1) // 16 * 16
    return hasher.event_hashes(ids[:usable], cache_salt=salt)


@pytest.mark.parametrize("blocks", [3, prefix.INLINE_MAX_BLOCKS + 5, prefix.PROCESS_MIN_BLOCKS + 7])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
async def test_every_path_gives_the_engines_chain(blocks, salt):
    rng = random.Random(blocks)
    ids = [rng.randrange(200_000) for _ in range(blocks * 16 + 1)]
    hasher = PrefixHasher()
    try:
        chain = await hasher.chain(CFG, ids, salt)
        assert chain == expected(ids, salt) and len(chain) == blocks
        went_to_process = hasher.process._pool is not None
        assert went_to_process is (blocks >= prefix.PROCESS_MIN_BLOCKS)
    finally:
        hasher.close()
    assert hasher.process._pool is None


async def test_ids_beyond_64_bits_fall_back_to_a_thread():
    ids = [2**70] + list(range(prefix.PROCESS_MIN_BLOCKS * 16 + 1))
    hasher = PrefixHasher()
    try:
        assert await hasher.chain(CFG, ids, None) == expected(ids, None)
    finally:
        hasher.close()


@pytest.mark.parametrize("blocks", [3, prefix.INLINE_MAX_BLOCKS + 5, prefix.PROCESS_MIN_BLOCKS + 7])
@pytest.mark.parametrize("fmt", ["tuple", "name"])
async def test_a_lora_request_hashes_with_its_adapter(blocks, fmt):
    """A request naming a LoRA adapter gets the chain vLLM computes for it (the adapter's key
    on every block, in the configured format), on every path; never the base model's."""
    rng = random.Random(blocks)
    ids = [rng.randrange(200_000) for _ in range(blocks * 16 + 1)]
    cfg = pb.KVHashConfig(enabled=True, block_size=16, algo="sha256", seed="0", seed_set=True, lora_key_format=fmt)
    engine = BlockHasher(BlockHashConfig(block_size=16, algo="sha256", python_hash_seed="0", lora_key_format=fmt))
    usable = ids[:blocks * 16]
    hasher = PrefixHasher()
    try:
        chain = await hasher.chain(cfg, ids, "salt", ("sql-lora", "/adapters/sql"))
        base = await hasher.chain(cfg, ids, "salt")
    finally:
        hasher.close()
    assert chain == engine.event_hashes(usable, cache_salt="salt", lora_name="sql-lora", lora_path="/adapters/sql")
    assert base == engine.event_hashes(usable, cache_salt="salt")
    assert not set(chain) & set(base)

