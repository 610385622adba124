"""docs/real-engines.md shows the command lines the real-vLLM tests run, and they agree with the
control plane.

The real-vLLM tests (tests/test_vllm_pd_nixl.py, tests/test_vllm_plugin.py,
tests/test_vllm_kv_events.py) build their command lines with tests/vllm_harness/recipe.py; the
page's code blocks under a ``recipe`` marker are that module's output. Checked here, with no
vLLM: the page is what the module renders now (a change to the tests' flags that is not carried
into the page fails); the page's control plane accepts the page's engines (the control plane's
own [kv_cache] check of a registering engine, and the plugin's role derivation); the page's
omni-proxy command lines parse with the real parser; and the tests really use the module.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

from tests.vllm_harness import recipe

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "real-engines.md"


def _page() -> str:
    return PAGE.read_text()


def _command(block: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of a rendered shell block: comments and `export` lines dropped."""
    lines = [ln for ln in block.splitlines() if not ln.startswith("export ")]
    words = shlex.split(" ".join(ln.split("  #")[0].rstrip().rstrip("\\") for ln in lines))
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def test_page_blocks_are_what_the_recipe_renders():
    page = _page()
    names = [m["name"] for m in recipe.MARKER.finditer(page)]
    assert sorted(names) == sorted(recipe.blocks()), f"recipe blocks on the page: {names}"
    assert recipe.render(page) == page, ("docs/real-engines.md differs from tests/vllm_harness/recipe.py: run "
                                         "`python -m tests.vllm_harness.recipe docs/real-engines.md`")


def test_page_marks_what_only_an_operator_adds():
    blocks = recipe.blocks()
    for name in ("prefill", "decode"):
        text = blocks[name][1]
        gpu_lines = [ln for ln in text.splitlines() if "GPU" in ln]
        assert gpu_lines and all("not in the tests" in ln for ln in gpu_lines), text
        assert all(flag in text for flag in recipe.GPU_ARGS[::2]) and "CUDA_VISIBLE_DEVICES" in text
        for test_only in (*recipe.TEST_ONLY_ARGS, recipe.TEST_ONLY_KV_BUFFER_DEVICE, "num-gpu-blocks-override"):
            assert test_only not in text, f"{test_only} is for the tests' CPU engines, not the page's"
    assert all(a in blocks["test-only"][1] for a in recipe.TEST_ONLY_ARGS)


def test_page_engines_register_with_the_page_control_plane():
    """The control plane of the page loads and starts its checks; each engine of the page would
    register (its hashing matches [kv_cache], the control plane's own refusal check) with the PD
    role its kv_role gives, publishing KV events the control plane can subscribe to."""
    from controlplane.cli import check_config
    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.services import hashing_mismatch
    from engine_plugins.vllm_plugin.agent import EngineFacts, Settings, role_for
    from protos import omni_proxy_pb2 as pb

    blocks = recipe.blocks()
    cfg = ControlPlaneConfig.from_dict(tomllib.loads(blocks["controlplane.toml"][1]))
    check_config(cfg)
    kvc = cfg.kv_cache
    kv = pb.KVHashConfig(enabled=True, block_size=kvc.block_size, algo=kvc.hash_algo, seed=kvc.hash_seed or "",
                         seed_set=kvc.hash_seed is not None)
    op = recipe.Operator()
    roles = {}
    for name in op.engines:
        env, argv = _command(blocks[name][1])
        assert argv[:2] == ["vllm", "serve"], argv

        def flag(f: str, argv: list[str] = argv) -> str:
            return argv[argv.index(f) + 1]
        facts = pb.EngineFacts(block_size=int(flag("--block-size")), prefix_caching="--enable-prefix-caching" in argv,
                               hash_algo=flag("--prefix-caching-hash-algo"), hash_seed=env.get("PYTHONHASHSEED", ""),
                               hash_seed_set="PYTHONHASHSEED" in env)
        assert hashing_mismatch(facts, kv) == "", hashing_mismatch(facts, kv)
        transfer = json.loads(flag("--kv-transfer-config"))
        assert transfer["kv_connector"] == "NixlConnector"
        settings = Settings.from_env(env)
        assert settings is not None and settings.controlplanes == [op.controlplane]
        assert env["VLLM_PLUGINS"] == "omni_proxy"
        roles[name] = role_for(settings, EngineFacts(host=flag("--host"), port=int(flag("--port")), models=[],
                                                     kv_role=transfer["kv_role"]))
        events = json.loads(flag("--kv-events-config"))
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        WorkerSpec.from_dict({"url": f"http://{op.host}:{flag('--port')}", "role": roles[name],
                              "kv_events": events["endpoint"].replace("*", op.host)})
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] not in ("", "0.0.0.0", "*"), "D must reach P's side channel"
    assert roles == {"prefill": "prefill", "decode": "decode"}
    sides = [recipe.nixl_env(op.host, side)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for _, _, side, _, _ in op.engines.values()]
    assert len(set(sides)) == len(sides), "one NIXL side-channel port per engine on a host"
    assert cfg.pd_flow == "sequential", "NixlConnector pulls: P then D"


def test_page_omni_proxy_commands_parse():
    from omni_proxy.cli import build_parser

    blocks = recipe.blocks()
    for name, command in (("controlplane", "controlplane"), ("dataplane", "dataplane")):
        _, argv = _command(blocks[name][1])
        assert argv[0] == "omni-proxy"
        args = build_parser().parse_args(argv[1:])
        assert args.command == command
    _, dp = _command(blocks["dataplane"][1])
    _, cp = _command(blocks["controlplane"][1])
    assert dp[dp.index("--controlplane") + 1] == cp[cp.index("--listen") + 1]


def test_the_real_vllm_tests_build_their_command_lines_from_the_recipe():
    """No second copy of the flags in the tests (where they could drift from the page)."""
    for test, uses in (("test_vllm_pd_nixl.py", ("controlplane_argv(", "dataplane_argv(")),
                       ("test_vllm_plugin.py", ("prefix_cache_args(", "plugin_env(", "controlplane_toml(",
                                                "controlplane_argv(", "dataplane_argv(")),
                       ("test_vllm_kv_events.py", ("prefix_cache_args(", "controlplane_toml("))):
        text = (ROOT / "tests" / test).read_text()
        assert "from tests.vllm_harness.recipe import" in text, test
        for call in uses:
            assert call in text, f"{test} must build with recipe.{call.rstrip('(')}"
        for literal in ("--kv-transfer-config", "enable_kv_cache_events", "--prefix-caching-hash-algo",
                        "VLLM_PLUGINS", "[kv_cache]\\n"):
            assert literal not in text, f"{test} spells {literal} itself; use tests/vllm_harness/recipe.py"
    server = (ROOT / "tests" / "vllm_harness" / "vllm_server.py").read_text()
    assert "serve_args(" in server and "nixl_args(" in server and "nixl_env(" in server


def test_readme_links_the_page():
    assert "(docs/real-engines.md)" in (ROOT / "README.md").read_text()
