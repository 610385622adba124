"""Bad configuration stops a server at start with one line naming the key, never a traceback.

Each case runs the real command (``python -m omni_proxy ...``) as an operator would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omni_proxy.launcher import ProcessGroup

TIMEOUT_S = 60
REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``omni-proxy ARGS`` from ``cwd`` (this checkout first on the path); a bad config must make
    it exit on its own, well before the timeout."""
    return subprocess.run([sys.executable, "-m", "omni_proxy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode not in (0, None), f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines, "nothing on stderr"
    last = lines[-1]
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not in last stderr line {last!r}"
    return last


# (file contents, what the last stderr line must name)
TOML_CASES = {
    "interval_negative": ("[health]\ninterval_s = -1\n", ["health.interval_s", "> 0"]),
    "interval_zero": ("[health]\ninterval_s = 0\n", ["health.interval_s"]),
    "interval_nan": ("[health]\ninterval_s = nan\n", ["health.interval_s", "finite"]),
    "interval_inf": ("[health]\ninterval_s = inf\n", ["health.interval_s", "finite"]),
    "interval_string": ('[health]\ninterval_s = "2"\n', ["health.interval_s", "number"]),
    "unhealthy_after": ("[health]\nunhealthy_after = 0\n", ["health.unhealthy_after", "1 to 1000"]),
    "health_unknown": ("[health]\nevery = 1\n", ["unknown health key", "every"]),
    "pd_flow": ('pd_flow = "pipelined"\n', ["pd_flow", "sequential, parallel, layerwise"]),
    "parallel_protocol": ('parallel_protocol = "nixl"\n', ["parallel_protocol", "sglang, mooncake"]),
    "policy_unknown": ('policy = "fastest"\n', ["policy", "fastest"]),
    "policy_type": ("policy = 3\n", ["policy"]),
    "hash_algo": ('[kv_cache]\nhash_algo = "md5"\n', ["kv_cache.hash_algo", "sha256"]),
    "hash_seed_negative": ("[kv_cache]\nhash_seed = -1\n", ["kv_cache.hash_seed", "PYTHONHASHSEED"]),
    "hash_seed_float": ("[kv_cache]\nhash_seed = 1.5\n", ["kv_cache.hash_seed", "PYTHONHASHSEED"]),
    "hash_seed_text": ('[kv_cache]\nhash_seed = "abc"\n', ["kv_cache.hash_seed", "random"]),
    "hash_seed_top_level": ("hash_seed = 0\n", ["hash_seed", "[kv_cache]"]),
    "block_size": ("[kv_cache]\nblock_size = 0\n", ["kv_cache.block_size"]),
    "routed_stride": ("[kv_cache]\nrouted_stride = 0\n", ["kv_cache.routed_stride", "1 to 1024"]),
    "kv_unknown": ("[kv_cache]\nblocksize = 16\n", ["unknown kv_cache key", "blocksize"]),
    "xxhash_without_seed": ('policy = "cache_aware"\n[kv_cache]\nhash_algo = "xxhash"\n',
                            ["kv_cache.hash_seed"]),
    "unknown_key": ('polcy = "random"\n', ["unknown config key", "polcy"]),
    "http_port": ("http_port = 70000\n", ["http_port", "0 to 65535"]),
    "listen": ('listen = "localhost"\n', ["listen", "host:port"]),
    "session_listen": ('session_listen = "on"\n', ["session_listen", "host:port"]),
    "heartbeat_ttl": ("heartbeat_ttl_s = -1\n", ["heartbeat_ttl_s"]),
    "prefill_retries": ("prefill_retries = true\n", ["prefill_retries"]),
    "layerwise_wildcard": ('pd_flow = "layerwise"\nhttp_host = "0.0.0.0"\n', ["metaserver_host"]),
    "worker_weight_negative": ('[[workers]]\nurl = "http://127.0.0.1:9"\nweight = -1\n', ["workers[0].weight"]),
    "worker_weight_nan": ('[[workers]]\nurl = "http://127.0.0.1:9"\nweight = nan\n', ["workers[0].weight"]),
    "worker_weight_bool": ('[[workers]]\nurl = "http://127.0.0.1:9"\nweight = true\n', ["workers[0].weight"]),
    "worker_role": ('[[workers]]\nurl = "http://127.0.0.1:9"\nrole = "middle"\n',
                    ["workers[0].role", "both, prefill or decode"]),
    "worker_no_url": ('[[workers]]\nrole = "both"\n', ["workers[0].url", "needs a url"]),
    "worker_unknown_key": ('[[workers]]\nurl = "http://127.0.0.1:9"\nwieght = 1\n', ["workers[0]", "wieght"]),
    "worker_url_scheme": ('[[workers]]\nurl = "ftp://127.0.0.1:9"\n', ["workers[0].url", "http(s)"]),
    "worker_url_port": ('[[workers]]\nurl = "http://127.0.0.1:99999"\n', ["workers[0].url", "1-65535"]),
    "worker_url_space": ('[[workers]]\nurl = "http://engine one:8000"\n', ["workers[0].url"]),
    "worker_id_chars": ('[[workers]]\nurl = "http://127.0.0.1:9"\nid = "a b"\n', ["workers[0].id"]),
    "duplicate_ids": ('[[workers]]\nurl = "http://127.0.0.1:9"\nid = "w"\n'
                      '[[workers]]\nurl = "http://127.0.0.1:10"\nid = "w"\n', ["workers[1].id", "unique"]),
    "duplicate_urls": ('[[workers]]\nurl = "http://127.0.0.1:9"\n[[workers]]\nurl = "127.0.0.1:9/"\n',
                       ["workers[1].url", "twice"]),
    "kv_events_scheme": ('[[workers]]\nurl = "http://127.0.0.1:9"\nkv_events = "udp://127.0.0.1:5557"\n',
                         ["workers[0].kv_events", "tcp://host:port"]),
    "kv_events_no_port": ('[[workers]]\nurl = "http://127.0.0.1:9"\nkv_events = "tcp://127.0.0.1"\n',
                          ["workers[0].kv_events"]),
    "kv_events_wildcard": ('[[workers]]\nurl = "http://127.0.0.1:9"\nkv_events = "tcp://*:5557"\n',
                           ["workers[0].kv_events"]),
    "kv_events_ipc_dp": ('[[workers]]\nurl = "http://127.0.0.1:9"\nkv_events = "ipc:///tmp/kv"\ndp_size = 2\n',
                         ["workers[0].kv_events", "dp_size"]),
    "kv_events_dp_port_overflow": ('[[workers]]\nurl = "http://127.0.0.1:9"\nkv_events = "tcp://127.0.0.1:65535"\n'
                                   'dp_size = 2\n', ["workers[0].kv_events", "65534"]),
    "kv_replay_alone": ('[[workers]]\nurl = "http://127.0.0.1:9"\nkv_replay = "tcp://127.0.0.1:5558"\n',
                        ["workers[0].kv_replay"]),
    "dp_size": ('[[workers]]\nurl = "http://127.0.0.1:9"\ndp_size = 0\n', ["workers[0].dp_size"]),
    "bootstrap_port": ('[[workers]]\nurl = "http://127.0.0.1:9"\nbootstrap_port = 70000\n',
                       ["workers[0].bootstrap_port"]),
    "workers_not_list": ('workers = "http://127.0.0.1:9"\n', ["workers"]),
    "profile_shape": ('policy = "p"\n[profiles.p]\nscorers = "least_load"\n', ["profiles.p.scorers"]),
    "profile_scorer_weight": ('policy = "p"\n[profiles.p]\nscorers = [{name = "least_load", weight = inf}]\n',
                              ["profiles.p.scorers[0].weight"]),
    "profile_shared_key": ('policy = "p"\n[profiles.p]\nshared = {branchez = 3}\n', ["profiles.p.shared", "branchez"]),
    "profile_dp_rank": ('policy = "p"\n[profiles.p]\ndp_rank = "aligned"\n', ["profiles.p.dp_rank", "phase_aligned"]),
    "profile_shared_value": ('policy = "p"\n[profiles.p]\nshared = {branches = 0}\n', ["profiles.p.shared.branches"]),
    "slo_negative": ("[slo]\nttft_ms = -1\n", ["slo.ttft_ms", ">= 0"]),
    "slo_text": ('[slo]\ntpot_ms = "50ms"\n', ["slo.tpot_ms", "number"]),
    "slo_inf": ("[slo]\ntpot_ms = inf\n", ["slo.tpot_ms", "finite"]),
    "slo_unknown": ("[slo]\nttft_s = 1\n", ["unknown slo key", "ttft_s", "ttft_ms, tpot_ms"]),
    "slo_top_level": ("ttft_ms = 1000\n", ["ttft_ms", "[slo]"]),
    "toml_syntax": ('policy = "random"\n[health\ninterval_s = 1\n', ["bad.toml", "line 2"]),
}


@pytest.mark.parametrize("name", sorted(TOML_CASES))
def test_bad_toml_config_is_one_line(name, tmp_path):
    text, fragments = TOML_CASES[name]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    proc = run_cli(["controlplane", "--listen", "127.0.0.1:0", "--config", str(path)], tmp_path)
    assert_one_line_error(proc, "omni-proxy controlplane", *fragments)


YAML_CASES = {
    "syntax": ("policy: random\nworkers:\n  - url: http://127.0.0.1:9\n   role: both\n", ["bad.yaml:4", "YAML"]),
    "not_a_table": ("- policy\n- random\n", ["bad.yaml", "table"]),
    "hash_seed_bool": ("kv_cache:\n  hash_seed: yes\n", ["kv_cache.hash_seed"]),
    "interval_string": ("health:\n  interval_s: fast\n", ["health.interval_s"]),
    "pd_flow": ("pd_flow: 3\n", ["pd_flow"]),
}


@pytest.mark.parametrize("name", sorted(YAML_CASES))
def test_bad_yaml_config_is_one_line(name, tmp_path):
    text, fragments = YAML_CASES[name]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    proc = run_cli(["controlplane", "--listen", "127.0.0.1:0", "--config", str(path)], tmp_path)
    assert_one_line_error(proc, "omni-proxy controlplane", *fragments)


FLAG_CASES = {
    "health_interval": (["--health-interval", "-1"], ["--health-interval"]),
    "metrics_interval": (["--metrics-interval", "nan"], ["--metrics-interval"]),
    "worker_weight": (["--worker", "http://127.0.0.1:9,weight=inf"], ["--worker", "weight"]),
    "worker_weight_text": (["--worker", "http://127.0.0.1:9,weight=heavy"], ["--worker", "weight"]),
    "prefill_url": (["--prefill", "ftp://127.0.0.1:9"], ["--prefill", "url"]),
    "duplicate_flag_ids": (["--worker", "http://127.0.0.1:9,id=a", "--decode", "http://127.0.0.1:10,id=a"],
                           ["--decode", "id", "unique"]),
    "listen": (["--listen", "127.0.0.1:http"], ["--listen"]),
    "missing_file": (["--config", "does-not-exist.toml"], ["does-not-exist.toml"]),
    "log_level": (["--log-level", "chatty"], ["--log-level", "DEBUG"]),
    "slo_ttft": (["--slo-ttft-ms", "-5"], ["--slo-ttft-ms", ">= 0"]),
    "slo_tpot": (["--slo-tpot-ms", "nan"], ["--slo-tpot-ms", "finite"]),
}


@pytest.mark.parametrize("name", sorted(FLAG_CASES))
def test_bad_flags_are_one_line(name, tmp_path):
    flags, fragments = FLAG_CASES[name]
    args = ["controlplane", *flags] if "--listen" in flags else ["controlplane", "--listen", "127.0.0.1:0", *flags]
    proc = run_cli(args, tmp_path)
    assert_one_line_error(proc, "omni-proxy controlplane", *fragments)


# Every port, duration and address of every command, checked when the command line is read:
# (command, flags, what the last stderr line must name).
OTHER_FLAG_CASES = {
    "dp_port": ("dataplane", ["--port", "70000"], ["--port", "0 to 65535"]),        # was: port 4464
    "dp_log_level": ("dataplane", ["--log-level", "LOUD"], ["--log-level", "DEBUG"]),   # was: a traceback
    "dp_controlplane": ("dataplane", ["--controlplane", "not_a_host:xx"], ["--controlplane", "host:port"]),
    "dp_controlplane_list": ("dataplane", ["--controlplane", "127.0.0.1:50051,cp2"], ["--controlplane"]),
    "dp_read_timeout": ("dataplane", ["--read-timeout", "0"], ["--read-timeout", "> 0"]),
    "dp_placement_timeout": ("dataplane", ["--placement-timeout", "nan"], ["--placement-timeout"]),
    "dp_queue_timeout": ("dataplane", ["--queue-timeout", "-1"], ["--queue-timeout"]),
    "dp_host": ("dataplane", ["--host", "http://0.0.0.0"], ["--host"]),
    "dp_workers": ("dataplane", ["--workers", "0"], ["--workers", "1 to 256"]),
    "dp_retries": ("dataplane", ["--retries", "-1"], ["--retries"]),
    "dp_tokenizer_prefix_cache": ("dataplane", ["--tokenizer-prefix-cache", "-5"], ["--tokenizer-prefix-cache"]),
    "dp_bulk_nice": ("dataplane", ["--bulk-nice", "20"], ["--bulk-nice", "0 to 19", "idle"]),
    "dp_bulk_nice_text": ("dataplane", ["--bulk-nice", "low"], ["--bulk-nice", "0 to 19"]),
    "cp_http_port": ("controlplane", ["--listen", "127.0.0.1:0", "--http-port", "70000"], ["--http-port"]),
    "cp_log_level": ("controlplane", ["--listen", "127.0.0.1:0", "--log-level", "LOUD"], ["--log-level"]),
    "sim_port": ("sim", ["--port", "70000"], ["--port"]),
    "sim_bootstrap_port": ("sim", ["--bootstrap-port", "-1"], ["--bootstrap-port"]),
    "sim_kv_lease": ("sim", ["--kv-lease-s", "inf"], ["--kv-lease-s"]),
    "sim_host": ("sim", ["--host", "a b"], ["--host"]),
    "ctl_controlplane": ("ctl", ["--controlplane", "not_a_host:xx", "workers"], ["--controlplane"]),
    "ctl_rpc_timeout": ("ctl", ["--rpc-timeout", "0", "workers"], ["--rpc-timeout"]),
}


@pytest.mark.parametrize("name", sorted(OTHER_FLAG_CASES))
def test_every_commands_flags_are_checked_in_one_line(name, tmp_path):
    command, flags, fragments = OTHER_FLAG_CASES[name]
    proc = run_cli([command, *flags], tmp_path)
    assert proc.returncode == 2, proc.stderr            # argparse's usage error, before anything starts
    assert_one_line_error(proc, f"omni-proxy {command}", *fragments)


def test_dataplane_missing_tokenizer_names_the_tokenizer(tmp_path):
    """Was reported as a port error (--host/--port: cannot listen)."""
    proc = run_cli(["dataplane", "--port", "0", "--controlplane", "127.0.0.1:9", "--placement-timeout", "0.2",
                    "--tokenizer", str(tmp_path / "no-model")], tmp_path)
    last = assert_one_line_error(proc, "omni-proxy dataplane", "--tokenizer", str(tmp_path / "no-model"),
                                 "tokenizer.json")
    assert "--port" not in last


def test_hash_seed_number_means_pythonhashseed(tmp_path):
    """``hash_seed = 0`` reaches the data planes as PYTHONHASHSEED=0 ("0"), not as an empty seed."""
    from controlplane.config import ControlPlaneConfig

    for raw, expected in (("0", "0"), ("42", "42"), ('"7"', "7"), ('"random"', "random")):
        path = tmp_path / "seed.toml"
        path.write_text(f"[kv_cache]\nhash_seed = {raw}\n")
        assert ControlPlaneConfig.from_file(path).kv_cache.hash_seed == expected
    path.write_text("[kv_cache]\nblock_size = 16\n")
    assert ControlPlaneConfig.from_file(path).kv_cache.hash_seed is None


@pytest.fixture
def busy_port():
    """A port held open (listening) by this test for the duration of one case."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_controlplane_grpc_port_in_use(busy_port, tmp_path):
    proc = run_cli(["controlplane", "--listen", f"127.0.0.1:{busy_port}", "--http-port", "0"], tmp_path)
    assert_one_line_error(proc, "omni-proxy controlplane", "listen", str(busy_port), "in use")
    assert "Failed to add port" not in proc.stderr, proc.stderr     # gRPC's C core says nothing first


def test_controlplane_http_port_in_use(busy_port, tmp_path):
    proc = run_cli(["controlplane", "--listen", "127.0.0.1:0", "--http-port", str(busy_port)], tmp_path)
    assert_one_line_error(proc, "omni-proxy controlplane", "http_port", str(busy_port), "in use")


def test_controlplane_session_port_in_use(busy_port, tmp_path):
    proc = run_cli(["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                    "--session-listen", f"127.0.0.1:{busy_port}"],
                   tmp_path)
    assert_one_line_error(proc, "omni-proxy controlplane", "session_listen", str(busy_port), "in use")


def test_dataplane_port_in_use(busy_port, tmp_path):
    proc = run_cli(["dataplane", "--port", str(busy_port), "--controlplane", "127.0.0.1:9",
                    "--placement-timeout", "0.2"], tmp_path)
    assert_one_line_error(proc, "omni-proxy dataplane", "--port", str(busy_port), "in use")


def test_simulator_port_in_use(busy_port, tmp_path):
    proc = run_cli(["sim", "--port", str(busy_port)], tmp_path)
    assert_one_line_error(proc, "omni-proxy sim", str(busy_port), "in use")


def test_good_config_still_starts(tmp_path):
    """The checks refuse only what is wrong: a full, valid config starts and is ready."""
    path = tmp_path / "fleet.toml"
    path.write_text("""
policy = "cache_aware"
pd_flow = "parallel"
parallel_protocol = "mooncake"
heartbeat_ttl_s = 30
[health]
interval_s = 0.5
metrics_interval_s = 2
[slo]
ttft_ms = 2000
tpot_ms = 0
[kv_cache]
block_size = 32
hash_algo = "xxhash"
hash_seed = 0
[[workers]]
url = "127.0.0.1:9"
role = "prefill"
id = "p-0"
weight = 0
bootstrap_port = 8998
kv_events = "tcp://127.0.0.1:5557"
kv_replay = "tcp://127.0.0.1:5558"
dp_size = 4
labels = {zone = "a", rank = 1}
[[workers]]
url = "http://127.0.0.1:9"
role = "decode"
""")
    with ProcessGroup(str(tmp_path), ready_timeout=TIMEOUT_S) as group:
        cp = group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--config", str(path)])
        assert cp.port > 0
