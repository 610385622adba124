"""Bounded soak: steady mixed traffic through two data planes while faults are injected.

Everything runs on loopback as real processes (omni_proxy.launcher.ProcessGroup): two
aggregated engine simulators, a prefill/decode simulator pair (sequential PD), a control
plane and two data planes. An open-loop client sends a steady mix of requests
(completions and chat, streamed and not, short to long prompts) alternately to both data
planes, while a fault loop picks, at random intervals, one of:

* ``engine_kill``: an engine is killed (SIGKILL) and restarted on the same port,
* ``5xx_burst``: an engine answers the next N requests with 500/502/503 (or 429), via
  the simulator's ``/sim/faults``,
* ``stall``: an engine holds the next N requests for longer than the data planes'
  ``--read-timeout`` before answering,
* ``controlplane_restart``: the control plane (one replica of two with ``--redis``) is
  killed and started again on the same port.

With ``--redis`` the control plane is two replicas on ``[state] backend = "redis"`` (a
redis-server of its own, appendonly), the data planes know both, and three Redis faults
join the draw (each at most ``--redis-faults-max`` times):

* ``redis_kill``: Redis is killed (SIGKILL) and started again with its data (AOF),
* ``redis_empty``: Redis is killed and started again *without* its data (a new pod),
* ``redis_stall``: Redis is stopped (SIGSTOP) for 1 s to ``--redis-stall-max`` s, then resumed.

Every request ends in one of four buckets:

* ``succeeded``: 200 with a complete JSON answer, or a stream ending with ``data: [DONE]``,
* ``clean_error``: an HTTP error status with an OpenAI error JSON body, or a stream that
  ends with an OpenAI error event (``data: {"error": ...}``),
* ``lost``: anything else (connection reset, truncated stream or body, non-JSON error),
* ``hung``: no complete answer within ``--deadline`` seconds.

``lost`` and ``hung`` must be 0, and so must the load left in every replica's ledger once
the traffic is over (``leaked_load``: in-flight requests per worker as ``omni-ctl workers``
shows them, read until they are 0 or ``--settle`` seconds passed). The resident memory
(VmRSS) of every process is read after warm-up, every second (peak) and at the end;
processes the faults restarted are marked.

    python -m bench.soak --minutes 10          # writes docs/benchmarks/soak.{json,md}
    python -m bench.soak --minutes 0.33 --out /tmp/soak
    python -m bench.soak --minutes 3 --redis --out /tmp/soak-redis
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omni_proxy.launcher import Child, LaunchError, ProcessGroup  # noqa: E402
from protos import omni_proxy_pb2 as pb  # noqa: E402
from protos import omni_proxy_pb2_grpc as pb_grpc  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while prefill and decode engines move kv "
         "blocks between accelerators under a scheduler that places every request").split()
FAULTS = ("engine_kill", "5xx_burst", "stall", "controlplane_restart")
REDIS_FAULTS = ("redis_kill", "redis_empty", "redis_stall")


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _child_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return pid
    return int(kids[0]) if kids else pid


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    clean_error: int = 0
    lost: int = 0
    hung: int = 0
    by_kind: Counter = field(default_factory=Counter)         # "chat/stream" -> sent
    errors: Counter = field(default_factory=Counter)          # "503 no_worker..." -> count
    lost_samples: list = field(default_factory=list)
    latencies: list = field(default_factory=list)

    def lost_one(self, what: str) -> None:
        self.lost += 1
        if len(self.lost_samples) < 20:
            self.lost_samples.append(what)


def make_body(rng: random.Random, i: int) -> tuple[str, dict, str]:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    size = rng.choice((8, 64, 512, 2048))
    prompt = " ".join(rng.choice(WORDS) for _ in range(size)) + f" #{i}"
    max_tokens = rng.choice((4, 16, 64, 128))
    kind = f"{'chat' if chat else 'completions'}/{'stream' if stream else 'json'}"
    if chat:
        return "/v1/chat/completions", {"model": "sim-model", "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "stream": stream}, kind
    return "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens,
                               "stream": stream}, kind


def _is_error_json(data: bytes) -> str | None:
    """The error's message when ``data`` is an OpenAI error object, else None."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return None


async def one_request(session: aiohttp.ClientSession, url: str, path: str, body: dict, tally: Tally) -> None:
    start = time.monotonic()
    try:
        async with session.post(url + path, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:
            data = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, ConnectionError) as exc:
        tally.lost_one(f"{type(exc).__name__}: {exc}")
        return
    if status != 200:
        message = _is_error_json(data)
        if message is None:
            tally.lost_one(f"{status} without OpenAI error JSON: {data[:200]!r}")
        else:
            tally.clean_error += 1
            tally.errors[f"{status} {message[:60]}"] += 1
        return
    if body.get("stream"):
        text = data.rstrip()
        if text.endswith(b"data: [DONE]"):
            tally.succeeded += 1
            tally.latencies.append(time.monotonic() - start)
            return
        last = text.rsplit(b"\n\n", 1)[-1]
        message = _is_error_json(last[6:]) if last.startswith(b"data: ") else None
        if message is None:
            tally.lost_one(f"stream cut without [DONE] or error event: ...{data[-200:]!r}")
        else:
            tally.clean_error += 1
            tally.errors[f"stream error event: {message[:60]}"] += 1
        return
    try:
        obj = orjson.loads(data)
        ok = isinstance(obj, dict) and bool(obj.get("choices"))
    except orjson.JSONDecodeError:
        ok = False
    if ok:
        tally.succeeded += 1
        tally.latencies.append(time.monotonic() - start)
    else:
        tally.lost_one(f"200 without a completion: {data[:200]!r}")


async def bounded_request(session, url, path, body, tally: Tally, deadline: float) -> None:
    try:
        await asyncio.wait_for(one_request(session, url, path, body, tally), deadline)
    except TimeoutError:
        tally.hung += 1
        if len(tally.lost_samples) < 20:
            tally.lost_samples.append(f"hung: no answer within {deadline}s ({path}, stream={body.get('stream')})")


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.group = ProcessGroup(ready_timeout=60.0)
        self.specs: dict[str, list[str]] = {}
        self.procs: dict[str, Child] = {}
        self.restarts: Counter = Counter()
        self.rss_start: dict[str, int | None] = {}
        self.rss_peak: Counter = Counter()
        self.faults: list[dict] = []
        self.redis_dir: Path | None = None
        self.cps = [f"controlplane-{i}" for i in (1, 2)] if args.redis else ["controlplane"]

    # ---- processes -------------------------------------------------------------------
    def _start(self, name: str, cmd: list[str]) -> Child:
        child = self.group.start(name, cmd)
        self.procs[name] = child
        if "--port" in cmd and cmd[cmd.index("--port") + 1] == "0":   # pin the port for restarts
            cmd = list(cmd)
            cmd[cmd.index("--port") + 1] = str(child.port)
        self.specs[name] = cmd
        return child

    def start_all(self) -> None:
        for name, role in (("agg-1", "both"), ("agg-2", "both"), ("prefill", "prefill"), ("decode", "decode")):
            self._start(name, ["sim", "--role", role, "--port", "0", "--decode-ms-per-step", "2"])
        extra: list[str] = []
        if self.args.redis:
            self.start_redis()
            config = self.group.workdir / "controlplane.toml"
            url = f"redis://127.0.0.1:{self.procs['redis'].port}/0"
            config.write_text(f'[state]\nbackend = "redis"\nredis_url = "{url}"\nkey_prefix = "soak:"\n')
            extra = ["--config", str(config)]
        for name in self.cps:
            cp = self.group.start(name, self.cp_cmd("127.0.0.1:0", extra))
            self.procs[name] = cp
            self.specs[name] = self.cp_cmd(cp.address, extra)
        targets = ",".join(self.procs[name].address for name in self.cps)
        for i in (1, 2):
            self._start(f"dataplane-{i}", ["dataplane", "--port", "0", "--controlplane", targets,
                                           "--node-id", f"soak-dp{i}", "--read-timeout", str(self.args.read_timeout),
                                           "--access-log" if self.args.access_log else "--no-access-log"])

    def cp_cmd(self, listen: str, extra: list[str]) -> list[str]:
        return ["controlplane", "--listen", listen, "--http-port", "0", "--health-interval", "0.5", *extra,
                "--worker", f"{self.procs['agg-1'].url},id=agg-1", "--worker", f"{self.procs['agg-2'].url},id=agg-2",
                "--prefill", f"{self.procs['prefill'].url},id=prefill-0",
                "--decode", f"{self.procs['decode'].url},id=decode-0"]

    # ---- redis -----------------------------------------------------------------------
    def start_redis(self, port: int = 0) -> Child:
        """A redis-server of the soak's own on loopback TCP, persisting (AOF) in its directory."""
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("--redis needs redis-server on PATH")
        if self.redis_dir is None:
            self.redis_dir = self.group.workdir / "redis"
            self.redis_dir.mkdir()
        if not port:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        cmd = [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.redis_dir), "--save", "",
               "--appendonly", "yes", "--appendfsync", "everysec", "--protected-mode", "no", "--daemonize", "no"]

        def ready() -> int | None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    return port if conn.recv(64).startswith(b"+PONG") else None
            except OSError:
                return None
        child = self.group.start_program("redis", cmd, ready, timeout=30)
        self.procs["redis"] = child
        return child

    async def restart_redis(self, down_s: float, *, empty: bool) -> None:
        child = self.procs["redis"]
        self.group.kill(child)
        if empty and self.redis_dir is not None:   # as a pod without a volume: nothing of the old data
            for entry in self.redis_dir.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        await asyncio.sleep(down_s)
        for attempt in range(20):
            try:
                await asyncio.to_thread(self.start_redis, child.port)
                break
            except LaunchError:
                if attempt == 19:
                    raise
                await asyncio.sleep(0.5)
        self.restarts["redis"] += 1

    async def stall_redis(self, stall_s: float) -> None:
        pid = self.procs["redis"].proc.pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(stall_s)
        finally:
            os.killpg(pid, signal.SIGCONT)

    # ---- ledgers ---------------------------------------------------------------------
    async def ledger(self, name: str) -> dict[str, int] | None:
        """In-flight requests per worker in one replica's ledger (None: it did not answer)."""
        try:
            import grpc

            async with grpc.aio.insecure_channel(self.procs[name].address) as ch:
                resp = await pb_grpc.AdminStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
        except Exception:  # noqa: BLE001 - reported as unknown
            return None
        return {w.id: w.load.inflight_requests for w in resp.workers}

    async def settled_ledgers(self) -> dict[str, dict[str, int] | None]:
        """Every replica's ledger, read until all are 0 or ``--settle`` seconds passed."""
        deadline = time.monotonic() + self.args.settle
        while True:
            ledgers = {name: await self.ledger(name) for name in self.cps}
            if all(v is not None and not any(v.values()) for v in ledgers.values()) or time.monotonic() > deadline:
                return ledgers
            await asyncio.sleep(0.5)

    async def sample_rss(self) -> None:
        while True:
            for name, kib in self.rss().items():
                if kib and kib > self.rss_peak[name]:
                    self.rss_peak[name] = kib
            await asyncio.sleep(1.0)

    async def restart(self, name: str, down_s: float) -> None:
        self.group.kill(self.procs[name])
        await asyncio.sleep(down_s)
        for attempt in range(20):   # the port may take a moment to be free again
            try:
                self.procs[name] = await asyncio.to_thread(self.group.start, name, self.specs[name])
                break
            except LaunchError:
                if attempt == 19:
                    raise
                await asyncio.sleep(0.5)
        self.restarts[name] += 1

    def rss(self) -> dict[str, int | None]:
        # redis-server runs under the launcher's guardian: its own figure is the guardian's child's
        return {name: rss_kib(_child_pid(child.proc.pid) if name == "redis" else child.proc.pid)
                for name, child in self.procs.items()}

    # ---- faults ----------------------------------------------------------------------
    async def sim_faults(self, session: aiohttp.ClientSession, engine: str, spec: dict) -> None:
        try:
            async with session.post(self.procs[engine].url + "/sim/faults", json=spec,
                                    timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
        except (TimeoutError, aiohttp.ClientError):
            pass   # the engine may be down right now: the fault is then moot

    async def fault_loop(self, session: aiohttp.ClientSession, stop_at: float) -> None:
        engines = ["agg-1", "agg-2", "prefill", "decode"]
        while True:
            wait = self.rng.uniform(0.5, 1.5) * self.args.fault_every
            if time.monotonic() + wait > stop_at - 2:
                return
            await asyncio.sleep(wait)
            redis_left = [k for k in REDIS_FAULTS if self.args.redis and
                          sum(f["kind"] == k for f in self.faults) < self.args.redis_faults_max]
            kind = self.rng.choice(FAULTS + tuple(redis_left))
            missing = [k for k in redis_left if not any(f["kind"] == k for f in self.faults)]
            if missing and stop_at - time.monotonic() < (len(missing) + 1) * 1.5 * self.args.fault_every:
                kind = self.rng.choice(missing)   # every Redis fault at least once in a run
            engine = self.rng.choice(engines)
            at = round(time.monotonic() - self.t0, 1)
            if kind == "engine_kill":
                down = round(self.rng.uniform(0.5, 3.0), 1)
                await self.restart(engine, down)
                self.faults.append({"t": at, "kind": kind, "target": engine, "down_s": down})
            elif kind == "5xx_burst":
                status = self.rng.choice((500, 502, 503, 429))
                count = self.rng.randint(3, 20)
                spec: dict[str, int | str] = {"status": status, "count": count}
                if status in (503, 429) and self.rng.random() < 0.5:
                    spec["retry_after"] = "1"
                await self.sim_faults(session, engine, spec)
                self.faults.append({"t": at, "kind": kind, "target": engine, **spec})
            elif kind == "stall":
                count = self.rng.randint(1, 5)
                delay = round(self.args.read_timeout * self.rng.uniform(0.5, 2.0), 1)
                await self.sim_faults(session, engine, {"delay_s": delay, "count": count})
                self.faults.append({"t": at, "kind": kind, "target": engine, "delay_s": delay, "count": count})
            elif kind in ("redis_kill", "redis_empty"):
                down = round(self.rng.uniform(0.5, 3.0), 1)
                await self.restart_redis(down, empty=kind == "redis_empty")
                self.faults.append({"t": at, "kind": kind, "target": "redis", "down_s": down})
            elif kind == "redis_stall":
                stall = round(self.rng.uniform(1.0, self.args.redis_stall_max), 1)
                self.faults.append({"t": at, "kind": kind, "target": "redis", "stall_s": stall})
                await self.stall_redis(stall)
            else:
                down = round(self.rng.uniform(0.5, 3.0), 1)
                target = self.rng.choice(self.cps)
                await self.restart(target, down)
                self.faults.append({"t": at, "kind": kind, "target": target, "down_s": down})

    # ---- traffic ---------------------------------------------------------------------
    async def traffic(self, session: aiohttp.ClientSession, tally: Tally, stop_at: float) -> None:
        tasks: set[asyncio.Task] = set()
        interval = 1.0 / self.args.rate
        next_at = time.monotonic()
        i = 0
        max_requests = int(self.args.rate * self.args.minutes * 60) + 1
        while i < max_requests:
            now = time.monotonic()
            if now >= stop_at:
                break
            if next_at > now:
                await asyncio.sleep(next_at - now)
            next_at += interval
            path, body, kind = make_body(self.rng, i)
            dp = self.procs[f"dataplane-{1 + i % 2}"]
            tally.sent += 1
            tally.by_kind[kind] += 1
            task = asyncio.create_task(bounded_request(session, dp.url, path, body, tally, self.args.deadline))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if tasks:   # every one ends within its deadline
            await asyncio.gather(*tasks)

    async def run_async(self) -> dict:
        tally = Tally()
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn) as session:
            # warm-up: one request of each kind through each data plane, then the start RSS
            warm = Tally()
            for i in range(8):
                path, body, _ = make_body(random.Random(i), i)
                await bounded_request(session, self.procs[f"dataplane-{1 + i % 2}"].url, path, body, warm, 30)
            self.rss_start = self.rss()
            sampler = asyncio.create_task(self.sample_rss())
            self.t0 = time.monotonic()
            stop_at = self.t0 + self.args.minutes * 60
            fault_task = asyncio.create_task(self.fault_loop(session, stop_at))
            await self.traffic(session, tally, stop_at)
            await fault_task
            wall = time.monotonic() - self.t0
            # let the ledgers settle (every replica's back to 0), then read the end RSS
            started = time.monotonic()
            ledgers = await self.settled_ledgers()
            settle_s = time.monotonic() - started
            await asyncio.sleep(1.0)
            rss_end = self.rss()
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        lat = sorted(tally.latencies)
        procs = {}
        for name in self.procs:
            start, end = self.rss_start.get(name), rss_end.get(name)
            peak = self.rss_peak.get(name)
            procs[name] = {"rss_start_mib": round(start / 1024, 1) if start else None,
                           "rss_peak_mib": round(peak / 1024, 1) if peak else None,
                           "rss_end_mib": round(end / 1024, 1) if end else None,
                           "restarts": self.restarts[name]}
        leaked = sum(sum(v.values()) for v in ledgers.values() if v)
        return {
            "minutes": self.args.minutes, "wall_s": round(wall, 1), "rate_per_s": self.args.rate,
            "fault_every_s": self.args.fault_every,
            "deadline_s": self.args.deadline, "read_timeout_s": self.args.read_timeout, "seed": self.args.seed,
            "sent": tally.sent, "succeeded": tally.succeeded, "clean_error": tally.clean_error,
            "lost": tally.lost, "hung": tally.hung,
            "redis": self.args.redis, "ledgers_end": ledgers, "leaked_load": leaked,
            "ledgers_settled_s": round(settle_s, 1),
            "by_kind": dict(sorted(tally.by_kind.items())),
            "clean_errors_by_status": dict(tally.errors.most_common(30)),
            "lost_or_hung_samples": tally.lost_samples,
            "latency_s": {"p50": round(lat[len(lat) // 2], 3) if lat else None,
                          "p99": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
                          "max": round(lat[-1], 3) if lat else None},
            "faults": self.faults,
            "faults_by_kind": dict(Counter(f["kind"] for f in self.faults)),
            "processes": procs,
            "host": {"python": platform.python_version(), "machine": platform.machine(),
                     "cpus": __import__("os").cpu_count()},
        }

    def run(self) -> dict:
        with self.group:
            self.start_all()
            return asyncio.run(self.run_async())


def markdown(r: dict) -> str:
    redis = r.get("redis")
    flags = (f" --fault-every {r['fault_every_s']:g}" if r.get("fault_every_s", 15.0) != 15.0 else "") + \
        (" --redis" if redis else "")
    lines = [
        "# Soak" + (" with Redis faults" if redis else ""),
        "",
        f"`python -m bench.soak --minutes {r['minutes']:g} --rate {r['rate_per_s']:g}{flags}` (seed {r['seed']}): "
        f"{r['wall_s']:.0f} s of steady mixed traffic (completions and chat, streamed and not, prompts of 8 to "
        "2048 words) through two data planes, in front of two aggregated engine simulators and a "
        "prefill/decode pair, with faults injected at random"
        + (", behind two control-plane replicas sharing one Redis (`[state] backend = \"redis\"`)" if redis else "")
        + f". Loopback only; {r['host']['cpus']} CPUs shared with other work.",
        "",
        "| requests | count |",
        "|---|---:|",
        f"| sent | {r['sent']} |",
        f"| succeeded | {r['succeeded']} |",
        f"| failed with a clean error (status + OpenAI JSON, or a stream's error event) | {r['clean_error']} |",
        f"| lost | {r['lost']} |",
        f"| hung (no answer within {r['deadline_s']:g} s) | {r['hung']} |",
        "",
    ]
    if "leaked_load" in r:
        ends = "; ".join(f"{name}: {sum(v.values()) if v is not None else 'no answer'}"
                         for name, v in r["ledgers_end"].items())
        lines += [f"Load left in the ledgers once the traffic was over (in-flight requests, every worker, "
                  f"read {r['ledgers_settled_s']:g} s after the last answer): **{r['leaked_load']}** ({ends}).", ""]
    lines += [
        f"Latency of the successful requests: p50 {r['latency_s']['p50']} s, p99 {r['latency_s']['p99']} s, "
        f"max {r['latency_s']['max']} s.",
        "",
        "Faults injected: " + ", ".join(f"{k} x{v}" for k, v in sorted(r["faults_by_kind"].items())) + ".",
        "",
        "| process | RSS after warm-up (MiB) | peak (MiB) | RSS at end (MiB) | restarted |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in r["processes"].items():
        lines.append(f"| {name} | {p['rss_start_mib']} | {p.get('rss_peak_mib')} | {p['rss_end_mib']} "
                     f"| {p['restarts']} |")
    lines += ["", "A restarted process's end figure is its new instance's: compare the data planes, which "
              "no fault restarts.", "",
              "Clean errors by status and message. The PD pair has one prefill and one decode engine, so a "
              "fault on either has no other worker to retry on and reaches the client as its status (429/503 "
              "with the engine's message, other 5xx as 502, a stall past `--read-timeout` as 504); faults on "
              "the aggregated engines are mostly retried on the other one.", ""]
    for k, v in r["clean_errors_by_status"].items():
        lines.append(f"- {v} x `{k}`")
    if r["lost_or_hung_samples"]:
        lines += ["", "Lost or hung:", ""] + [f"- `{s}`" for s in r["lost_or_hung_samples"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long to send (default 10)")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (default 8)")
    p.add_argument("--fault-every", type=float, default=15.0, help="mean seconds between faults (default 15)")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds after which a request counts as hung")
    p.add_argument("--read-timeout", type=float, default=4.0, help="the data planes' --read-timeout (stalls "
                   "are 0.5x to 2x this)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--redis", action="store_true", help="two control-plane replicas on a Redis of their own, "
                   "and Redis faults (kill, empty restart, stall)")
    p.add_argument("--redis-faults-max", type=int, default=3, help="each Redis fault at most this often (default 3)")
    p.add_argument("--redis-stall-max", type=float, default=6.0, help="longest Redis stall, seconds (default 6)")
    p.add_argument("--settle", type=float, default=30.0, help="seconds to wait for every ledger to return to 0")
    p.add_argument("--access-log", action="store_true", help="keep the data planes' access log on")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "soak"),
                   help="write OUT.json and OUT.md (default docs/benchmarks/soak)")
    p.add_argument("--markdown-from", default="", metavar="JSON", help="only rewrite the .md beside a saved .json")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 60 or not 0 < args.rate <= 200:
        p.error("--minutes must be in (0, 60] and --rate in (0, 200]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.markdown_from:   # re-render OUT.md from a saved OUT.json, without running
        src = Path(args.markdown_from)
        src.with_suffix(".md").write_text(markdown(json.loads(src.read_text())))
        return 0
    report = Soak(args).run()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps({k: report[k] for k in ("sent", "succeeded", "clean_error", "lost", "hung", "leaked_load")}))
    return 0 if report["lost"] == 0 and report["hung"] == 0 and report["leaked_load"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
