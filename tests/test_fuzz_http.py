"""Bad input on the data plane's HTTP API: fuzzed from docs/openapi.yaml, and raw bodies.

A real cluster (simulated engine, control plane, data plane) answers every input. The
engine is healthy, so every answer must be < 500; every JSON error is OpenAI-shaped
(``{"error": {"message", "type", "code"}}`` with ``code`` the status); no body carries a
traceback; and the data plane still serves afterwards (``/health`` 200, a real request 200).

Example counts scale with ``OMNI_FUZZ_EXAMPLES`` (see tests/fuzz_common.py).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest
import requests
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import start_cluster
from tests.fuzz_common import Tally, fuzz_settings, has_traceback

SPEC_PATH = Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"
MODEL = "sim-model"
TALLY = Tally("http")
GEN_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _spec() -> dict:
    return yaml.safe_load(SPEC_PATH.read_text())


# ------------------------------------------------------------------ the description itself

def test_openapi_is_valid():
    from openapi_spec_validator import validate

    validate(_spec())


async def test_openapi_matches_the_routes():   # DataPlane() makes asyncio objects: in a loop
    """Every route the description lists exists in the data plane's app, and the reverse."""
    from dataplane.app import DataPlane, DataPlaneConfig

    app = DataPlane(DataPlaneConfig()).build_app()
    served = {(method, path) for method, path in app.routes() if method != "HEAD"}
    described = {(m.upper(), p) for p, ops in _spec()["paths"].items() for m in ops
                 if m in ("get", "post", "put", "delete", "patch")}
    assert described == served


def test_openapi_request_fields_are_the_ones_parsed():
    """The fields the description types are the ones the data plane checks itself."""
    schemas = _spec()["components"]["schemas"]
    common = schemas["CommonParams"]["properties"]
    for key in ("model", "stream", "stream_options", "max_tokens", "n", "temperature"):
        assert key in common
    assert common["max_tokens"] == {"$ref": "#/components/schemas/Count"}
    from dataplane.requests import MAX_COUNT
    assert schemas["Count"]["maximum"] == MAX_COUNT


# ------------------------------------------------------------------ the live cluster

@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"fuzz-agg": "both"},
                      sim_args={"fuzz-agg": ["--decode-ms-per-step", "0.02", "--max-model-len", "512",
                                             "--prefill-ms-per-token", "0.001"]})
    try:
        yield c
    finally:
        c.group.close()
        TALLY.flush()


@pytest.fixture(scope="module")
def session(cluster):
    with requests.Session() as s:
        yield s


def _header(resp, name: str) -> str:
    """A header of a requests response or of a schemathesis one (lists of values)."""
    for key, value in resp.headers.items():
        if key.lower() == name:
            return value[0] if isinstance(value, list) else value
    return ""


def check_answer(group: str, resp: requests.Response) -> None:
    """The rules every answer to bad (or good) input follows."""
    TALLY.add(group, resp.status_code)
    body = resp.content
    assert resp.status_code < 500, f"{resp.status_code}: {body[:500]!r}"
    assert not has_traceback(body), body[:2000]
    ctype = _header(resp, "content-type")
    if resp.status_code >= 400:
        assert ctype.startswith("application/json"), (resp.status_code, ctype, body[:300])
        err = orjson.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"], err
        assert err["code"] == resp.status_code, err
    elif ctype.startswith("text/event-stream"):
        for line in body.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = orjson.loads(line[6:])
                assert "error" not in event, event   # a healthy engine: no mid-stream error


def still_serving(cluster, session: requests.Session) -> None:
    assert session.get(cluster.url + "/health", timeout=10).status_code == 200
    ok = session.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      timeout=30)
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------ schemathesis

def _operations():
    import schemathesis

    schema = schemathesis.openapi.from_path(str(SPEC_PATH))
    return schema


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", GEN_ROUTES)
def test_schemathesis_generation_routes(cluster, session, path, mode):
    """Cases schemathesis derives from the description: valid ones (positive; half of them
    for the served model, so they run on the engine) and invalid ones (negative)."""
    from schemathesis import GenerationMode

    op = _operations()[path]["POST"]
    strategy = op.as_strategy(generation_mode=GenerationMode(mode))

    @fuzz_settings(60)
    @given(case=strategy, served=st.booleans())
    def run(case, served):
        if mode == "positive" and served and isinstance(case.body, dict):
            case.body["model"] = MODEL
            case.body.pop("n", None)               # keep the simulated work small
            if case.body.get("max_tokens", 0) > 64:
                case.body["max_tokens"] = 64
            if case.body.get("max_completion_tokens", 0) > 64:
                case.body["max_completion_tokens"] = 64
        resp = case.call(base_url=cluster.url, session=session, timeout=30)
        check_answer(f"schemathesis {mode} POST {path}", resp)

    run()
    still_serving(cluster, session)


OTHER_POSTS = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/responses", "/tokenize", "/detokenize")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", OTHER_POSTS)
def test_schemathesis_other_post_routes(cluster, session, path):
    """The pass-through routes (the engine checks the body: a healthy engine's 4xx passes
    through) and the tokenizer's (this data plane has none: a 400 naming --tokenizer)."""
    from schemathesis import GenerationMode

    op = _operations()[path]["POST"]

    @fuzz_settings(15)
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE) | op.as_strategy(
        generation_mode=GenerationMode.NEGATIVE), served=st.booleans())
    def run(case, served):
        if served and isinstance(case.body, dict):
            case.body["model"] = MODEL
        resp = case.call(base_url=cluster.url, session=session, timeout=30)
        check_answer(f"schemathesis POST {path}", resp)
        assert _header(resp, "x-request-id"), resp.status_code

    run()
    still_serving(cluster, session)


def test_schemathesis_model_card(cluster, session):
    op = _operations()["/v1/models/{model}"]["GET"]

    @fuzz_settings(15)
    @given(case=op.as_strategy())
    def run(case):
        resp = case.call(base_url=cluster.url, session=session, timeout=30)
        check_answer("schemathesis GET /v1/models/{model}", resp)
        assert resp.status_code == (200 if case.path_parameters["model"] == MODEL else 404), resp.text[:300]

    run()


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/version", "/liveness", "/livez",
                                  "/readiness", "/readyz"])
def test_schemathesis_ops_routes(cluster, session, path):
    import schemathesis  # noqa: F401

    op = _operations()[path]["GET"]

    @fuzz_settings(10)
    @given(case=op.as_strategy())
    def run(case):
        resp = case.call(base_url=cluster.url, session=session, timeout=30)
        TALLY.add(f"schemathesis GET {path}", resp.status_code)
        assert resp.status_code == 200, resp.text[:300]
        assert not has_traceback(resp.content)

    run()


# ------------------------------------------------------------------ raw bodies

VALID = {"/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": False},
         "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 4}}
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
          "temperature", "top_p", "stop", "seed", "cache_salt", "kv_transfer_params", "bootstrap_room", "logprobs",
          "echo", "user")

json_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                | st.text(max_size=40) | st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**64 - 1, 10**30, -1, 0,
                                                          1e308, -0.0, 2**31, 2**31 - 1]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

TRICKS = [b"\xef\xbb\xbf", b"\x00", b"\\u0000", b"\\ud800", b"\\udfff\\ud800", b"\xc0\x80", b"\xed\xa0\x80",
          b"\xff\xfe", b"\\\\", b"\\\"", b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400",
          b"99999999999999999999999999999999999", b"0x10", b"1_000", b"\xe2\x80\xa8"]


@st.composite
def raw_bodies(draw, path: str) -> tuple[str, bytes, dict]:
    """A body and headers: random bytes, truncated JSON, huge numbers, deep nesting, a wrong
    type in one field, unicode and escape tricks, broken encodings."""
    valid = orjson.dumps(VALID[path])
    kind = draw(st.sampled_from(["bytes", "truncated", "wrong_type", "huge_number", "nested", "tricks",
                                 "top_level", "encoding", "headers", "duplicate_keys"]))
    headers = {"Content-Type": "application/json"}
    if kind == "bytes":
        body = draw(st.binary(max_size=512))
    elif kind == "truncated":
        body = valid[:draw(st.integers(0, len(valid) - 1))]
    elif kind == "wrong_type":
        body_obj = dict(VALID[path])
        for _ in range(draw(st.integers(1, 3))):
            body_obj[draw(st.sampled_from(FIELDS))] = draw(json_values)
        body = json.dumps(body_obj, allow_nan=True, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    elif kind == "huge_number":
        field = draw(st.sampled_from(["max_tokens", "max_completion_tokens", "n", "temperature", "seed",
                                      "top_p", "logprobs"]))
        number = draw(st.sampled_from([b"1" + b"0" * 400, b"-" + b"9" * 30, b"1e400", b"-1e400", b"1e-400",
                                       b"18446744073709551615", b"9223372036854775808", b"9223372036854775807",
                                       b"2147483648", b"2147483647", b"-9223372036854775809", b"NaN",
                                       b"Infinity", b"0.5", b"1.0", b"-0"]))
        body = valid[:-1] + b',"' + field.encode() + b'":' + number + b"}"
    elif kind == "nested":
        depth = draw(st.integers(1, 20_000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        field = draw(st.sampled_from(["prompt", "messages", "stop", "stream_options", "extra"]))
        body = valid[:-1] + b',"' + field.encode() + b'":' + opener * depth + b"1" + closer * depth + b"}"
    elif kind == "tricks":
        trick = draw(st.sampled_from(TRICKS))
        where = draw(st.integers(0, len(valid)))
        body = valid[:where] + trick + valid[where:]
        if draw(st.booleans()):
            body = valid.replace(b'"hello"' if b"hello" in valid else b'"hi"', b'"' + trick + b'"')
    elif kind == "top_level":
        body = draw(st.sampled_from([b"null", b"[]", b"1", b'"s"', b"true", b"{}", b"[{}]", b" ", b"\n",
                                     b'{"model":"' + MODEL.encode() + b'"}']))
    elif kind == "encoding":
        enc = draw(st.sampled_from(["gzip", "deflate", "br", "x-gzip", "GZIP", "identity, gzip", "zstd"]))
        headers["Content-Encoding"] = enc
        body = draw(st.sampled_from([gzip.compress(valid), gzip.compress(valid)[:-4], valid,
                                     draw(st.binary(max_size=64)), gzip.compress(valid) + b"junk"]))
    elif kind == "headers":
        body = valid
        name = draw(st.sampled_from(["X-Request-Id", "X-SLO-TTFT-Ms", "X-SLO-TPOT-Ms", "Content-Type",
                                     "traceparent", "tracestate", "Authorization"]))
        headers[name] = draw(st.binary(max_size=80).map(
            lambda b: b.replace(b"\r", b"").replace(b"\n", b"").strip() or b"x"))
    else:   # duplicate keys: the last one wins in orjson; must still be validated
        body = valid[:-1] + b',"max_tokens":"x","model":null,"max_tokens":' + draw(
            st.sampled_from([b"-1", b"0", b"1e9", b"2147483648", b"[]"])) + b"}"
    return kind, body, headers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", GEN_ROUTES)
def test_raw_bodies(cluster, session, path):
    @fuzz_settings(150)
    @given(sample=raw_bodies(path))
    def run(sample):
        kind, body, headers = sample
        resp = session.post(cluster.url + path, data=body, headers=headers, timeout=30)
        check_answer(f"raw POST {path}", resp)
        TALLY.add(f"raw kinds {path}", kind)

    run()
    still_serving(cluster, session)


def test_every_route_refuses_other_methods_and_paths(cluster, session):
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        for path in GEN_ROUTES:
            resp = session.request(method, cluster.url + path, data=b"{}", timeout=10)
            check_answer("other methods and paths", resp)
            assert resp.status_code == 405
    for path in ("/v1/nope", "/v1/completions/x", "/../etc/passwd", "/v1//completions", "/%ff"):
        resp = session.post(cluster.url + path, data=b"{}", timeout=10)
        check_answer("other methods and paths", resp)
        assert resp.status_code == 404, (path, resp.status_code)
    still_serving(cluster, session)
