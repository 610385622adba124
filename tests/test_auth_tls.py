"""Mutual TLS on the control plane's gRPC port ([auth] tls_cert, tls_key, tls_client_ca):
omni-ctl and the data plane connect with a client certificate, and nothing connects without."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import pytest

from omni_proxy.launcher import ProcessGroup

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=omni-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=omni-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=d)
    return d


@pytest.fixture(scope="module")
def tls_cluster(pki, sim_both):
    group = ProcessGroup()
    try:
        cp = group.start("controlplane", [
            "controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--worker", f"{sim_both.url},id=w",
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--tls-client-ca", str(pki / "ca.pem")])
        dp = group.start("dataplane", [
            "dataplane", "--port", "0", "--controlplane", cp.address,
            "--controlplane-tls-ca", str(pki / "ca.pem"), "--controlplane-tls-cert", str(pki / "client.pem"),
            "--controlplane-tls-key", str(pki / "client.key")])
        yield cp, dp
    finally:
        group.close()


async def _ctl(cp, *argv: str, env: dict | None = None):
    cmd = [sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", cp.address, "--rpc-timeout", "3", *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_TLS")} | (env or {})
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60, env=env)


async def test_omni_ctl_needs_a_client_certificate(tls_cluster, pki):
    cp, _ = tls_cluster
    plain = await _ctl(cp, "workers", "--json")
    assert plain.returncode == 5 and "UNAVAILABLE" in plain.stderr
    no_cert = await _ctl(cp, "--tls-ca", str(pki / "ca.pem"), "workers", "--json")
    assert no_cert.returncode in (5, 7), no_cert.stderr   # unavailable, or refused
    ok = await _ctl(cp, "workers", "--json", env={"OMNI_TLS_CA": str(pki / "ca.pem"),
                                                  "OMNI_TLS_CERT": str(pki / "client.pem"),
                                                  "OMNI_TLS_KEY": str(pki / "client.key")})
    assert ok.returncode == 0, ok.stderr
    assert '"id": "w"' in ok.stdout


async def test_data_plane_places_over_mutual_tls(tls_cluster, http):
    _, dp = tls_cluster
    async with http.get(dp.url + "/health") as r:       # the session socket, with the same TLS
        assert (await r.json())["session"] == "socket"
    async with http.post(dp.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi",
                                                           "max_tokens": 1}) as r:
        assert r.status == 200
