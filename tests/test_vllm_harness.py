"""tests/vllm_harness: port handling and retries, with a stand-in for vLLM (no vLLM needed).

The stand-in behaves as ``vllm_entry.py`` + vLLM do for what the harness relies on: it binds
the NIXL side-channel port it is told (failing with "Address already in use" and then hanging,
as vLLM does when that thread dies), binds its HTTP port itself and reports it through
``OMNI_VLLM_PORT_FILE``, and answers ``/health``.
"""

from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from tests.vllm_harness import vllm_server

FAKE = textwrap.dedent("""
    import http.server, json, os, socket, sys, time

    side = socket.socket()
    try:
        side.bind(("127.0.0.1", int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])))
        side.listen()
    except OSError as exc:
        print(f"ERROR side channel: [Errno 98] Address already in use ({exc})", flush=True)
        time.sleep(600)        # vLLM keeps running without its side channel

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    path = os.environ["OMNI_VLLM_PORT_FILE"]
    with open(path + ".tmp", "w") as f:
        json.dump({"port": server.server_address[1]}, f)
    os.replace(path + ".tmp", path)
    server.serve_forever()
""")


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    entry = tmp_path / "fake_vllm.py"
    entry.write_text(FAKE)
    monkeypatch.setattr(vllm_server, "ENTRY", entry)
    return tmp_path


def test_a_server_that_lost_a_port_race_is_restarted_on_fresh_ports(fake_vllm, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real_free_port = vllm_server.free_port
    handed = iter([taken.getsockname()[1]])
    # the first port handed out is one somebody else took before the server bound it
    monkeypatch.setattr(vllm_server, "free_port", lambda: next(handed, None) or real_free_port())
    server = vllm_server.start_server("p", python=sys.executable, model=fake_vllm, workdir=fake_vllm,
                                      cpu="0", kv_role="kv_producer")
    try:
        assert server.port is None                      # nothing chosen for the HTTP port here
        vllm_server.wait_healthy([server], timeout=60)
        assert server.restarts == 1 and server.healthy()
        assert server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != str(taken.getsockname()[1])
        assert server.bound_port() == server.port and server.url.endswith(f":{server.port}")
        assert "Address already in use" not in server.log_tail()     # this attempt's log only
    finally:
        server.stop()
        taken.close()
    assert server.proc.poll() is not None


def test_retries_are_bounded(fake_vllm, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(vllm_server, "free_port", lambda: taken.getsockname()[1])
    server = vllm_server.start_server("p", python=sys.executable, model=fake_vllm, workdir=fake_vllm,
                                      cpu="0", kv_role="kv_producer")
    try:
        with pytest.raises(vllm_server.VllmError, match="Address already in use"):
            vllm_server.wait_healthy([server], timeout=60)
        assert server.restarts == vllm_server.PORT_RETRIES
    finally:
        server.stop()
        taken.close()
