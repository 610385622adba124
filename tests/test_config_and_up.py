"""Config files (TOML, YAML, flags) and the single-process ``omni-proxy up``."""

from __future__ import annotations

import argparse

import aiohttp
import pytest

from controlplane.config import ControlPlaneConfig, WorkerSpec
from controlplane.workers import Role
from omni_proxy.launcher import LaunchError, ProcessGroup


def test_toml_config(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text("""
policy = "cautious"
pd_flow = "sequential"
[health]
interval_s = 0.5
[[workers]]
url = "10.0.0.5:8000"
role = "prefill"
weight = 2
[[workers]]
url = "http://10.0.0.6:8000/"
role = "decode"
model = "m"
[profiles.cautious]
filters = [{name = "overload", max_requests = 4}]
scorers = [{name = "least_load"}]
""")
    cfg = ControlPlaneConfig.from_file(path)
    assert cfg.policy == "cautious" and cfg.health.interval_s == 0.5
    assert [(w.url, w.role, w.weight) for w in cfg.workers] == [
        ("http://10.0.0.5:8000", Role.PREFILL, 2.0), ("http://10.0.0.6:8000", Role.DECODE, 1.0)]
    assert cfg.profiles["cautious"]["filters"][0]["max_requests"] == 4


def test_yaml_config(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("policy: round_robin\nworkers:\n  - url: http://a:1\n    role: both\n")
    cfg = ControlPlaneConfig.from_file(path)
    assert cfg.policy == "round_robin" and cfg.workers[0].role is Role.BOTH


@pytest.mark.parametrize("data,fragment", [
    ({"polcy": "x"}, "unknown config key"),
    ({"workers": [{"role": "both"}]}, "needs a url"),
    ({"workers": [{"url": "a", "role": "middle"}]}, "unknown role"),
    ({"workers": [{"url": "a", "wieght": 1}]}, "unknown worker keys"),
    ({"workers": [{"url": "a", "weight": -1}]}, "weight must be"),
    ({"health": {"every": 1}}, "unknown health key"),
])
def test_config_errors_are_clear(data, fragment):
    with pytest.raises(ValueError, match=fragment):
        ControlPlaneConfig.from_dict(data)


def test_worker_flag_syntax():
    w = WorkerSpec.parse_flag("127.0.0.1:9000,model=m,weight=3,id=w1", Role.DECODE)
    assert (w.url, w.model, w.weight, w.id, w.role) == ("http://127.0.0.1:9000", "m", 3.0, "w1", Role.DECODE)
    with pytest.raises(ValueError, match="key=value"):
        WorkerSpec.parse_flag("http://a:1,oops")


def test_control_plane_metrics_port_has_a_fixed_default():
    """A scraper can be pointed at the control plane without reading its log: /metrics is on a
    documented port by default (the manifests' test checks they use the same one)."""
    from controlplane.cli import add_arguments, config_from_args
    from controlplane.config import DEFAULT_HTTP_PORT, ControlPlaneConfig

    assert DEFAULT_HTTP_PORT == 9090 and ControlPlaneConfig().http_port == DEFAULT_HTTP_PORT
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).http_port == DEFAULT_HTTP_PORT
    assert config_from_args(parser.parse_args(["--http-port", "0"])).http_port == 0


def test_bad_policy_stops_the_control_plane_at_start():
    with ProcessGroup(ready_timeout=20) as group, pytest.raises(LaunchError, match="unknown policy"):
        group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--policy", "nope"])


async def test_up_runs_control_and_data_plane_in_one_process():
    with ProcessGroup() as group:
        sim = group.start("sim", ["sim", "--port", "0"])
        up = group.start("up", ["up", "--port", "0", "--http-port", "0", "--worker", sim.url])
        async with aiohttp.ClientSession() as s:
            async with s.post(up.url + "/v1/completions",
                              json={"model": "sim-model", "prompt": "hi", "max_tokens": 3}) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 3


def test_layerwise_refuses_a_wildcard_metaserver_address():
    with ProcessGroup(ready_timeout=20) as group, pytest.raises(LaunchError, match="wildcard"):
        group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--pd-flow", "layerwise",
                           "--http-host", "0.0.0.0"])


def test_metaserver_ids_and_url():
    from metaserver.ids import candidates, engine_request_ids
    from metaserver.server import Metaserver

    assert engine_request_ids("abc", chat=True, num_prompts=1) == ["chatcmpl-abc"]
    assert engine_request_ids("abc", chat=False, num_prompts=2) == ["cmpl-abc-0", "cmpl-abc-1"]
    assert candidates("cmpl-abc-0-1a2b3c4d") == ["cmpl-abc-0-1a2b3c4d", "cmpl-abc-0"]
    assert candidates("chatcmpl-abc") == ["chatcmpl-abc"]
    assert Metaserver.url_for("10.0.0.2", 8080) == "http://10.0.0.2:8080/v1/metaserver"
    assert Metaserver.url_for("::1", 8080) == "http://[::1]:8080/v1/metaserver"
    with pytest.raises(ValueError, match="wildcard"):
        Metaserver.url_for("0.0.0.0", 8080)
