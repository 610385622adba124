"""vLLM v1 prefix-cache block hashes, computed outside the engine.

Why: to ask the prefix index "which worker already holds this prompt's KV", the router must name
the prompt's blocks exactly as the engines name them in their KV events. vLLM (v1, checked against
vllm 0.32.0's own code, see tests/data/make_vllm_block_hashes.py) computes, per *full* block i:

    NONE_HASH = H(seed)                     # seed is a str, see below
    h_i       = H((h_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))

and publishes ``int.from_bytes(h_i, "big") & (2**64 - 1)`` in events (the *event form*); the chain
itself always uses the full digest, so a child can never be derived from a 64-bit parent.

H is picked by ``--prefix-caching-hash-algo``:
  sha256      = sha256(pickle.dumps(x, HIGHEST_PROTOCOL))   (Python-only, the default)
  sha256_cbor = sha256(cbor2.dumps(x, canonical=True))
  xxhash      = xxh3_128(pickle ...),  xxhash_cbor = xxh3_128(cbor ...)

Seed: the engines' ``PYTHONHASHSEED`` when set. When unset, vLLM >= the "fixed default seed"
change uses ``"vllm-none-hash"`` for sha256*, and ``os.urandom`` for xxhash* (older vLLM used
os.urandom for every algorithm). A random seed makes exact matching impossible; that is raised as
:class:`UnreproducibleHashError` at construction rather than silently producing useless hashes.

Extra keys (``generate_block_hash_extra_keys``), in tuple order lora, multimodal, cache_salt,
prompt-embeds; ``None`` when empty. LoRA adds a key to *every* block: ``("lora", name, path)`` in
vllm 0.32.0, the bare ``name`` in older versions (``lora_key_format``). ``cache_salt`` adds
``("cache_salt", salt)`` to the *first* block only. Multimodal and prompt-embeds keys are not
reproduced here (the router does not see the engine's mm feature identifiers).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
LoraKeyFormat = Literal["tuple", "name"]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
MASK64 = (1 << 64) - 1
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


class UnreproducibleHashError(ValueError):
    """The engines' NONE_HASH is random per process, so no external hash can match theirs."""


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The digest function vLLM uses for ``--prefix-caching-hash-algo algo``."""
    sha256 = hashlib.sha256
    if algo == "sha256":
        dumps = pickle.dumps
        return lambda x: sha256(dumps(x, _PICKLE_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        import cbor2
        cdumps = cbor2.dumps
        return lambda x: sha256(cdumps(x, canonical=True)).digest()
    if algo == "xxhash":
        import xxhash
        xxh = xxhash.xxh3_128_digest
        dumps = pickle.dumps
        return lambda x: xxh(dumps(x, _PICKLE_PROTOCOL))
    if algo == "xxhash_cbor":
        import cbor2
        import xxhash
        xxh = xxhash.xxh3_128_digest
        cdumps = cbor2.dumps
        return lambda x: xxh(cdumps(x, canonical=True))
    raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; expected one of {HASH_ALGOS}")


@dataclass(frozen=True)
class BlockHashConfig:
    """What must match the engines' settings for hashes to be comparable.

    ``python_hash_seed`` is the engines' PYTHONHASHSEED string, None when they leave it unset.
    ``unset_seed_fallback`` is the seed vLLM uses for sha256* when unset ("vllm-none-hash" in
    current vLLM); set it to None for old vLLM versions that used os.urandom for every algorithm.
    """

    block_size: int = 16
    algo: str = "sha256"
    python_hash_seed: str | None = None
    unset_seed_fallback: str | None = DEFAULT_NONE_HASH_SEED
    lora_key_format: LoraKeyFormat = "tuple"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.algo not in HASH_ALGOS:
            raise ValueError(f"unknown prefix caching hash algorithm {self.algo!r}")
        if self.lora_key_format not in ("tuple", "name"):
            raise ValueError(f"unknown lora_key_format {self.lora_key_format!r}")


def resolve_seed(config: BlockHashConfig) -> str:
    """The seed string NONE_HASH is derived from; raises when the engines use a random one."""
    if config.python_hash_seed is not None:
        return config.python_hash_seed
    if config.algo.startswith("xxhash"):
        raise UnreproducibleHashError(
            f"{config.algo} with PYTHONHASHSEED unset uses a random per-process NONE_HASH in vLLM; "
            "set the same PYTHONHASHSEED on every engine and in the router config")
    if config.unset_seed_fallback is None:
        raise UnreproducibleHashError(
            "PYTHONHASHSEED is unset and this vLLM version derives NONE_HASH from os.urandom")
    return config.unset_seed_fallback


def is_reproducible(config: BlockHashConfig) -> bool:
    """Whether exact vLLM hashes can be computed for this config (a flag for callers that degrade)."""
    try:
        resolve_seed(config)
    except UnreproducibleHashError:
        return False
    return True


def to_event_hash(digest: bytes) -> int:
    """The 64-bit form vLLM publishes in KV events (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(digest, "big") & MASK64


class BlockHasher:
    """Computes a prompt's block-hash chain for one engine configuration.

    Construction resolves NONE_HASH once (raising UnreproducibleHashError when impossible); the
    hash methods are then pure and thread-safe.
    """

    def __init__(self, config: BlockHashConfig) -> None:
        self.config = config
        self._h = hash_function(config.algo)
        self.none_hash: bytes = self._h(resolve_seed(config))

    def lora_key(self, lora_name: str, lora_path: str | None = None) -> Any:
        """The per-block LoRA extra key in the configured vLLM version's format."""
        if self.config.lora_key_format == "name":
            return lora_name
        return ("lora", lora_name, lora_path or "")

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """One block's digest; ``parent`` None (or empty) means the first block of a sequence."""
        return self._h((parent or self.none_hash, tuple(tokens), extra_keys))

    def block_hashes(self, token_ids: Sequence[int], *, lora_name: str | None = None,
                     lora_path: str | None = None, cache_salt: str | None = None,
                     parent: bytes | None = None, first_block: int = 0) -> list[bytes]:
        """Raw digests of every full block of ``token_ids``.

        To extend an existing chain pass the last digest as ``parent`` and its block count as
        ``first_block`` (cache_salt only applies to block 0). ``token_ids`` must hold Python ints
        (numpy ints pickle differently).
        """
        bs = self.config.block_size
        n = len(token_ids) // bs
        if not n:
            return []
        if not isinstance(token_ids, (list, tuple)):
            token_ids = [int(t) for t in token_ids]
        h = self._h
        lora = (self.lora_key(lora_name, lora_path),) if lora_name else ()
        plain_extra = lora or None
        prev = parent or self.none_hash
        out: list[bytes] = []
        append = out.append
        start = 0
        if cache_salt and first_block == 0:
            prev = h((prev, tuple(token_ids[:bs]), lora + (("cache_salt", cache_salt),)))
            append(prev)
            start = 1
        for i in range(start * bs, n * bs, bs):
            prev = h((prev, tuple(token_ids[i:i + bs]), plain_extra))
            append(prev)
        return out

    def event_hashes(self, token_ids: Sequence[int], **kw: Any) -> list[int]:
        """The 64-bit event form of :meth:`block_hashes` (what the prefix index is keyed by)."""
        return [int.from_bytes(d, "big") & MASK64 for d in self.block_hashes(token_ids, **kw)]

