"""Kill a data-plane replica behind nginx: clients on the other replicas are unaffected; the
dead replica's reservations are released (issue 10).

Everything is a real process on loopback, as deployed (docker-compose.yaml): two simulated
engines slow enough that every stream is still generating when the kill comes, one control
plane (its in-memory ledger, or Redis as in the compose deployment), three data-plane
replicas, and the real nginx with deploy/nginx/nginx.conf in front of them. Nine streams are
opened through nginx (least_conn puts three on each replica), one replica is SIGKILLed, and:

* every stream served by a surviving replica completes, with all its tokens;
* new requests through nginx keep succeeding, on the survivors (nginx skips the dead one);
* the control plane notices the dead replica's session end, keeps its requests charged for
  ``session_grace_s`` (it might reconnect and claim them), then releases them: every worker's
  in-flight requests and tokens go back to zero.

Streams that were on the killed replica lose their client connection: they are counted, not
required to succeed.

Run against the memory and the Redis ledger. It failed about one run in ten, for two reasons in
the control plane, each now pinned by a deterministic in-process test at the end of this file:
the session's end could be skipped when gRPC cancelled its handler during that end, and the
release after the grace period could wake a little early, find nothing, and never try again.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import uuid
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest

from omni_proxy.launcher import Child, ProcessGroup, guarded, spawn
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.redis_fixtures import REDIS_SERVER, RedisServer
from tests.ports import reserved_port
from tests.test_deploy_manifests import NGINX, localised_conf, needs_nginx

MODEL = "sim-model"
REPLICAS = 3                 # deploy/nginx/nginx.conf names three data planes
STREAMS = 9                  # three per replica under least_conn
MAX_TOKENS = 200             # at DECODE_MS per token: ~10 s per stream, so all are in flight at the kill
DECODE_MS = 50
NEW_REQUESTS = 12            # sent through nginx after the kill
SESSION_GRACE_S = 2.0        # how long the control plane keeps a vanished data plane's requests
VICTIM = 1                   # the replica that is killed


@dataclass
class Stack:
    group: ProcessGroup
    cp: Child
    dataplanes: list[Child]
    nginx: Child
    url: str                                   # nginx
    sims: dict[str, Child] = field(default_factory=dict)
    workdir: str = ""                          # every child's log (pytest keeps the last runs' tmp_path)
    _channel: grpc.aio.Channel | None = None   # one Admin channel for all the polling

    async def admin(self, method: str, request):
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.cp.address)
        return await getattr(pb_grpc.AdminStub(self._channel), method)(request, timeout=5)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def workers(self) -> list[pb.WorkerInfo]:
        return list((await self.admin("ListWorkers", pb.ListWorkersRequest())).workers)

    async def sessions(self) -> dict[str, int]:
        return dict((await self.admin("Stats", pb.StatsRequest())).sessions)

    async def inflight(self) -> int:
        return sum(w.load.inflight_requests for w in await self.workers())

    async def delta(self, before: dict[str, int]) -> dict[str, int]:
        """Session counters (Admin Stats) since ``before``: opened, closed, requests_orphaned,
        requests_claimed, requests_released."""
        now = await self.sessions()
        return {k: now.get(k, 0) - before.get(k, 0)
                for k in ("opened", "closed", "requests_orphaned", "requests_claimed", "requests_released")}

    async def report(self, before: dict[str, int]) -> str:
        return (f"session counters since the kill {await self.delta(before)}; logs in {self.workdir}; "
                f"control plane log:\n{self.cp.log_tail(40)}")

    async def expect(self, cond, before: dict[str, int], *, timeout: float, what: str) -> None:
        """Wait until ``cond`` holds for the session counters' change since ``before``."""
        async def check() -> bool:
            return cond(await self.delta(before))

        try:
            await wait_until(check, timeout=timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {await self.report(before)}") from None

    async def all_idle(self) -> bool:
        return all(w.load.inflight_requests == 0 and w.load.inflight_tokens == 0 for w in await self.workers())


def _start_redis(group: ProcessGroup) -> RedisServer:
    """A redis-server on a unix socket (no TCP port), behind a guardian in ``group``: it dies
    with the test run like every other child."""
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed (scripts/install_services.sh installs it)")
    server = RedisServer()
    log = server.dir / "guard.log"
    proc = spawn(guarded(server._args()), log_path=log)
    group.children.append(Child(name="redis", proc=proc, port=0, log_path=log))
    server.proc = proc
    try:
        if not server._wait_ready(15):
            raise RuntimeError(f"redis-server did not answer PING:\n{server.log.read_text()[-2000:]}")
    finally:
        server.proc = None   # the group stops it
    return server


def _start_nginx(group: ProcessGroup, dataplanes: list[Child]) -> Child:
    """deploy/nginx/nginx.conf on a free loopback port in front of ``dataplanes``, plus one
    response header naming the replica that served each request."""
    tmp = group.workdir / "nginx"
    tmp.mkdir()
    listen = reserved_port()        # nginx must be told its port
    conf = localised_conf(tmp, [dp.port for dp in dataplanes], listen)
    text = conf.read_text()
    assert text.count("location / {\n") == 1, "nginx.conf has no single `location / {` block"
    text = text.replace("location / {\n", "location / {\n"
                        "            add_header X-Upstream-Addr $upstream_addr always;\n")
    conf.write_text(text)
    # pid and daemon in one -g: nginx keeps only the last -g given, and a pid file it was not
    # told about goes to /run/nginx.pid
    argv = [NGINX, "-p", f"{tmp}/", "-c", str(conf), "-e", "stderr", "-g", f"pid {tmp}/nginx.pid; daemon off;"]
    log = group.workdir / "nginx.log"
    proc = spawn(guarded(argv), log_path=log)
    child = Child(name="nginx", proc=proc, port=listen, log_path=log)
    group.children.append(child)
    return child


@pytest.fixture(params=["memory", "redis"])
def stack(request, tmp_path):
    group = ProcessGroup(str(tmp_path))   # every child's log stays in tmp_path (pytest keeps the last runs')
    redis = None
    try:
        config = group.workdir / "cp.toml"
        text = f"session_grace_s = {SESSION_GRACE_S}\n"
        if request.param == "redis":
            redis = _start_redis(group)
            text += (f'[state]\nbackend = "redis"\nredis_url = "{redis.url}"\n'
                     f'key_prefix = "kill-{uuid.uuid4().hex[:8]}:"\n')
        config.write_text(text)
        sims = {name: group.start(name, ["sim", "--role", "both", "--port", "0", "--model", MODEL,
                                         "--decode-ms-per-step", str(DECODE_MS)])
                for name in ("a", "b")}
        args = ["controlplane", "--config", str(config), "--listen", "127.0.0.1:0", "--http-port", "0",
                "--policy", "least_load", "--health-interval", "0.5", "--metrics-interval", "0.5"]
        for name, sim in sims.items():
            args += ["--worker", f"{sim.url},role=both,id={name},model={MODEL}"]
        cp = group.start("controlplane", args)
        dataplanes = [group.start(f"dp-{i}", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                              "--node-id", f"dp-{i}"])
                      for i in range(REPLICAS)]
        nginx = _start_nginx(group, dataplanes)
        yield Stack(group=group, cp=cp, dataplanes=dataplanes, nginx=nginx, url=nginx.url, sims=sims,
                    workdir=str(tmp_path))
    finally:
        try:
            group.close()
        finally:
            if redis is not None:
                shutil.rmtree(redis.dir, ignore_errors=True)


def _upstream(resp: aiohttp.ClientResponse) -> str:
    """The replica that answered: the last address nginx tried (it lists every attempt)."""
    return resp.headers["X-Upstream-Addr"].split(",")[-1].strip()


async def _finish(resp: aiohttp.ClientResponse, head: bytes) -> tuple[bool, str]:
    """Read a stream to its end: (True, body) or (False, why the connection broke)."""
    try:
        body = head + await resp.content.read()
        return True, body.decode()
    except (TimeoutError, aiohttp.ClientError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        resp.release()


def _completion_tokens(body: str) -> int:
    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: ...{body[-300:]}"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage, "no usage chunk (stream_options.include_usage)"
    return usage[-1]["completion_tokens"]


@needs_nginx
@pytest.mark.timeout(300)
async def test_killing_a_dataplane_replica_spares_the_others_and_releases_its_load(stack: Stack):
    try:
        addr = {f"127.0.0.1:{dp.port}": i for i, dp in enumerate(stack.dataplanes)}
        victim = stack.dataplanes[VICTIM]
        timeout = aiohttp.ClientTimeout(total=120, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            async def nginx_up() -> bool:
                assert stack.nginx.proc.poll() is None, stack.nginx.log_tail()
                try:
                    async with http.get(f"{stack.url}/nginx-health") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_until(nginx_up, timeout=30, what="nginx to answer")
            # every replica holds its session with the control plane (placements charge the ledger)
            await wait_until(lambda: _ge(stack.sessions(), "opened", REPLICAS), timeout=30,
                             what="all data planes to open their control-plane sessions")
            assert await stack.all_idle()

            # ---- streams through nginx, opened one after another: least_conn spreads them
            streams: list[tuple[int, asyncio.Task]] = []
            for n in range(STREAMS):
                body = {"model": MODEL, "prompt": f"stream {n} " + "words " * 20, "max_tokens": MAX_TOKENS,
                        "stream": True, "stream_options": {"include_usage": True}}
                resp = await http.post(f"{stack.url}/v1/completions", json=body, headers={"X-Request-Id": f"s{n}"})
                assert resp.status == 200, await resp.text()
                head = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30)   # it is generating
                assert head.startswith(b"data: "), head
                streams.append((addr[_upstream(resp)], asyncio.ensure_future(_finish(resp, head))))
            per_replica = [sum(1 for r, _ in streams if r == i) for i in range(REPLICAS)]
            assert min(per_replica) >= 1, f"least_conn left a replica without a stream: {per_replica}"
            on_victim = per_replica[VICTIM]
            # every stream is placed and charged; none is done yet (so each is in flight at the kill)
            await wait_until(lambda: _eq(stack.inflight(), STREAMS), what=f"{STREAMS} requests in flight")
            assert not any(task.done() for _, task in streams), "a stream ended before the kill: make them longer"

            # ---- SIGKILL one replica (its whole process group: the replica is one process)
            before = await stack.sessions()
            assert victim.proc.poll() is None
            stack.group.kill(victim)
            assert victim.proc.returncode == -signal.SIGKILL

            # ---- new requests through nginx keep succeeding, on the surviving replicas
            tried_dead, started = 0, asyncio.get_running_loop().time()
            for n in range(NEW_REQUESTS):
                stream = n % 3 == 0
                body = {"model": MODEL, "prompt": f"after the kill {n}", "max_tokens": 4, "stream": stream}
                async with http.post(f"{stack.url}/v1/completions", json=body) as r:
                    text = await r.text()
                    assert r.status == 200, f"request {n} after the kill: {r.status} {text}; logs in {stack.workdir}"
                    assert text.rstrip().endswith("data: [DONE]") if stream else json.loads(text)["choices"]
                    assert addr[_upstream(r)] != VICTIM
                    tried_dead += victim.address in r.headers["X-Upstream-Addr"]
            # nginx marks the dead replica down after max_fails=3 refused connections, for
            # fail_timeout=10s: the later requests do not try it at all
            took = asyncio.get_running_loop().time() - started
            assert tried_dead <= 3 or (took > 10 and tried_dead < NEW_REQUESTS), \
                f"{tried_dead} of {NEW_REQUESTS} requests in {took:.1f}s tried the dead replica first"

            # ---- the control plane saw the dead replica's session end; its requests are orphaned
            # (kept charged for session_grace_s: a replica that reconnects claims its requests back)
            await stack.expect(lambda d: d["closed"] >= 1 and d["requests_orphaned"] >= on_victim, before,
                               timeout=30, what="the dead replica's session to end and its requests to be orphaned")

            # ---- streams on the surviving replicas all complete, with every token
            results = [(replica, await task) for replica, task in streams]
            survivors = [(ok, body) for replica, (ok, body) in results if replica != VICTIM]
            lost = [(ok, body) for replica, (ok, body) in results if replica == VICTIM]
            for ok, body in survivors:
                assert ok, f"a stream on a surviving replica broke: {body}; logs in {stack.workdir}"
                assert _completion_tokens(body) == MAX_TOKENS
            # streams on the dead replica may break (their connection died); none may end cleanly
            # with fewer tokens than asked, which a client would take for a complete answer
            for ok, body in lost:
                if ok:
                    assert _completion_tokens(body) == MAX_TOKENS, "a cut stream looked complete"
            print(f"\nstreams per replica {per_replica}; on the killed replica: "
                  f"{sum(1 for ok, _ in lost if not ok)} of {len(lost)} broke; "
                  f"new requests that tried the dead replica first: {tried_dead} of {NEW_REQUESTS}")

            # ---- the ledger returns to zero once the session grace period has passed: the dead
            # replica's requests released by the grace period, none claimed back (it never returns)
            try:
                await wait_until(stack.all_idle, timeout=SESSION_GRACE_S + 30,
                                 what="every worker's in-flight requests and tokens back to zero")
            except AssertionError as exc:
                loads = {w.id: (w.load.inflight_requests, w.load.inflight_tokens) for w in await stack.workers()}
                raise AssertionError(f"{exc}: (requests, tokens) by worker {loads}; {await stack.report(before)}") \
                    from None
            # only the dead replica's session ended (the survivors' sessions were not disturbed)
            assert await stack.delta(before) == {"opened": 0, "closed": 1, "requests_orphaned": on_victim,
                                                 "requests_claimed": 0, "requests_released": on_victim}, \
                await stack.report(before)
            assert all(dp.proc.poll() is None for i, dp in enumerate(stack.dataplanes) if i != VICTIM)
    finally:
        await stack.close()


async def _eq(value, expected) -> bool:
    return await value == expected


async def _ge(sessions, key: str, n: int) -> bool:
    return (await sessions).get(key, 0) >= n


async def test_a_session_cancelled_during_its_teardown_still_orphans_its_requests(inproc_cp, monkeypatch):
    """The race the test above ran into about one time in ten: a killed data plane's stream
    ends (the session's reader sees EOF) and the control plane starts ending the session; gRPC
    then cancels the handler, as it does when the peer is gone. The session's requests must
    still be orphaned and released after the grace period; they used to stay charged until
    max_request_age_s (an hour). Here one of the session's tasks is slow to stop, so the
    cancel lands while the session's end waits for it."""
    from controlplane.services import SchedulerService

    cp = inproc_cp
    cp.lifecycle.session_grace_s = 0.2
    stopping = asyncio.Event()

    async def slow_to_stop(self, out):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await asyncio.sleep(0.5)
            raise

    monkeypatch.setattr(SchedulerService, "_push_fleet", slow_to_stop)

    async def load() -> tuple[int, int]:
        return (await cp.store.loads(["w"]))["w"].requests, len(await cp.store.records())

    async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.grpc_port}") as channel:
        call = pb_grpc.SchedulerStub(channel).Session()
        await call.write(pb.DataPlaneMessage(open=pb.SessionOpen(node_id="dp-doomed")))
        await call.write(pb.DataPlaneMessage(place=pb.PlaceRequest(
            seq=1, request_id="r1", leg=pb.LEG_ENTRY, prompt_tokens=10, max_tokens=5)))
        while (msg := await call.read()).WhichOneof("body") != "placement":
            pass
        assert not msg.placement.error and await load() == (1, 1)
        await call.done_writing()      # the reader sees the end of the stream: the session ends
        await asyncio.wait_for(stopping.wait(), 10)
        call.cancel()                  # and the connection dies meanwhile: gRPC cancels the handler

    sessions = cp.placer.stats.sessions

    async def orphaned_then_released() -> bool:
        return sessions["requests_orphaned"] == 1 and await load() == (0, 0)

    await wait_until(orphaned_then_released, timeout=10,
                     what="the session's request to be orphaned and released after the grace period")
    assert sessions["closed"] == 1 and sessions["requests_released"] == 1


async def test_orphans_are_released_even_when_the_grace_timer_fires_early(inproc_cp, monkeypatch):
    """The other cause the test above found (about one run in ten): the release after the
    grace period woke 0.6 ms early (uvloop's timers fire by a loop clock cached per turn, in
    whole milliseconds), found no request orphaned that long ago, and never tried again: the
    dead replica's requests stayed charged. Here every sleep ends 5 ms early."""
    from dataplane.placement_client import PlacementClient

    cp = inproc_cp
    cp.lifecycle.session_grace_s = 0.3
    real_sleep = asyncio.sleep

    async def early_sleep(delay, *args, **kwargs):
        return await real_sleep(max(0.0, delay - 0.005), *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", early_sleep)

    async def load() -> tuple[int, int]:
        return (await cp.store.loads(["w"]))["w"].requests, len(await cp.store.records())

    client = PlacementClient(f"127.0.0.1:{cp.grpc_port}", "dp-doomed", timeout_s=5.0)
    await client.start()
    try:
        assert await client.wait_connected(10)
        placement = await client.place(pb.PlaceRequest(request_id="r1", leg=pb.LEG_ENTRY, prompt_tokens=10,
                                                       max_tokens=5))
        assert not placement.error and await load() == (1, 1)
    finally:
        await client.close()          # the node is gone; its request is still streaming, maybe
    sessions = cp.placer.stats.sessions

    async def released() -> bool:
        return await load() == (0, 0)

    await wait_until(released, timeout=5, what="the orphaned request to be released after the grace period")
    assert sessions["requests_orphaned"] == 1 and sessions["requests_released"] == 1
