"""Bad input on the control plane's other doors: KV-event frames and the metaserver.

KV events: random bytes, truncated and bit-flipped valid batches, and well-formed msgpack
with hostile values (both wire forms) go to ``decode_batch``, which may only return a batch
or raise ``MalformedEventError``; and whole ZMQ frames go through the subscriber into the
real prefix index (``KVCache._on_events``): nothing escapes, every bad payload is counted as
malformed. Metaserver (``POST /v1/metaserver`` on the control plane's HTTP port): unknown and
malformed ids and bodies get a 4xx JSON answer, never a 5xx, and the control plane still
serves. Counts scale with ``OMNI_FUZZ_EXAMPLES`` (events: 4x that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import msgpack
import orjson
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from controlplane.kvcache.events import BlockRemoved, BlockStored, KVEventBatch, MalformedEventError, decode_batch
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.kvcache.subscriber import KVEventSource, KVEventSubscriber
from tests.conftest import start_cluster
from tests.fuzz_common import Tally, fuzz_settings, has_traceback

TALLY = Tally("events")

# ------------------------------------------------------------------ frames

ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 16, 2**64 - 1, 2**63, -(2**63)]))
leaf = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=12),
                 st.binary(max_size=40))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=5)
                        | st.dictionaries(st.text(max_size=6) | ints, inner, max_size=4), max_leaves=20)
hashes = st.lists(st.one_of(ints, st.binary(max_size=40), leaf), max_size=8)
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown", "", "blockstored"])


@st.composite
def event(draw):
    tag = draw(TAGS)
    fields = {"block_hashes": draw(hashes | anything), "parent_block_hash": draw(st.none() | ints | leaf),
              "token_ids": draw(st.lists(ints, max_size=40) | anything),
              "block_size": draw(st.sampled_from([16, 16, 0, -16, 2**70 - 1, 1, 15]) | anything),
              "lora_id": draw(st.none() | ints | leaf), "medium": draw(st.none() | leaf),
              "lora_name": draw(st.none() | leaf), "extra_keys": draw(st.none() | anything),
              "group_idx": draw(st.none() | leaf), "kv_cache_spec_kind": draw(st.none() | leaf)}
    keep = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
    if draw(st.booleans()):   # array form: positional, maybe short or long
        order = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
        n = draw(st.integers(0, len(order) + 2))
        return [tag, *[fields.get(k) for k in order][:n], *draw(st.lists(leaf, max_size=2))]
    out = {k: fields[k] for k in keep}
    where = draw(st.sampled_from(["none", "first", "last"]))   # msgspec (vLLM) writes it first
    if where == "first":
        out = {"type": tag, **out}
    elif where == "last":
        out["type"] = tag
    return out


u64 = st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=40)


@st.composite
def valid_event(draw):
    """A well-formed event with legal but extreme values (ids, hashes, lengths)."""
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    blocks = draw(st.lists(u64, max_size=12))
    if tag == "BlockStored":
        fields = [blocks, draw(st.none() | u64), draw(st.lists(st.integers(0, 2**31), max_size=64)), 16,
                  draw(st.none() | st.integers(-(2**63), 2**63 - 1)), draw(st.none() | st.sampled_from(["GPU", "cpu"])),
                  draw(st.none() | st.text(max_size=8)), None, draw(st.none() | st.integers(0, 2**31))]
    elif tag == "BlockRemoved":
        fields = [blocks, draw(st.none() | st.sampled_from(["GPU", "cpu"])), draw(st.none() | st.integers(0, 8))]
    else:
        fields = []
    return [tag, *fields]


@st.composite
def batch_payload(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["bytes", "structured", "truncated", "flipped", "anything", "valid", "valid"]))
    if kind == "valid":
        evs = draw(st.lists(valid_event(), max_size=6))
        return kind, msgpack.packb([draw(st.floats(0, 2e9)), evs, draw(st.none() | st.integers(0, 7))],
                                   use_bin_type=True)
    events = draw(st.lists(event() | anything, max_size=6))
    ts = draw(st.floats(allow_nan=True) | ints | leaf)
    dp = draw(st.none() | ints | leaf)
    envelope = [ts, events, dp] if draw(st.booleans()) else {"ts": ts, "events": events, "data_parallel_rank": dp}
    try:
        packed = msgpack.packb(envelope, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        packed = msgpack.packb([0.0, []])
    if kind == "bytes":
        return kind, draw(st.binary(max_size=300))
    if kind == "truncated":
        return kind, packed[:draw(st.integers(0, max(len(packed) - 1, 0)))]
    if kind == "flipped":
        data = bytearray(packed)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return kind, bytes(data)
    if kind == "anything":
        try:
            return kind, msgpack.packb(draw(anything), use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            return kind, b"\xc1"
    return kind, packed


def per_block(events) -> list:
    """Events with every BlockRemoved split into one per hash (what merge_removals may join)."""
    out: list = []
    for e in events:
        if isinstance(e, BlockRemoved):
            out += [BlockRemoved((h,), e.medium, e.group_idx) for h in e.block_hashes]
        else:
            out.append(e)
    return out


def without_tokens(batch: KVEventBatch) -> KVEventBatch:
    return dataclasses.replace(batch, events=tuple(
        dataclasses.replace(e, token_ids=()) if isinstance(e, BlockStored) else e for e in batch.events))


@pytest.mark.timeout(600)
def test_decoder_never_raises_anything_else():
    @fuzz_settings(600, scale=4)
    @given(sample=batch_payload())
    def run(sample):
        kind, payload = sample
        try:
            batch = decode_batch(payload)
        except MalformedEventError as exc:
            assert str(exc)
            TALLY.add("decode_batch", "malformed")
            batch = None
        else:
            assert isinstance(batch, KVEventBatch)
            assert math.isfinite(batch.ts) or math.isnan(batch.ts) or math.isinf(batch.ts)
            TALLY.add("decode_batch", "decoded")
        TALLY.add("decode_batch kinds", kind)
        # What the subscriber decodes (tokens skipped, BlockStored read field by field) is the
        # same batch without its tokens; it may accept a batch only whose tokens' items were bad.
        try:
            lean = decode_batch(payload, tokens=False)
        except MalformedEventError as exc:
            assert str(exc) and batch is None, exc
            with pytest.raises(MalformedEventError):
                decode_batch(payload, tokens=False, merge_removals=True)
        else:
            merged = decode_batch(payload, tokens=False, merge_removals=True)
            assert per_block(merged.events) == per_block(lean.events) and merged.ignored == lean.ignored
            assert len(merged.events) <= len(lean.events)
            if batch is not None:
                assert lean == without_tokens(batch)
                TALLY.add("tokens=False", "same batch")
            else:
                TALLY.add("tokens=False", "accepted, tokens' items bad")

    run()


@pytest.mark.timeout(600)
def test_frames_through_the_subscriber_into_the_index():
    """Whole ZMQ messages (maybe with a bad layout) into the subscriber and the real index:
    no exception escapes, bad payloads are counted, the index still answers."""
    kv = KVCache(KVCacheConfig())
    loop = asyncio.new_event_loop()
    sub = KVEventSubscriber(KVEventSource("eng-fuzz", "tcp://127.0.0.1:1"), kv._on_events, kv._on_reset)
    seq = [0]
    try:
        @fuzz_settings(300, scale=2)
        @given(sample=batch_payload(), layout=st.sampled_from(["ok"] * 6 + ["short", "long", "seq", "jump"]))
        def run(sample, layout):
            _, payload = sample
            seq[0] += 1
            seq_b = seq[0].to_bytes(8, "big")
            frames = {"ok": [b"kv", seq_b, payload], "short": [b"kv", payload], "long": [b"kv", seq_b, payload, b""],
                      "seq": [b"kv", b"\x01\x02", payload],
                      "jump": [b"kv", (seq[0] + 10**7).to_bytes(8, "big"), payload]}[layout]
            if layout == "jump":
                seq[0] += 10**7
            before = sub.counters.malformed
            loop.run_until_complete(sub._on_message(frames))
            TALLY.add("subscriber", "malformed" if sub.counters.malformed > before else "applied")

        run()
        assert kv.match([1, 2, 3], []) is not None
        assert sub.counters.malformed >= 1
    finally:
        loop.close()


# ------------------------------------------------------------------ metaserver

@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"fz-p": "prefill", "fz-d": "decode"}, cp_args=["--pd-flow", "layerwise"])
    try:
        yield c
    finally:
        c.group.close()
        TALLY.flush()


def _metaserver_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.cp.info['http_port']}/v1/metaserver"


id_like = st.one_of(st.text(max_size=80), st.sampled_from(["cmpl-x-0", "chatcmpl-x", "cmpl--0", "cmpl-x-0-deadbeef",
                                                           "chatcmpl-", "-" * 9 + "deadbeef", "x" * 10_000]),
                    st.text(max_size=20).map(lambda t: f"cmpl-{t}-0"))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda i: st.lists(i, max_size=3)
                           | st.dictionaries(st.text(max_size=8), i, max_size=3), max_leaves=10)


@st.composite
def metaserver_call(draw) -> tuple[str, bytes, str]:
    kind = draw(st.sampled_from(["unknown_id", "wrong_type", "not_json", "not_object", "extra", "token"]))
    query = ""
    if kind == "unknown_id":
        body = orjson.dumps({"request_id": draw(id_like), "remote_host": "127.0.0.1", "remote_port": 1})
    elif kind == "wrong_type":
        body = json.dumps({"request_id": draw(json_values)}).encode()
    elif kind == "not_json":
        body = draw(st.binary(max_size=200))
    elif kind == "not_object":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "extra":
        obj = draw(st.dictionaries(st.text(max_size=10), json_values, max_size=5))
        obj["request_id"] = draw(id_like)
        body = json.dumps(obj).encode()
    else:
        body = orjson.dumps({"request_id": draw(id_like)})
        query = "?token=" + draw(st.text(max_size=30).map(lambda t: requests.utils.quote(t)))
    return kind, body, query


@pytest.mark.timeout(600)
def test_metaserver_refuses_unknown_and_malformed(cluster):
    url = _metaserver_url(cluster)
    with requests.Session() as s:
        @fuzz_settings(150)
        @given(call=metaserver_call())
        def run(call):
            kind, body, query = call
            resp = s.post(url + query, data=body, timeout=10)
            TALLY.add("metaserver", resp.status_code)
            assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
            assert not has_traceback(resp.content)
            err = resp.json()
            assert err.get("status") == "error" and err["error"]["message"], err
            assert len(err["error"]["message"]) < 1000     # the input is never echoed whole

        run()
        for body in (b"{" * 100_000, b"[" * 5000 + b"]" * 5000, b'{"request_id":"' + b"x" * (2 << 20) + b'"}',
                     b'{"request_id":"\\ud800"}', b'{"request_id":"cmpl-\\u0000-0"}', b"\xff\xfe"):
            resp = s.post(url, data=body, timeout=10)
            TALLY.add("metaserver", resp.status_code)
            assert 400 <= resp.status_code < 500 and resp.json()["error"]["message"], \
                (resp.status_code, resp.text[:200])
        for method in ("GET", "PUT", "DELETE"):
            resp = s.request(method, url, timeout=10)
            TALLY.add("metaserver", resp.status_code)
            assert resp.status_code == 405
        assert s.get(f"http://127.0.0.1:{cluster.cp.info['http_port']}/health", timeout=10).status_code == 200
        ok = s.post(cluster.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                    timeout=30)
        assert ok.status_code == 200, ok.text
