"""Input hygiene in the data plane, piece by piece: ids, PD fields, counts, compressed bodies,
and the metaserver's pending table (issue 11, defects 2, 4, 7, 8)."""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib

import orjson
import pytest

from dataplane.errors import APIError
from dataplane.hygiene import engine_request_id, parse_field_list, sanitize_client_id, strip_pd_fields
from dataplane.intake import inflate
from dataplane.requests import COMPLETIONS, parse_request
from metaserver.pending import PendingPrefill, PendingTable


@pytest.mark.parametrize("given,label", [
    ("abc-123", "abc-123"),
    ("  spaced id  ", "spaced_id"),
    ("a/b?c=d", "a_b_c_d"),
    ("caf\u00e9\udcff", "caf_"),          # non-ASCII and undecodable bytes (surrogates)
    ("\udcff\udcfe", ""),
    ("", ""),
    (None, ""),
    ("x" * 500, "x" * 64),
])
def test_client_ids_become_safe_bounded_labels(given, label):
    assert sanitize_client_id(given) == label


def test_engine_ids_are_unique_even_for_the_same_client_id():
    a = parse_request(COMPLETIONS, b'{"prompt": "x"}', "same")
    b = parse_request(COMPLETIONS, b'{"prompt": "x"}', "same")
    assert a.request_id != b.request_id
    assert a.request_id == engine_request_id("same", a.placement_id) == f"same-{a.placement_id}"
    assert a.echo_id == b.echo_id == "same"
    none = parse_request(COMPLETIONS, b'{"prompt": "x"}', None)
    assert none.request_id == none.placement_id == none.echo_id


def test_request_ids_are_uuid4_hex_unique_and_not_shared_with_a_forked_worker():
    import os
    import uuid

    from dataplane.hygiene import new_id

    ids = [new_id() for _ in range(1000)]        # several 4 KiB refills of random bytes
    assert len(set(ids)) == len(ids)
    for i in ids:
        u = uuid.UUID(i)
        assert u.hex == i and u.version == 4 and u.variant == uuid.RFC_4122
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                 # a --workers child: bytes of its own
        os.write(write, new_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child != new_id() and uuid.UUID(child).version == 4


@pytest.mark.parametrize("body,param,words", [
    ({"model": 3, "stream": "yes", "max_tokens": 0}, "model", "a string"),      # the first in order
    ({"max_tokens": True, "stream": "yes"}, "stream", "a boolean"),
    ({"n": 0, "max_tokens": 5.5}, "max_tokens", "an integer"),
    ({"temperature": True}, "temperature", "not a boolean"),
    ({"n": 2**31, "max_tokens": 0}, "max_tokens", "between"),
])
def test_a_body_with_several_bad_fields_reports_the_same_one(body, param, words):
    with pytest.raises(APIError) as err:
        parse_request(COMPLETIONS, orjson.dumps({"prompt": "x", **body}), None)
    assert err.value.param == param and words in err.value.message


def test_body_without_pd_fields_keeps_its_bytes():
    raw = b'{"model": "m",  "prompt": "bootstrap_room kv_transfer_params", "max_tokens": 2}'
    req = parse_request(COMPLETIONS, raw, None)
    assert req.raw is raw


@pytest.mark.parametrize("field", ["kv_transfer_params", "batch_kv_transfer_params", "bootstrap_host",
                                   "bootstrap_port", "bootstrap_room", "bootstrap_pair_key"])
def test_client_pd_fields_are_dropped(field):
    raw = orjson.dumps({"model": "m", "prompt": "x", field: {"remote_host": "evil"} if "params" in field else 7})
    req = parse_request(COMPLETIONS, raw, None)
    assert field not in req.body and field.encode() not in req.raw
    assert orjson.loads(req.raw) == {"model": "m", "prompt": "x"}


def test_escaped_key_names_do_not_slip_through():
    raw = b'{"prompt": "x", "kv\\u005ftransfer_params": {"remote_host": "evil"}}'
    req = parse_request(COMPLETIONS, raw, None)
    assert req.body == {"prompt": "x"}


def test_allowed_fields_stay():
    allowed = parse_field_list(" kv_transfer_params, ,bootstrap_room")
    assert allowed == {"kv_transfer_params", "bootstrap_room"}
    body = {"prompt": "x", "kv_transfer_params": {"a": 1}, "bootstrap_room": 5, "bootstrap_host": "h"}
    kept, raw = strip_pd_fields(body, orjson.dumps(body), allowed)
    assert kept == {"prompt": "x", "kv_transfer_params": {"a": 1}, "bootstrap_room": 5}
    assert orjson.loads(raw) == kept


@pytest.mark.parametrize("key,value", [
    ("max_tokens", 2**63), ("max_tokens", 2**64 - 1), ("max_tokens", 2**31), ("max_tokens", 2**70),
    ("max_completion_tokens", 2**63), ("n", 2**63), ("n", -1), ("max_tokens", 0),
])
def test_counts_out_of_range_are_400(key, value):
    raw = b'{"prompt": "x", "%s": %d}' % (key.encode(), value)
    with pytest.raises(APIError) as err:
        parse_request(COMPLETIONS, raw, None)
    assert err.value.status == 400 and err.value.param == key


@pytest.mark.parametrize("prompt, tokens", [
    ([1, 2, 3], 3), ([[1, 2], [3]], 3), ([[]], 0), (["ab", "cdefg"], 3),
    ([1, True], None), ([1, 2.0], None), ([1, None], None), ([True], None), ([[1, False]], None),
    ([[1], "x"], None), ([], None), ([1, [2]], None), ([1, "2"], None),
])
def test_prompt_shapes(prompt, tokens):
    """Token-id prompts are integers only (JSON true/false and floats are not token ids)."""
    raw = orjson.dumps({"prompt": prompt})
    if tokens is None:
        with pytest.raises(APIError) as err:
            parse_request(COMPLETIONS, raw, None)
        assert err.value.status == 400
    else:
        assert parse_request(COMPLETIONS, raw, None).prompt_tokens == tokens


async def test_gzip_and_deflate_bodies_inflate():
    body = orjson.dumps({"prompt": "hello " * 1000})
    assert await inflate(gzip.compress(body), "gzip", 1 << 20) == body
    assert await inflate(gzip.compress(body[:10]) + gzip.compress(body[10:]), "gzip", 1 << 20) == body
    assert await inflate(zlib.compress(body), "deflate", 1 << 20) == body
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert await inflate(raw_deflate.compress(body) + raw_deflate.flush(), "deflate", 1 << 20) == body


@pytest.mark.parametrize("data,what", [
    (b"this is not gzip", "not valid"),
    (gzip.compress(b'{"prompt": "x"}')[:-12], "truncated"),
    (gzip.compress(b"{}") + b"junk", "not valid"),
])
async def test_corrupt_gzip_is_400(data, what):
    with pytest.raises(APIError) as err:
        await inflate(data, "gzip", 1 << 20)
    assert err.value.status == 400 and what in err.value.message


async def test_gzip_bomb_is_413_without_stalling_the_loop():
    bomb = gzip.compress(b"\0" * (200 << 20), compresslevel=9)    # ~200 KB that inflate to 200 MiB
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        with pytest.raises(APIError) as err:
            await inflate(bomb, "gzip", 32 << 20)
    finally:
        stop.set()
        await tick
    assert err.value.status == 413
    assert len(gaps) > 50                 # other tasks ran while it inflated
    assert max(gaps) < 0.1, f"the loop stalled for {max(gaps):.3f}s"


def _entry(placement_id: str, *children: str) -> PendingPrefill:
    return PendingPrefill(placement_id=placement_id, engine_request_id="e", path="/v1/completions", body=b"{}",
                          model="m", prompt_tokens=1, max_tokens=1, expected=list(children))


def test_pending_table_refuses_taken_ids_and_keeps_the_first():
    table = PendingTable()
    first = _entry("p1", "cmpl-a-0", "cmpl-a-1")
    assert table.add(first)
    assert not table.add(_entry("p2", "cmpl-a-1"))        # a child id already pending
    assert not table.add(_entry("p1", "cmpl-b-0"))        # a placement id already pending
    assert not table.add(_entry("p3", "cmpl-c-0", "cmpl-c-0"))
    assert table.find("cmpl-a-1") is first and len(table) == 1
    assert table.find("cmpl-b-0") is None and table.find("cmpl-c-0") is None
    table.pop("p1")
    assert table.add(_entry("p2", "cmpl-a-1"))            # free again once the first ended
