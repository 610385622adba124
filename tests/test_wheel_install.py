"""The release artifacts: the sdist and wheel as ``python -m build`` makes them, installed into a
fresh virtualenv, run end to end from outside the checkout; and the engine plugin's own small
wheel, installed alone.

Every other test imports this checkout (an editable install, or PYTHONPATH). A module, .proto,
template or data file that the package metadata leaves out of the wheel would pass them all and
break every real install. Here:

* the sdist is built from the tree's files (git's list: tracked and untracked-not-ignored) and
  the wheel from that sdist, as a release does; both must hold every file of every package;
* a fresh virtualenv gets the wheel (with the ``otel`` extra) and the test runner, nothing
  else (dependencies from pip's cache or index, as an operator's ``pip install`` would);
* ``omni-proxy demo`` and three end-to-end test files (demo, aggregated, PD sequential) run
  with that virtualenv's interpreter from a directory outside the checkout, so every process
  they start (control plane, data plane, simulators) runs the installed package;
* the plugin's wheel (packaging/vllm-plugin) goes into a second fresh virtualenv: it pulls only
  grpcio and protobuf, vLLM's entry point finds it, and its registration agent, run there,
  registers a simulator engine with a real control plane and deregisters it on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import tomllib
import zipfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest

from omni_proxy.launcher import ProcessGroup, guarded, port_in, spawn
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
PACKAGES = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
PLUGIN_DIR = ROOT / "packaging" / "vllm-plugin"
PLUGIN = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())
# The end-to-end files run against the installed wheel: the README's demo, the aggregated flow
# (OpenAI client, omni-ctl, health), and the PD sequential flow.
E2E_FILES = ["tests/test_demo.py", "tests/test_e2e_aggregated.py", "tests/test_e2e_pd_sequential.py"]
# What the fresh venv gets besides the wheel: what those files import, at this environment's
# versions (so pip's cache has them).
TEST_RUNNER = ["pytest", "pytest-asyncio", "pytest-timeout", "openai"]

pytestmark = pytest.mark.timeout(900)


@dataclass
class Dists:
    sdist: Path
    wheel: Path
    plugin_wheel: Path
    sources: list[str]          # the tree's files, relative to ROOT
    work: Path


def _tree_files() -> list[str]:
    """The files a release is built from: git's tracked and untracked-but-not-ignored files, or
    (no git: an unpacked sdist) everything but caches and build output."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, timeout=60)
    if out.returncode == 0 and out.stdout:
        return sorted(f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file())
    skip = {".git", "__pycache__", "build", "dist", ".venv", ".pytest_cache"}
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                  if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p))


def _package_files(files: list[str]) -> set[str]:
    """The files that belong in the wheel: everything under the packages but the tests' caches."""
    return {f for f in files if f.split("/", 1)[0] in PACKAGES and not f.endswith(".pyc")}


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600,
         log: Path) -> tuple[int, str]:
    """Run ``cmd`` behind the launcher's guardian (it dies with this test), logging to ``log``."""
    proc = spawn(guarded(cmd), log_path=log, env=env, cwd=cwd)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = -9
    return rc, log.read_text(errors="replace")


def _clean_env(venv: Path) -> dict[str, str]:
    """This process's environment without anything that points back at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _make_venv(path: Path, requirements: list[str], log: Path) -> Path:
    rc = subprocess.run([sys.executable, "-m", "venv", str(path)], capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr
    python = path / "bin" / "python"
    rc, out = _run([str(python), "-m", "pip", "install", "-q", *requirements], cwd=path, env=_clean_env(path),
                   log=log)
    assert rc == 0, f"pip install {requirements} failed:\n{out[-4000:]}"
    return python


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Dists:
    work = tmp_path_factory.mktemp("release")
    files = _tree_files()
    src = work / "src"
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = work / "dist"
    # As a release: the sdist from the tree, then the wheel from the unpacked sdist. No isolation:
    # the build backend (setuptools) comes from this environment, nothing is downloaded.
    rc, log = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                   cwd=work, log=work / "build.log")
    assert rc == 0, log[-4000:]
    rc, log = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(out), str(src / "packaging" / "vllm-plugin")],
                   cwd=work, log=work / "plugin-build.log")
    assert rc == 0, log[-4000:]
    return Dists(sdist=next(out.glob("omni_proxy-*.tar.gz")), wheel=next(out.glob("omni_proxy-*.whl")),
                 plugin_wheel=next(out.glob("omni_proxy_vllm_plugin-*.whl")), sources=files, work=work)


@pytest.fixture(scope="module")
def venv(dists: Dists) -> Path:
    """A fresh virtualenv with the wheel (and its otel extra) and the test runner; its python."""
    runner = [f"{name}=={version(name)}" for name in TEST_RUNNER]
    return _make_venv(dists.work / "venv", [f"{dists.wheel}[otel]", *runner], dists.work / "venv-install.log")


def test_sdist_and_wheel_hold_every_package_file(dists: Dists):
    expected = _package_files(dists.sources)
    assert "protos/omni_proxy.proto" in expected and "protos/omni_proxy_pb2.py" in expected
    assert dists.sdist.name == f"omni_proxy-{VERSION}.tar.gz" and dists.wheel.name.startswith(f"omni_proxy-{VERSION}-")
    with tarfile.open(dists.sdist) as tar:
        prefix = f"omni_proxy-{VERSION}/"
        in_sdist = {n[len(prefix):] for n in tar.getnames() if n.startswith(prefix)}
    missing = sorted(expected - in_sdist)
    assert not missing, f"the sdist lacks package files (package-data in pyproject.toml?): {missing[:10]}"
    assert {"pyproject.toml", "README.md"} <= in_sdist
    names = set(zipfile.ZipFile(dists.wheel).namelist())
    missing = sorted(expected - names)
    assert not missing, f"the wheel (built from the sdist) lacks package files: {missing[:10]}"
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_points = zipfile.ZipFile(dists.wheel).read(meta).decode()
    for line in ("omni-proxy = omni_proxy.cli:main", "omni-ctl = omni_proxy.ctl:main",
                 "omni_proxy = engine_plugins.vllm_plugin:register"):
        assert line in entry_points, entry_points
    metadata = zipfile.ZipFile(dists.wheel).read(meta.replace("entry_points.txt", "METADATA")).decode()
    assert "Provides-Extra: otel" in metadata


def test_installed_wheel_runs_the_demo_outside_the_checkout(dists: Dists, venv: Path):
    elsewhere = dists.work / "elsewhere"
    elsewhere.mkdir()
    env = _clean_env(venv.parent.parent)
    where = subprocess.run([str(venv), "-c", "import omni_proxy, controlplane, dataplane, simulator, protos, "
                            "opentelemetry.sdk; print(omni_proxy.__file__, protos.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    site = str(venv.parent.parent / "lib")
    assert all(p.startswith(site) for p in where.stdout.split()), f"not the installed wheel: {where.stdout}"
    rc, out = _run([str(venv.parent / "omni-proxy"), "demo", "--requests", "12", "--concurrency", "4"],
                   cwd=elsewhere, env=env, timeout=180, log=dists.work / "demo.log")
    assert rc == 0, out[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] == summary["sent"] == 12 and summary["pd"] > 0 and summary["aggregated"] > 0, out[-2000:]


def test_end_to_end_tests_pass_against_the_installed_wheel(dists: Dists, venv: Path):
    """The e2e files, copied out of the checkout, run by the fresh venv's pytest: the package
    they import and every process they start come from the wheel."""
    run = dists.work / "run"
    shutil.copytree(ROOT / "tests", run / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    ini = PYPROJECT["tool"]["pytest"]["ini_options"]
    (run / "pytest.ini").write_text("[pytest]\n" + "".join(
        f"{k} = {' '.join(v) if isinstance(v, list) else v}\n" for k, v in ini.items() if k != "testpaths"))
    env = _clean_env(venv.parent.parent)
    rc, out = _run([str(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", *E2E_FILES],
                   cwd=run, env=env, timeout=600, log=dists.work / "e2e.log")
    assert rc == 0, out[-6000:]
    assert " passed" in out and " failed" not in out, out[-3000:]
    where = subprocess.run([str(venv), "-c", "import tests.conftest, omni_proxy; print(omni_proxy.__file__)"],
                           cwd=run, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0 and where.stdout.startswith(str(venv.parent.parent / "lib")), where


AGENT = textwrap.dedent("""
    import json, signal, sys, threading
    from engine_plugins.vllm_plugin.agent import Agent, EngineFacts, Settings
    cp, port, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    agent = Agent(Settings(controlplanes=[cp], worker_id="plugin-only"),
                  EngineFacts(host="127.0.0.1", port=port, models=["sim-model"])).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with open(ready, "w") as f:
        json.dump({"port": port}, f)
    done.wait()
    print("deregistered" if agent.stop() else "deregistration failed", flush=True)
""")


async def test_plugin_wheel_installs_alone_and_registers_an_engine(dists: Dists):
    """packaging/vllm-plugin: the plugin, the gRPC stubs and the neutral runtime helpers (the
    shared retry policy), grpcio and protobuf; nothing of the router's planes. vLLM's entry
    point loads it, and its agent registers an engine."""
    assert PLUGIN["project"]["version"] == VERSION, "the plugin's version must be the package's"
    names = set(zipfile.ZipFile(dists.plugin_wheel).namelist())
    shipped = {"engine_plugins", "protos", "omni_runtime"}
    expected = {f for f in _package_files(dists.sources) if f.split("/", 1)[0] in shipped}
    assert expected <= names, sorted(expected - names)
    assert not [n for n in names if n.split("/", 1)[0] in set(PACKAGES) - shipped], names
    work = dists.work / "plugin"
    work.mkdir()
    python = await asyncio.to_thread(_make_venv, work / "venv", [str(dists.plugin_wheel)], work / "install.log")
    env = _clean_env(work / "venv")
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=60)
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    router_deps = {d.split(">")[0].split("=")[0].split(";")[0].strip().lower()
                   for d in PYPROJECT["project"]["dependencies"]}
    pulled = sorted(installed & (router_deps - {"grpcio", "protobuf"}))
    assert not pulled, f"the plugin's wheel pulled the router's dependencies: {pulled}"
    assert {"grpcio", "protobuf", "omni-proxy-vllm-plugin"} <= installed, installed
    loaded = subprocess.run([str(python), "-c", "from importlib.metadata import entry_points; "
                             "ep = entry_points(group='vllm.general_plugins')['omni_proxy']; "
                             "register = ep.load(); register(); print(register.__module__)"],
                            cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "engine_plugins.vllm_plugin", loaded

    group = ProcessGroup(str(work), ready_timeout=60)
    try:
        sim = group.start("sim", ["sim", "--role", "both", "--port", "0"])
        cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                          "--health-interval", "0.5"])
        ready = work / "agent.ready"
        agent = group.start_program("agent", [str(python), "-c", AGENT, cp.address, str(sim.port), str(ready)],
                                    port_in(ready), env={k: v for k, v in env.items() if k != "PYTHONPATH"})

        async def workers() -> dict[str, pb.WorkerInfo]:
            async with grpc.aio.insecure_channel(cp.address) as ch:
                reply = await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
            return {w.id: w for w in reply.workers}

        async def registered() -> bool:
            w = (await workers()).get("plugin-only")
            return w is not None and w.status == pb.STATUS_HEALTHY
        await wait_until(registered, timeout=30, interval=0.2, what=f"the agent registered\n{agent.log_tail()}")
        w = (await workers())["plugin-only"]
        assert (w.source, w.model, w.url) == ("registry", "sim-model", sim.url), w
        started = time.monotonic()
        group.stop(agent)

        async def gone() -> bool:
            return "plugin-only" not in await workers()
        await wait_until(gone, timeout=15, interval=0.2, what=f"the agent deregistered\n{agent.log_tail()}")
        assert time.monotonic() - started < 15 and "deregistered" in agent.log_tail()
    finally:
        group.close()


def test_no_doc_installs_the_package_from_an_index():
    """omni-proxy is on no package index: every `pip install` of it in the docs, manifests and
    Dockerfiles names a built wheel (a path), or reads a local wheel directory (--no-index)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "deploy").rglob("*")),
             ROOT / "Dockerfile", ROOT / "docker-compose.yaml", *sorted((ROOT / "packaging").rglob("*.toml"))]
    bad = []
    for path in (p for p in texts if p.is_file()):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "pip install" not in line or "--no-index" in line:
                continue
            for token in line.split("pip install", 1)[1].replace("'", " ").replace('"', " ").split():
                name = token.split("[", 1)[0].lower().replace("_", "-")
                if name.startswith("omni-proxy") and "/" not in token and not token.endswith((".whl", ".tar.gz")):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "install from the built wheel (README 'Install'), not an index:\n" + "\n".join(bad)
