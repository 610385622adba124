"""omni-ctl without traps, against real processes: add checks first (and adds nothing that fails
unless --force), --replace keeps the id and every field not given, explain changes no metric,
exit statuses are distinct, --timeout no longer means two things, remove of a plugin-registered
engine holds against its heartbeats, an operator's weight and drain survive re-registration,
and (with a state file) a control-plane restart."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import aiohttp
import pytest

from omni_proxy.launcher import Child, ProcessGroup
from tests.conftest import wait_until
from tests.redis_fixtures import redis_replicas

MODEL = "sim-model"


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ctl(address: str, *argv: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", address, *argv],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "", **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


async def workers(address: str) -> dict[str, dict]:
    rc, out, err = await ctl(address, "workers", "--json")
    assert rc == 0, err
    return {w["id"]: w for w in json.loads(out)["workers"]}


@pytest.fixture(scope="module")
def sims():
    group = ProcessGroup()
    try:
        yield group, {n: group.start(f"sim-{n}", ["sim", "--role", "both", "--port", "0"]) for n in ("a", "b", "c")}
    finally:
        group.close()


def start_cp(group: ProcessGroup, *extra: str, name: str = "controlplane") -> Child:
    return group.start(name, ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                              "--health-interval", "0.2", "--metrics-interval", "0.2", *extra])


@pytest.fixture
def cp(sims):
    """A control plane of its own with config workers a and b."""
    group, s = sims
    child = start_cp(group, "--worker", f"{s['a'].url},id=a", "--worker", f"{s['b'].url},id=b")
    try:
        yield child
    finally:
        group.stop(child)


async def healthy(address: str, *ids: str) -> bool:
    ws = await workers(address)
    return all(i in ws and ws[i]["status"] == "healthy" for i in ids)


async def test_add_checks_first_and_adds_nothing_that_fails_unless_force(cp, sims):
    _, s = sims
    await wait_until(lambda: healthy(cp.address, "a", "b"), what="a and b healthy")
    dead = f"http://127.0.0.1:{free_port()}"
    rc, _, err = await ctl(cp.address, "add", dead, "--id", "dead")
    assert rc == 5 and "UNAVAILABLE" in err and "nothing was changed" in err and "--force" in err, err
    rc, _, err = await ctl(cp.address, "add", s["c"].url, "--id", "c", "--model", "not-served")
    assert rc == 4 and "does not list model 'not-served'" in err, err
    assert set(await workers(cp.address)) == {"a", "b"}
    rc, out, err = await ctl(cp.address, "add", s["c"].url, "--id", "c")
    assert rc == 0 and "passed its first check" in out, (out, err)
    rc, out, err = await ctl(cp.address, "add", dead, "--id", "dead", "--force", "--json")
    assert rc == 0, err
    assert json.loads(out)["check_error"] and (await workers(cp.address))["dead"]["status"] == "unhealthy"


async def test_replace_keeps_id_and_every_field_not_given(sims, tmp_path):
    group, s = sims
    events = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "cp.toml"
    config.write_text(f'[[workers]]\nurl = "{s["a"].url}"\nid = "kv-a"\nkv_events = "{events}"\n'
                      f'weight = 2.0\nbootstrap_port = 7000\nlabels = {{zone = "z1"}}\n')
    child = start_cp(group, "--config", str(config), name="cp-replace")
    try:
        await wait_until(lambda: healthy(child.address, "kv-a"), what="kv-a healthy")
        rc, _, err = await ctl(child.address, "drain", "kv-a")
        assert rc == 0, err
        rc, out, err = await ctl(child.address, "add", s["a"].url, "--replace", "--json")
        assert rc == 0, err
        w = json.loads(out)
        assert w["id"] == "kv-a" and w["kv_events"] == events and w["weight"] == 2.0, w
        assert w["draining"] is True and w["bootstrap_port"] == 7000 and w["labels"] == {"zone": "z1"}, w
        assert w["model"] == MODEL and w["role"] == "both"
        rc, out, err = await ctl(child.address, "add", s["a"].url, "--replace", "--weight", "3", "--json")
        assert rc == 0, err
        w = json.loads(out)
        assert (w["id"], w["weight"], w["kv_events"]) == ("kv-a", 3.0, events), w
        assert set(await workers(child.address)) == {"kv-a"}
    finally:
        group.stop(child)


async def _metric_lines(child: Child, prefix: str) -> list[str]:
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{child.info['http_port']}/metrics") as r:
        assert r.status == 200
        return [line for line in (await r.text()).splitlines() if line.startswith(prefix)]


async def test_explain_is_a_dry_run_that_counts_nothing(cp):
    await wait_until(lambda: healthy(cp.address, "a", "b"), what="a and b healthy")
    before = await _metric_lines(cp, "omni_placement_errors")
    rc, out, err = await ctl(cp.address, "explain", "--model", "no-such-model")
    assert rc == 1 and "UNKNOWN_MODEL" in out, (out, err)
    rc, out, err = await ctl(cp.address, "explain", "--model", MODEL, "--json")
    assert rc == 0 and json.loads(out)["chosen"]["decode"] in ("a", "b"), err
    assert await _metric_lines(cp, "omni_placement_errors") == before
    rc, out, _ = await ctl(cp.address, "stats", "--json")
    assert json.loads(out)["errors"] == {} and json.loads(out)["placements_total"] == 0


async def test_exit_statuses_are_distinct_and_documented(cp):
    rc, out, _ = await ctl(cp.address, "--help")
    assert rc == 0 and "exit status" in out and "6  timeout" in out
    assert (await ctl(cp.address, "weight", "a", "heavy"))[0] == 2                    # usage
    assert (await ctl(cp.address, "add", "ftp://x:1"))[0] == 2                       # usage: the URL
    rc, _, err = await ctl(cp.address, "remove", "nobody")
    assert rc == 3 and "NOT_FOUND" in err                                            # not found
    rc, _, err = await ctl(cp.address, "add", "http://127.0.0.1:9", "--id", "a")
    assert rc == 4 and "ALREADY_EXISTS" in err                                       # conflict
    rc, _, err = await ctl(f"127.0.0.1:{free_port()}", "workers")
    assert rc == 5 and "UNAVAILABLE" in err                                          # unavailable
    with socket.socket() as silent:   # accepts, never answers: the call runs out of time
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        rc, _, err = await ctl(f"127.0.0.1:{silent.getsockname()[1]}", "--rpc-timeout", "0.5", "workers")
    assert rc == 6 and "DEADLINE_EXCEEDED" in err                                    # timeout
    for argv in (("--timeout", "3", "workers"), ("drain", "a", "--wait", "--timeout", "3")):
        rc, _, err = await ctl(cp.address, *argv)
        assert rc == 2 and "--rpc-timeout" in err and "--wait-timeout" in err, err
    assert not (await workers(cp.address))["a"]["draining"]


async def test_without_a_state_file_every_change_says_it_is_lost(cp):
    rc, out, err = await ctl(cp.address, "weight", "a", "2")
    assert rc == 0 and "a: weight 2" in out and "lost" in err and "--state-file" in err, (out, err)
    rc, out, _ = await ctl(cp.address, "weight", "a", "1", "--json")
    assert json.loads(out)["persistence"] is None
    assert "are lost when this control plane restarts" in cp.log_path.read_text()


async def test_admin_changes_survive_a_restart_with_a_state_file(sims, tmp_path):
    group, s = sims
    state = tmp_path / "state" / "admin.json"
    state.parent.mkdir()
    args = ["--state-file", str(state), "--worker", f"{s['a'].url},id=a", "--worker", f"{s['b'].url},id=b"]
    child = start_cp(group, *args, name="cp-state")
    try:
        for argv in (("drain", "a"), ("weight", "a", "2.5"), ("remove", "b"),
                     ("add", s["c"].url, "--id", "c", "--weight", "4")):
            rc, out, err = await ctl(child.address, *argv)
            assert rc == 0 and not err, (argv, out, err)
        rc, out, _ = await ctl(child.address, "undrain", "c", "--json")
        assert json.loads(out)["persistence"] == f"file {state}"
        assert json.loads(state.read_text())["version"] == 1
        assert [p.name for p in state.parent.iterdir()] == ["admin.json"]    # no temporary file left

        for _ in range(2):   # twice: the state the first restart read is written back whole
            group.stop(child)
            child = start_cp(group, *args, name="cp-state")
            ws = await workers(child.address)
            assert set(ws) == {"a", "c"}, ws
            assert ws["a"]["draining"] is True and ws["a"]["weight"] == 2.5
            assert ws["c"]["weight"] == 4.0 and ws["c"]["source"] == "admin" and ws["c"]["url"] == s["c"].url
            rc, _, err = await ctl(child.address, "weight", "c", "4")
            assert rc == 0, err

        rc, _, err = await ctl(child.address, "add", s["b"].url, "--id", "b")   # lifts the removal
        assert rc == 0, err
        group.stop(child)
        child = start_cp(group, *args, name="cp-state")
        assert set(await workers(child.address)) == {"a", "b", "c"}
    finally:
        group.stop(child)


def test_unreadable_state_file_stops_the_start_in_one_line(tmp_path):
    from tests.test_bad_config import REPO, assert_one_line_error, run_cli

    bad = tmp_path / "admin.json"
    bad.write_text("{not json")
    proc = run_cli(["controlplane", "--listen", "127.0.0.1:0", "--state-file", str(bad)], tmp_path)
    assert_one_line_error(proc, "state.file", str(bad))
    proc = run_cli(["controlplane", "--listen", "127.0.0.1:0", "--state-file", str(tmp_path / "no" / "x.json")],
                   REPO)
    assert_one_line_error(proc, "state.file", "does not exist")


# ------------------------------------------------------------- engines that register themselves


@pytest.fixture
async def plugin_cp():
    from controlplane.config import ControlPlaneConfig
    from controlplane.server import ControlPlane

    plane = ControlPlane(ControlPlaneConfig(
        http_port=0, listen="127.0.0.1:0", heartbeat_interval_s=0.2, heartbeat_ttl_s=5.0))
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


@pytest.fixture
async def engine():
    from tests.test_engine_plugin import StandInEngine

    e = await StandInEngine().start()
    try:
        yield e
    finally:
        await e.stop()


def _agent(plane, engine, worker_id: str):
    from engine_plugins.vllm_plugin.agent import Agent, Settings
    from tests.test_engine_plugin import facts_for

    return Agent(Settings(controlplanes=[f"127.0.0.1:{plane.grpc_port}"], worker_id=worker_id, rpc_timeout_s=2.0),
                 facts_for(engine), refused_retry_s=0.3).start()


async def test_remove_of_a_plugin_engine_holds_until_it_restarts(plugin_cp, engine):
    address = f"127.0.0.1:{plugin_cp.grpc_port}"
    agent = _agent(plugin_cp, engine, "eng-1")
    try:
        await wait_until(lambda: _has(plugin_cp, "eng-1"), what="the engine registered")
        rc, out, err = await ctl(address, "remove", "eng-1")
        assert rc == 0 and "refused until it restarts" in out, (out, err)

        async def refused() -> bool:
            return "removed by an operator" in agent.refused

        # the next heartbeat is answered known=false, the registration after it is refused
        await wait_until(refused, what="the plugin's registration refused")
        assert plugin_cp.fleet.get("eng-1") is None and agent.registrations == 1
    finally:
        await asyncio.to_thread(agent.stop)
    assert plugin_cp.fleet.get("eng-1") is None
    agent = _agent(plugin_cp, engine, "eng-1")       # the engine restarts: a new registration
    try:
        await wait_until(lambda: _has(plugin_cp, "eng-1"), what="the restarted engine registered")
        assert "eng-1" not in plugin_cp.admin_state.removed
    finally:
        await asyncio.to_thread(agent.stop)


async def _has(plane, worker_id: str) -> bool:
    return plane.fleet.get(worker_id) is not None


async def test_operator_weight_and_drain_survive_reregistration(plugin_cp, engine):
    address = f"127.0.0.1:{plugin_cp.grpc_port}"
    agent = _agent(plugin_cp, engine, "eng-2")
    try:
        await wait_until(lambda: _has(plugin_cp, "eng-2"), what="the engine registered")
        for argv in (("weight", "eng-2", "3"), ("drain", "eng-2")):
            rc, _, err = await ctl(address, *argv)
            assert rc == 0, err
    finally:
        await asyncio.to_thread(agent.stop)           # deregisters: the engine restarts
    assert plugin_cp.fleet.get("eng-2") is None
    agent = _agent(plugin_cp, engine, "eng-2")
    try:
        await wait_until(lambda: _has(plugin_cp, "eng-2"), what="the engine registered again")
        spec = plugin_cp.fleet.get("eng-2")
        assert spec.weight == 3.0 and spec.draining is True
        plugin_cp.fleet.remove("eng-2")               # as after a control-plane restart: known=false
        await wait_until(lambda: _has(plugin_cp, "eng-2"), what="re-registration after known=false")
        assert plugin_cp.fleet.get("eng-2").weight == 3.0
    finally:
        await asyncio.to_thread(agent.stop)


async def test_remove_holds_on_every_replica_through_redis(redis_server):  # noqa: F811
    """Two control-plane replicas sharing Redis: an engine removed through one is refused by the
    other too (its heartbeats may go to either), until a new engine process registers."""
    import uuid

    import grpc

    from protos import omni_proxy_pb2 as pb
    from protos import omni_proxy_pb2_grpc as pb_grpc

    url = "http://127.0.0.1:21"
    async with redis_replicas(redis_server.url, f"fence-{uuid.uuid4().hex[:8]}:", heartbeat_ttl_s=30.0) as planes:
        a, b = planes
        async with grpc.aio.insecure_channel(f"127.0.0.1:{b.grpc_port}") as cb:
            reg_b = pb_grpc.RegistryStub(cb)
            register = pb.RegisterRequest(url=url, role=pb.ROLE_BOTH, worker_id="eng-f", owner_key="key-f")
            await reg_b.Register(register, timeout=5)

            async def seen_by_a() -> bool:
                return a.fleet.get("eng-f") is not None

            await wait_until(seen_by_a, what="the registration to reach the replica omni-ctl talks to")
            rc, out, err = await ctl(f"127.0.0.1:{a.grpc_port}", "remove", "eng-f")
            assert rc == 0, err

            async def gone_from_b() -> bool:
                return b.fleet.get("eng-f") is None

            await wait_until(gone_from_b, what="the removal to reach the other replica")
            assert not (await reg_b.Heartbeat(pb.HeartbeatRequest(worker_id="eng-f", owner_key="key-f"),
                                              timeout=5)).known
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await reg_b.Register(register, timeout=5)       # the same engine, at the other replica
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "removed by an operator" in refused.value.details()
            restarted = pb.RegisterRequest(url=url, role=pb.ROLE_BOTH, worker_id="eng-f", owner_key="key-new")
            assert (await reg_b.Register(restarted, timeout=5)).worker_id == "eng-f"
            await reg_b.Deregister(pb.DeregisterRequest(worker_id="eng-f", owner_key="key-new"), timeout=5)
