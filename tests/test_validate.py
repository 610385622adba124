"""controlplane.validate: every entry point's checks accept what is allowed and name the field otherwise."""

from __future__ import annotations

import math

import pytest

from controlplane import validate as v
from controlplane.workers import normalize_url


def _rejects(fn, value, field_hint, *args, **kw):
    with pytest.raises(ValueError) as exc:
        fn(value, *args, **kw)
    msg = str(exc.value)
    assert field_hint in msg, msg
    assert "must be" in msg, msg
    assert len(msg) < 400, msg  # never echoes a huge value
    return msg


@pytest.mark.parametrize("w", [0, 0.0, 1, 2.5, 1e6])
def test_weight_accepts(w):
    assert v.weight(w) == float(w)
    assert isinstance(v.weight(w), float)


@pytest.mark.parametrize("w", [math.nan, math.inf, -math.inf, -1e-9, -1, 1e6 + 1, True, False, "1", None, [1]])
def test_weight_rejects(w):
    _rejects(v.weight, w, "weight")
    _rejects(v.weight, w, "workers[3].weight", field="workers[3].weight")


@pytest.mark.parametrize("raw, expected", [
    ("10.0.0.5:8000", "http://10.0.0.5:8000"),
    ("http://engine:8000/", "http://engine:8000"),
    ("  https://engine.example.com  ", "https://engine.example.com"),
    ("http://[::1]:8000", "http://[::1]:8000"),
    ("http://engine:8000/vllm", "http://engine:8000/vllm"),
    ("localhost", "http://localhost"),
])
def test_url_normalizes_like_workers(raw, expected):
    assert v.url(raw) == expected
    assert v.url(raw) == normalize_url(raw)


@pytest.mark.parametrize("raw", [
    "", "   ", "http://", "http://:8000", "ftp://engine:21", "tcp://engine:5557", "http://engine:0",
    "http://engine:65536", "http://engine:port", "http://en gine:8000", "http://engine:8000/a b",
    "http://user:secret@engine:8000", "http://engine:8000/?x=1", "http://engine:8000/#f",
    "http://[::1:8000", "http://" + "a" * 2050, 8000, None, b"http://engine",
])
def test_url_rejects(raw):
    _rejects(v.url, raw, "url")


@pytest.mark.parametrize("wid", ["a", "w-1", "prefill.0", "10.0.0.5:8000", "pod@ns/model_x", "x" * 128])
def test_worker_id_accepts(wid):
    assert v.worker_id(wid) == wid


@pytest.mark.parametrize("wid", ["", "x" * 129, "x" * 100_000, "has space", "naïve", "a\nb", "a,b", 7, None])
def test_worker_id_rejects(wid):
    msg = _rejects(v.worker_id, wid, "id")
    assert "128" in msg


def test_worker_id_empty_only_when_allowed():
    assert v.worker_id("", allow_empty=True) == ""
    _rejects(v.worker_id, "", "worker_id", field="worker_id")


@pytest.mark.parametrize("value, kw, ok", [
    (2.0, {}, True), (1, {}, True), (0, {}, False), (0, {"allow_zero": True}, True), (-1, {}, False),
    (-1, {"allow_zero": True}, False), (math.nan, {}, False), (math.inf, {}, False), (10, {"max_s": 5}, False),
    (5, {"max_s": 5}, True), (True, {}, False), ("2", {}, False),
])
def test_positive_seconds(value, kw, ok):
    if ok:
        assert v.positive_seconds(value, "health.interval_s", **kw) == float(value)
    else:
        _rejects(v.positive_seconds, value, "health.interval_s", "health.interval_s", **kw)


@pytest.mark.parametrize("value, ok", [(1, True), (65535, True), (0, False), (65536, False), (2.0, False),
                                       (True, False), ("3", False), (None, False)])
def test_int_range(value, ok):
    if ok:
        assert v.int_range(value, "bootstrap_port", 1, 65535) == value
    else:
        msg = _rejects(v.int_range, value, "bootstrap_port", "bootstrap_port", 1, 65535)
        assert "1 to 65535" in msg


def test_choice():
    assert v.choice("parallel", "pd_flow", ("sequential", "parallel")) == "parallel"
    msg = _rejects(v.choice, "paralel", "pd_flow", "pd_flow", ("sequential", "parallel"))
    assert "sequential, parallel" in msg
    _rejects(v.choice, None, "pd_flow", "pd_flow", ("sequential",))
    _rejects(v.choice, ["sequential"], "pd_flow", "pd_flow", ("sequential",))


@pytest.mark.parametrize("value, dp, expected", [
    ("", 1, ""), ("  ", 4, ""), ("tcp://10.0.0.5:5557", 1, "tcp://10.0.0.5:5557"),
    ("tcp://engine:65535", 1, "tcp://engine:65535"), ("tcp://engine:65532", 4, "tcp://engine:65532"),
    ("tcp://[::1]:5557", 2, "tcp://[::1]:5557"), ("ipc:///tmp/kv.sock", 1, "ipc:///tmp/kv.sock"),
])
def test_kv_endpoint_accepts(value, dp, expected):
    assert v.kv_endpoint(value, dp_size=dp) == expected


@pytest.mark.parametrize("value, dp", [
    ("tcp://engine", 1), ("tcp://engine:0", 1), ("tcp://engine:70000", 1), ("tcp://engine:65533", 4),
    ("tcp://*:5557", 1), ("tcp://:5557", 1), ("http://engine:5557", 1), ("engine:5557", 1),
    ("ipc:///tmp/kv.sock", 2), ("ipc://", 1), ("tcp://engine:5557/x", 1), ("tcp://eng ine:5557", 1),
    (5557, 1), (None, 1),
])
def test_kv_endpoint_rejects(value, dp):
    _rejects(v.kv_endpoint, value, "kv_events", dp_size=dp)


def test_kv_endpoint_ipc_with_dp_says_why():
    msg = _rejects(v.kv_endpoint, "ipc:///tmp/kv", "workers[0].kv_events", "workers[0].kv_events", dp_size=2)
    assert "dp_size" in msg


@pytest.mark.parametrize("value, expected", [
    (None, None), (0, "0"), (42, "42"), (4294967295, "4294967295"), ("0", "0"), ("007", "007"),
    ("random", "random"),
])
def test_hash_seed_means_pythonhashseed(value, expected):
    assert v.hash_seed(value) == expected


@pytest.mark.parametrize("value", [-1, 4294967296, True, False, 1.5, 0.0, "", " 1", "-1", "abc", "4294967296",
                                   "RANDOM", [0]])
def test_hash_seed_rejects(value):
    msg = _rejects(v.hash_seed, value, "hash_seed")
    assert "PYTHONHASHSEED" in msg


def test_integer_zero_seed_hashes_like_pythonhashseed_zero():
    """hash_seed = 0 in TOML must produce the same chain as engines started with PYTHONHASHSEED=0."""
    from kvhash.hashing import BlockHashConfig, BlockHasher

    tokens = list(range(32))
    from_int = BlockHasher(BlockHashConfig(python_hash_seed=v.hash_seed(0))).event_hashes(tokens)
    from_env = BlockHasher(BlockHashConfig(python_hash_seed="0")).event_hashes(tokens)
    empty = BlockHasher(BlockHashConfig(python_hash_seed="")).event_hashes(tokens)
    assert from_int == from_env != empty


@pytest.mark.parametrize("value, ok", [
    ("127.0.0.1:50051", True), ("0.0.0.0:0", True), ("[::1]:50051", True), ("localhost:65535", True),
    ("localhost", False), (":50051", False), ("127.0.0.1:65536", False), ("127.0.0.1:http", False),
    ("::1:50051", False), ("a b:1", False), (50051, False),
])
def test_listen_address(value, ok):
    if ok:
        assert v.listen_address(value) == value
    else:
        _rejects(v.listen_address, value, "listen")


@pytest.mark.parametrize("value, ok", [("127.0.0.1", True), ("cp.example.com", True), ("::1", True),
                                       ("", False), ("http://cp", False), ("cp:80", False), ("a b", False),
                                       (None, False)])
def test_host(value, ok):
    if ok:
        assert v.host(value, "http_host") == value
    else:
        _rejects(v.host, value, "http_host", "http_host")


def test_boolean_and_text():
    assert v.boolean(True, "health.poll_metrics") is True
    for bad in (1, "true", None):
        _rejects(v.boolean, bad, "health.poll_metrics", "health.poll_metrics")
    assert v.text("m", "model") == "m"
    _rejects(v.text, "x" * 2000, "model", "model")
    _rejects(v.text, 3, "model", "model")
