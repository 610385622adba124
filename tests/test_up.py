"""``omni-proxy up`` as one command for a real fleet: the config file's keys (its ``listen``
included) and the data plane's options (API keys, rate limits, tokenizer, OpenTelemetry,
retries) all apply, and its flags are checked at start like every other process's."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import aiohttp
import pytest

from omni_proxy.launcher import ProcessGroup
from tests.data.tokenizer.fixture_dirs import build
from tests.test_bad_config import assert_one_line_error, run_cli

MODEL = "sim-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def group():
    with ProcessGroup() as g:
        g.sim = g.start("sim", ["sim", "--port", "0"])
        yield g


async def test_up_honours_every_config_key_listen_included(group, tmp_path):
    port = free_port()
    config = tmp_path / "fleet.toml"
    config.write_text(f'listen = "127.0.0.1:{port}"\nhttp_port = 0\npolicy = "round_robin"\n'
                      f'[health]\ninterval_s = 0.2\n'
                      f'[[workers]]\nurl = "{group.sim.url}"\nid = "engine-1"\nweight = 2.5\n')
    up = group.start("up-config", ["up", "--config", str(config), "--port", "0"])
    try:
        assert up.info["grpc_port"] == port
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", f"127.0.0.1:{port}",
                             "workers", "--json"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["policy"] == "round_robin"
        assert [(w["id"], w["weight"]) for w in data["workers"]] == [("engine-1", 2.5)]
        async with aiohttp.ClientSession() as http, \
                http.post(up.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
    finally:
        group.stop(up)


async def test_up_with_a_closed_scheduler_uses_a_data_plane_token(group, tmp_path):
    """[auth] dataplane_tokens closes the Scheduler service: up's own data plane still gets its
    placements (it was refused, and up never became ready)."""
    config = tmp_path / "fleet.toml"
    config.write_text(f'[auth]\ndataplane_tokens = ["dp:tok-0123456789"]\nadmin_tokens = ["ops:adm-0123456789"]\n'
                      f'[[workers]]\nurl = "{group.sim.url}"\n')
    up = group.start("up-auth", ["up", "--config", str(config), "--port", "0", "--http-port", "0",
                                 "--health-interval", "0.2"])
    try:
        async with aiohttp.ClientSession() as http, \
                http.post(up.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
    finally:
        group.stop(up)


async def test_up_offers_the_data_planes_options(group, tmp_path):
    tok = build("tiny_llama", tmp_path / "tok")
    keys = tmp_path / "keys.txt"
    keys.write_text("alice:sk-alice-0123456789\n")
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nrequests_per_s = 1000\nburst = 1000\n\n"
                      "[keys.alice]\nrequests_per_s = 0.001\nburst = 1\n")
    up = group.start("up-dp", ["up", "--worker", group.sim.url, "--port", "0", "--http-port", "0",
                               "--health-interval", "0.2", "--api-keys", str(keys), "--rate-limits", str(limits),
                               "--tokenizer", str(tok), "--retries", "0", "--read-timeout", "30",
                               "--otel-endpoint", f"http://127.0.0.1:{free_port()}"])
    alice = {"Authorization": "Bearer sk-alice-0123456789"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(up.url + "/v1/completions", json=body) as r:
                assert r.status == 401                                   # --api-keys
            async with http.post(up.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"},
                                 headers=alice) as r:
                assert r.status == 200, await r.text()                   # --tokenizer
                assert len((await r.json())["tokens"]) >= 2
            async with http.post(up.url + "/v1/completions", json=body, headers=alice) as r:
                assert r.status == 200, await r.text()
            async with http.post(up.url + "/v1/completions", json=body, headers=alice) as r:
                assert r.status == 429, await r.text()                   # --rate-limits
    finally:
        group.stop(up)


@pytest.mark.parametrize("flags,fragments", [
    (["--port", "70000"], ["--port", "0 to 65535"]),
    (["--read-timeout", "0"], ["--read-timeout"]),
    (["--log-level", "LOUD"], ["--log-level", "DEBUG"]),
    (["--http-port", "-1"], ["--http-port"]),
    (["--otel-endpoint", "ftp://collector"], ["--otel-endpoint"]),
    (["--tokenizer", "no-such-dir"], ["--tokenizer", "no-such-dir"]),
])
def test_up_checks_its_flags_at_start(flags, fragments, tmp_path):
    proc = run_cli(["up", "--port", "0", "--http-port", "0", *flags], tmp_path)
    assert_one_line_error(proc, "omni-proxy up", *fragments)


@pytest.mark.parametrize("which", ["--port", "--listen"])
def test_up_port_in_use_is_one_line(which, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flags = ["--port", str(port)] if which == "--port" else ["--port", "0", "--listen", f"127.0.0.1:{port}"]
        proc = run_cli(["up", "--http-port", "0", *flags], tmp_path)
    assert_one_line_error(proc, "omni-proxy up", which.strip("-"), str(port), "in use")
    assert "Failed to add port" not in proc.stderr, proc.stderr      # no gRPC C-core line before it


def test_up_reads_the_engine_api_key_file(tmp_path):
    """The engine API key can come from a file, for both planes (never the command line)."""
    key = tmp_path / "engine.key"
    key.write_text("")
    proc = run_cli(["up", "--port", "0", "--http-port", "0", "--engine-api-key-file", str(key)], tmp_path)
    assert_one_line_error(proc, "--engine-api-key-file", "empty")
