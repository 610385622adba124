"""Issue 21 #6: idle connections held open must not lock new clients out of a data plane.

2,000 idle connections against a data plane allowed 512 descriptors refused every new client
until the head timeout, and nothing was logged. Here a real data plane runs with 256
descriptors (RLIMIT_NOFILE set before it starts), 400 sockets are opened and left silent,
then a new client must be served at once: the connection cap (half the descriptors by
default) closes the longest-idle connections for newcomers and logs that it did.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest
import requests

from omni_proxy.launcher import ProcessGroup
from tests.test_bad_config import assert_one_line_error, run_cli

NOFILE = 256
IDLE = 400
# Lower the descriptor limit, then run the data plane as ProcessGroup.start would.
WRAPPER = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
           "sys.argv = ['omni_proxy.launcher', *sys.argv[1:]]; "
           "runpy.run_module('omni_proxy.launcher', run_name='__main__')")


@pytest.fixture
def group():
    g = ProcessGroup()
    try:
        yield g
    finally:
        g.close()


def test_idle_connection_flood_does_not_lock_out_new_clients(group):
    cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0"])
    ready = group.workdir / "dp.ready"

    def port() -> int | None:
        return json.loads(ready.read_text())["port"] if ready.exists() else None

    dp = group.start_program("dataplane", [sys.executable, "-c", WRAPPER, "dataplane", "--port", "0",
                                           "--controlplane", cp.address, "--ready-file", str(ready)], port)
    url = f"http://127.0.0.1:{dp.port}"
    assert requests.get(url + "/health", timeout=10).status_code == 200
    idle = []
    try:
        for _ in range(IDLE):
            idle.append(socket.create_connection(("127.0.0.1", dp.port), timeout=5))
        started = time.monotonic()
        resp = requests.get(url + "/health", timeout=5)   # the head timeout is 30 s: well before
        assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 3
        deadline = time.monotonic() + 10
        while "connection cap" not in dp.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, dp.log_tail(20)
            time.sleep(0.05)
    finally:
        for s in idle:
            s.close()
    # The node serves on as before once the flood is gone.
    assert requests.get(url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("flags,fragment", [(["--max-connections", "-1"], "--max-connections"),
                                            (["--max-connections-per-client", "-2"], "--max-connections-per-client"),
                                            (["--max-connections", "10000000"], "ulimit -n")])
def test_bad_connection_caps_are_one_line(tmp_path, flags, fragment):
    proc = run_cli(["dataplane", "--port", "0", *flags], tmp_path)
    assert_one_line_error(proc, "omni-proxy dataplane", fragment)
