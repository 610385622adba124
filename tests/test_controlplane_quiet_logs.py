"""Ordinary events leave ordinary log lines, not tracebacks.

Real control-plane processes on loopback, their log files read:

* SIGTERM while data planes hold session-socket sessions: each session ends with its
  "disconnected" line; no ``CancelledError`` traceback (asyncio's stream callback logged
  one per live session when the connection's task ended cancelled), exit status 0.
* A control plane starting on Redis state that already holds workers (a second replica, a
  restart): no ``spec sync hook failed ... AssertionError`` per worker (the sync's hook ran a
  health check before the checker had its HTTP session); the workers are checked all the
  same, and a worker added later on another replica is checked here too.
"""

from __future__ import annotations

import asyncio

import grpc

from omni_proxy.launcher import ProcessGroup
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from protos.framing import encode, read_frames
from tests.conftest import wait_until

NOISE = ("Traceback", "CancelledError", "hook failed", "AssertionError")


def _noise(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(word in line for word in NOISE)]


async def _workers(address: str) -> dict[str, pb.WorkerInfo]:
    async with grpc.aio.insecure_channel(address) as ch:
        listed = await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    return {w.id: w for w in listed.workers}


async def test_sigterm_with_live_socket_sessions_logs_no_traceback():
    group = ProcessGroup()
    conns = []
    try:
        sim = group.start("sim", ["sim", "--role", "both", "--port", "0"])
        cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                          "--worker", f"{sim.url},role=both,id=w"])
        async with grpc.aio.insecure_channel(cp.address) as ch:
            port = (await pb_grpc.SchedulerStub(ch).GetSessionEndpoint(pb.SessionEndpointRequest(), timeout=5)).port
        for i in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(encode(pb.DataPlaneMessage(open=pb.SessionOpen(node_id=f"node{i}", batches=True))))
            first = pb.ControlPlaneMessage.FromString(await read_frames(reader).__anext__())
            assert first.WhichOneof("body") == "info"
            conns.append(writer)

        async def both_connected():
            return cp.log_path.read_text().count("connected (session") >= 2
        await wait_until(both_connected, what="both sessions logged as connected")

        rc = await asyncio.to_thread(group.stop, cp)
        log = cp.log_path.read_text(errors="replace")
        assert rc == 0, log[-3000:]
        assert log.count("disconnected (session") == 2, log[-3000:]
        assert not _noise(log), "\n".join(_noise(log))
    finally:
        for writer in conns:
            writer.close()
        group.close()


async def test_starting_on_redis_state_logs_no_hook_failure(tmp_path, redis_server):  # noqa: F811
    config = tmp_path / "cp.toml"
    config.write_text(f'[state]\nbackend = "redis"\nredis_url = "{redis_server.url}"\n'
                      f'key_prefix = "quiet-{tmp_path.name}:"\n')
    group = ProcessGroup()
    try:
        sims = [group.start(f"sim{i}", ["sim", "--role", "both", "--port", "0"]) for i in range(3)]
        args = ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--config", str(config),
                "--health-interval", "0.2"]
        first = group.start("cp1", [*args, "--worker", f"{sims[0].url},role=both,id=w0",
                                    "--worker", f"{sims[1].url},role=both,id=w1"])
        second = group.start("cp2", args)     # starts from the two workers the store holds

        async def all_healthy(address: str, ids: set[str]) -> bool:
            workers = await _workers(address)
            return ids <= set(workers) and all(workers[i].status == pb.STATUS_HEALTHY for i in ids)

        await wait_until(lambda: all_healthy(second.address, {"w0", "w1"}),
                         what="the stored workers health-checked by the replica that read them")
        async with grpc.aio.insecure_channel(first.address) as ch:   # added on the other replica
            await pb_grpc.AdminStub(ch).AddWorker(pb.RegisterRequest(url=sims[2].url, role=pb.ROLE_BOTH,
                                                                     worker_id="w2"), timeout=10)
        await wait_until(lambda: all_healthy(second.address, {"w2"}),
                         what="a worker added on the other replica health-checked here")
        for cp in (first, second):
            log = cp.log_path.read_text(errors="replace")
            assert not _noise(log), f"{cp.name}:\n" + "\n".join(_noise(log))
    finally:
        group.close()
