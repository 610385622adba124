"""``--log-format json``: every process (simulator, control plane, data plane, up) writes one
JSON object per line with ts, level, logger and message; the data plane's lines carry the
request id (and the worker, where one is concerned), its access line is embedded whole."""

from __future__ import annotations

import logging
import re
import sys

import aiohttp
import orjson

from omni_proxy.launcher import ProcessGroup
from omni_runtime.logs import JsonFormatter
from tests.conftest import wait_until

MODEL = "sim-model"
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _objects(path) -> list[dict]:
    """Every line of a log, each a JSON object with the four fields (fails on any other line)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        obj = orjson.loads(line)
        assert isinstance(obj, dict) and TS.fullmatch(obj["ts"]), line
        assert obj["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") and obj["logger"], line
        assert isinstance(obj["message"], str), line
        out.append(obj)
    return out


def test_formatter_fields_and_exceptions():
    fmt = JsonFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("x.y").makeRecord("x.y", logging.ERROR, __file__, 1, "failed %s", ("here",),
                                                     sys.exc_info(), extra={"worker": "w1", "request_id": "r-1"})
    obj = orjson.loads(fmt.format(record))
    assert (obj["level"], obj["logger"], obj["message"], obj["worker"], obj["request_id"]) == \
        ("ERROR", "x.y", "failed here", "w1", "r-1")
    assert "ValueError: boom" in obj["exc"] and TS.fullmatch(obj["ts"])
    access = logging.getLogger("a").makeRecord("a", logging.INFO, __file__, 1, '{"status":200}', None, None)
    access.json_message = True
    assert orjson.loads(fmt.format(access))["access"] == {"status": 200}


async def test_every_process_logs_json_lines(tmp_path):
    with ProcessGroup(str(tmp_path)) as group:
        sim = group.start("sim", ["sim", "--port", "0", "--log-format", "json"])
        cp = group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--log-format",
                                "json", "--health-interval", "0.2", "--worker", f"{sim.url},id=agg"])
        dp = group.start("dp", ["dataplane", "--port", "0", "--controlplane", cp.address, "--log-format", "json",
                                "--retries", "0"])
        up = group.start("up", ["up", "--port", "0", "--http-port", "0", "--log-format", "json",
                                "--worker", f"{sim.url},id=agg-up"])
        async with aiohttp.ClientSession() as http:
            for url in (dp.url, up.url):
                async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                     headers={"X-Request-Id": "json-ok"}) as r:
                    assert r.status == 200, await r.text()
            async with http.post(sim.url + "/sim/faults", json={"status": 500, "message": "fell over", "count": 1}):
                pass
            async with http.post(dp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                 headers={"X-Request-Id": "json-bad"}) as r:
                assert r.status == 502      # the engine's 500, before any byte: a bad gateway

        async def logged() -> bool:
            text = dp.log_path.read_text(errors="replace")
            return '"client_request_id":"json-bad"' in text and '"client_request_id":"json-ok"' in text

        await wait_until(logged, what="the data plane's lines")
        await wait_until(lambda: _has(up.log_path, "json-ok"), what="up's access line")
        dp_lines = _objects(dp.log_path)
        access = [o for o in dp_lines if o["logger"] == "omni_proxy.access"]
        assert {o["access"]["client_request_id"] for o in access} == {"json-ok", "json-bad"}
        assert all(o["message"] == "access" and o["access"]["request_id"] for o in access)
        failed = [o for o in dp_lines if o["level"] == "WARNING" and "fell over" in o["message"]]
        assert failed and all(o["worker"] == "agg" and o["request_id"].startswith("json-bad") for o in failed)
        failed = failed[0]
        assert not failed["message"].startswith("[")          # the id is a field, not a prefix
        cp_lines = _objects(cp.log_path)
        assert any(o.get("worker") == "agg" and "healthy" in o["message"] for o in cp_lines)
        assert _objects(sim.log_path)
        assert any(o["logger"] == "omni_proxy.access" for o in _objects(up.log_path))


async def _has(path, text: str) -> bool:
    return text in path.read_text(errors="replace")
