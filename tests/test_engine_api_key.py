"""Engines behind an API key (vLLM's --api-key) get it on every call the proxy makes.

The control plane's model discovery and the metaserver's prefill leg used to go without
it; then a worker never became routable, or every layerwise request failed.
"""

from __future__ import annotations

import pytest

from tests.conftest import start_cluster, wait_until

KEY = "s3cret-engine-key"


async def _routable(cluster, n: int) -> bool:
    workers = await cluster.workers()
    return sum(1 for w in workers.values() if w.model == "sim-model" and w.status == 1) == n


@pytest.mark.parametrize("flow,sims", [
    ("sequential", {"agg": "both"}),
    ("layerwise", {"prefill-0": "prefill", "decode-0": "decode"}),
])
async def test_every_engine_call_carries_the_key(flow, sims, http):
    cluster = start_cluster(sims, cp_args=["--engine-api-key", KEY, "--pd-flow", flow, "--metaserver-host",
                                           "127.0.0.1"],
                            dp_args=["--engine-api-key", KEY], sim_args={n: ["--api-key", KEY] for n in sims})
    try:
        await wait_until(lambda: _routable(cluster, len(sims)), what="models discovered with the key")
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3}
        async with http.post(cluster.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        for name in sims:
            for req in await cluster.sim_requests(name):
                assert req["headers"].get("authorization") == f"Bearer {KEY}"
    finally:
        cluster.group.close()


async def test_without_the_key_the_control_plane_cannot_discover_the_model(http):
    cluster = start_cluster({"agg": "both"}, dp_args=["--engine-api-key", KEY], sim_args={"agg": ["--api-key", KEY]})
    try:
        await wait_until(lambda: _has_error(cluster), what="a failed discovery")
        assert not await _routable(cluster, 1)
    finally:
        cluster.group.close()


async def _has_error(cluster) -> bool:
    return any("401" in w.last_error for w in (await cluster.workers()).values())


@pytest.mark.parametrize("source", ["environment", "file"])
async def test_data_plane_reads_the_key_from_the_environment_or_a_file(source, http, tmp_path, monkeypatch):
    """Off the command line (where `ps` shows it): $OMNI_ENGINE_API_KEY, as the control plane
    reads it, or --engine-api-key-file (a mounted Secret); the data plane's legs carry it."""
    if source == "environment":
        monkeypatch.setenv("OMNI_ENGINE_API_KEY", KEY)      # both planes inherit it
        cp_args, dp_args = [], []
    else:
        monkeypatch.delenv("OMNI_ENGINE_API_KEY", raising=False)
        key_file = tmp_path / "engine-api-key"
        key_file.write_text(KEY + "\n")                      # as a Secret volume holds it
        cp_args, dp_args = ["--engine-api-key", KEY], ["--engine-api-key-file", str(key_file)]
    cluster = start_cluster({"agg": "both"}, cp_args=cp_args, dp_args=dp_args, sim_args={"agg": ["--api-key", KEY]})
    try:
        await wait_until(lambda: _routable(cluster, 1), what="model discovered with the key")
        await cluster.clear_sim_requests()
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3}
        async with http.post(cluster.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        legs = [req for req in await cluster.sim_requests("agg") if req.get("path", "").startswith("/v1/")]
        assert legs and all(req["headers"].get("authorization") == f"Bearer {KEY}" for req in legs), legs
    finally:
        cluster.group.close()


def test_engine_api_key_file_errors_name_the_flag(tmp_path):
    from dataplane.cli import add_arguments, engine_api_key
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for argv, message in (
            (["--engine-api-key", "k", "--engine-api-key-file", str(empty)],
             "--engine-api-key and --engine-api-key-file"),
            (["--engine-api-key-file", str(tmp_path / "missing")], f"--engine-api-key-file {tmp_path / 'missing'}: "),
            (["--engine-api-key-file", str(empty)], "is empty")):
        with pytest.raises(SystemExit) as exc:
            engine_api_key(parser.parse_args(argv), {})
        assert message in str(exc.value) and str(exc.value).startswith("omni-proxy dataplane: ")
    assert engine_api_key(parser.parse_args([]), {"OMNI_ENGINE_API_KEY": "from-env"}) == "from-env"
    assert engine_api_key(parser.parse_args(["--engine-api-key", "flag"]), {"OMNI_ENGINE_API_KEY": "env"}) == "flag"
