"""Shared fixtures: real processes on loopback (simulators, control plane, data plane)."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest

from omni_proxy.launcher import Child, ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc

# The redis-server fixtures (redis_server, redis_persistent), usable by name in every test module.
pytest_plugins = ["tests.redis_fixtures"]


async def wait_until(cond: Callable[[], Awaitable[bool] | bool], *, timeout: float = 15.0, what: str = "condition",
                     interval: float = 0.05) -> None:
    """Poll ``cond`` (a plain or an async callable) until it holds; fail with ``what`` after
    ``timeout`` seconds. The one waiting helper of the tests: wait for the condition that
    proves what a test expects, never sleep for a guessed time."""
    deadline = time.monotonic() + timeout
    while True:
        held = cond()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def child_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s direct children, read from /proc (a process that exits while it
    is read is left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):   # gone meanwhile
                continue
    return out


async def cancel_until_done(task: asyncio.Future, tries: int = 100) -> bool:
    """Cancel ``task`` until it ends (a cancel can be swallowed by redis-py's ``wait_for``
    before Python 3.12); False if it never did. For cleaning up after a failed check."""
    for _ in range(tries):
        task.cancel()
        if (await asyncio.wait({task}, timeout=0.05))[0]:
            return True
    return False


@dataclass
class Cluster:
    group: ProcessGroup
    sims: dict[str, Child]
    cp: Child
    dp: Child
    worker_ids: dict[str, str] = field(default_factory=dict)   # sim name -> worker id
    # worker id -> (weight, draining) when restore() first ran: what it restores
    baseline: dict[str, tuple[float, bool]] | None = None

    @property
    def url(self) -> str:
        return self.dp.url

    def admin(self) -> pb_grpc.AdminStub:
        channel = grpc.aio.insecure_channel(self.cp.address)
        return pb_grpc.AdminStub(channel)

    async def workers(self) -> dict[str, pb.WorkerInfo]:
        async with grpc.aio.insecure_channel(self.cp.address) as ch:
            resp = await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
        return {w.id: w for w in resp.workers}

    async def all_idle(self) -> bool:
        return all(w.load.inflight_requests == 0 and w.load.inflight_tokens == 0
                   for w in (await self.workers()).values())

    async def sim_get(self, name: str, path: str) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.sims[name].url + path) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def sim_post(self, name: str, path: str, body: dict) -> None:
        async with aiohttp.ClientSession() as s, s.post(self.sims[name].url + path, json=body) as r:
            assert r.status in (200, 204), await r.text()

    async def sim_requests(self, name: str) -> list[dict]:
        return (await self.sim_get(name, "/sim/requests"))["requests"]

    async def engine_idle(self, name: str) -> bool:
        state = await self.sim_get(name, "/sim/state")
        return state["running"] == 0 and state["waiting"] == 0

    async def fresh(self) -> None:
        """A clean slate for one test: no load, no recorded requests, no armed faults, the
        admin state of :meth:`restore`."""
        await self.restore()
        await wait_until(self.all_idle, what="idle before the test")
        await self.clear_sim_requests()

    async def restore(self) -> None:
        """Undo what a test may have changed, whether it passed or failed (call it from a
        fixture's teardown): no armed faults; every worker back at the weight and drain state
        it had at the first call; workers added since (registry, AddWorker) removed."""
        for name in self.sims:
            await self.sim_post(name, "/sim/faults", {"clear": True})
        async with grpc.aio.insecure_channel(self.cp.address) as ch:
            admin = pb_grpc.AdminStub(ch)
            workers = (await admin.ListWorkers(pb.ListWorkersRequest(), timeout=5)).workers
            if self.baseline is None:
                self.baseline = {w.id: (w.weight, w.draining) for w in workers}
            for w in workers:
                ref = pb.WorkerRef(worker_id=w.id)
                if w.id not in self.baseline:
                    try:
                        await admin.RemoveWorker(ref, timeout=5)
                    except grpc.aio.AioRpcError as exc:   # gone meanwhile (a heartbeat TTL)
                        if exc.code() != grpc.StatusCode.NOT_FOUND:
                            raise
                    continue
                weight, draining = self.baseline[w.id]
                if w.draining != draining:
                    await (admin.Drain if draining else admin.Undrain)(ref, timeout=5)
                if w.weight != weight:
                    await admin.SetWeight(pb.SetWeightRequest(worker_id=w.id, weight=weight), timeout=5)

    async def clear_sim_requests(self) -> None:
        async with aiohttp.ClientSession() as s:
            for child in self.sims.values():
                async with s.delete(child.url + "/sim/requests") as r:
                    assert r.status in (200, 204)


def start_cluster(sims: dict[str, str], *, policy: str = "least_load", cp_args: list[str] = (),
                  dp_args: list[str] = (), sim_args: dict[str, list[str]] | None = None) -> Cluster:
    """``sims`` maps a name to a role; each becomes a worker whose id is that name."""
    group = ProcessGroup()
    try:
        children = {}
        for name, role in sims.items():
            extra = (sim_args or {}).get(name, [])
            children[name] = group.start(name, ["sim", "--role", role, "--port", "0", *extra])
        args = ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--policy", policy,
                "--health-interval", "0.2", "--metrics-interval", "0.2", *cp_args]
        for name, role in sims.items():
            spec = f"{children[name].url},role={role},id={name}"
            if children[name].info.get("bootstrap_port"):
                spec += f",bootstrap_port={children[name].info['bootstrap_port']}"
            args += ["--worker", spec]
        cp = group.start("controlplane", args)
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address, *dp_args])
        return Cluster(group=group, sims=children, cp=cp, dp=dp, worker_ids={n: n for n in sims})
    except BaseException:
        group.close()
        raise


@pytest.fixture(scope="module")
def sim_both():
    """One aggregated simulator for tests that run the control plane in process."""
    group = ProcessGroup()
    try:
        yield group.start("sim", ["sim", "--role", "both", "--port", "0"])
    finally:
        group.close()


@pytest.fixture
async def inproc_cp(sim_both):
    """A control plane in this process (its state can be inspected) with worker ``w``."""
    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.server import ControlPlane
    from controlplane.workers import Role

    config = ControlPlaneConfig(http_port=0, listen="127.0.0.1:0",
                                workers=[WorkerSpec(url=sim_both.url, role=Role.BOTH, id="w")])
    plane = ControlPlane(config)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session
