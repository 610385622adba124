"""SLO replay: placement decision quality of our policies against the public routers.

    python bench/slo_replay.py --start 3000 --requests 200 --rates 0.5,1,1.5,2 --repeats 2

Replays a window of the Mooncake trace (rows -> token-id prompts that share prefixes via
``hash_ids``, see bench/tracedata.py) open-loop at the trace's arrival times times a rate
multiplier, as streaming completions, against FRESH simulated engines (prefix caching, KV
events) per run, in two modes:

* ``agg``: ``--agg-engines`` engines of role both;
* ``pd``:  ``--prefill-engines`` prefill + ``--decode-engines`` decode engines (vLLM
  sequential/NIXL protocol for us and vllm-router; smg speaks SGLang's bootstrap protocol,
  which the simulators also serve).

Targets: ours (control plane following the engines' KV events + one data plane) with each
policy of ``--policies`` (any name the control plane accepts), and the peers vllm-router
0.1.17 and smg 1.13 with cache_aware and round_robin (installed into their own cached venv,
see bench/peers.py; smg takes only string prompts, so it is sent the same prompts as text that
the simulators tokenize back to as many tokens with the same shared prefixes: ``as_text``).
For every run the engines' request logs (GET /sim/requests) record which engine served each
request; that assignment is then replayed with the same timing directly against fresh
engines (no router in the path), which measures the decisions apart from the proxy's path
cost.

Scaling (the simulator's timing is a cost model, so scaling it is legitimate): the engines
model one GPU serving a ~8B model (prefill ``--prefill-tok-s`` real tokens/s, decode step
``--decode-step-ms`` + ``--decode-seq-ms`` per running sequence, 8192-token prefill chunks,
a ~450k-token KV pool, 128k context). Token counts are divided by ``--token-scale`` (one
trace block of 512 tokens becomes 512/K token ids; prefill cost per simulated token is K
times the real one, so model-time prefill cost is unchanged) and model time runs
``--time-scale`` times slower than wall time. All reported latencies are model time:
wall / time-scale. SLO per request: TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any
import concurrent.futures
import contextlib
import json
import math
import re
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import peers as peerlib  # noqa: E402
from bench import prom  # noqa: E402
from bench.tracedata import TraceMissing, load_rows, prompt_for, resolve_trace, sim_state  # noqa: E402
from bench.workloads import generate as generate_workload  # noqa: E402
from omni_proxy.launcher import LaunchError, ProcessGroup  # noqa: E402

DEFAULT_POLICIES = "round_robin,least_load,cache_aware,apc_first"
LABEL = re.compile(r"slo(\d+)x")
SIM_BLOCK = 16


# ---- configuration -------------------------------------------------------------------

@dataclass
class Cost:
    """The modelled GPU (real tokens, model milliseconds) and the two scale factors."""

    token_scale: int
    time_scale: float
    prefill_tok_s: float
    decode_step_ms: float
    decode_seq_ms: float
    kv_transfer_tok_s: float
    max_batched_tokens: int
    max_num_seqs: int
    kv_pool_tokens: int
    max_model_len: int

    def sim_args(self, speed: float = 1.0) -> list[str]:
        """The simulator's flags; ``speed`` < 1 makes a slower engine (0.5: every step twice as long)."""
        k, t = self.token_scale, self.time_scale / speed
        blocks = max(self.kv_pool_tokens // k // SIM_BLOCK, self.max_model_len // k // SIM_BLOCK + 1)
        return ["--prefill-ms-per-token", f"{1000.0 / self.prefill_tok_s * k * t:.6f}",
                "--decode-ms-per-step", f"{self.decode_step_ms * t:.4f}",
                "--decode-ms-per-seq", f"{self.decode_seq_ms * t:.4f}",
                "--kv-transfer-ms-per-token", f"{1000.0 / self.kv_transfer_tok_s * k * t:.6f}",
                "--max-num-batched-tokens", str(max(SIM_BLOCK, self.max_batched_tokens // k)),
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len // k),
                "--num-gpu-blocks", str(blocks), "--block-size", str(SIM_BLOCK),
                "--kv-lease-s", "60", "--bootstrap-timeout-s", "60",
                # token-id prompts are not tokenized; text ones (as_text) must not cost more
                "--tokenize-us-per-char", "0"]

    def describe(self) -> dict:
        return {**self.__dict__, "sim_args": self.sim_args(),
                "sim_block_real_tokens": SIM_BLOCK * self.token_scale}


@dataclass
class Target:
    kind: str      # ours | vllm-router | smg
    policy: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.policy}"


# ---- engines and routers -------------------------------------------------------------

@dataclass
class Engine:
    name: str
    role: str
    url: str
    kv_events: str
    kv_replay: str
    bootstrap_port: int
    max_num_seqs: int = 0      # told to our control plane, as an operator would (0: not told)


def engine_roles(mode: str, args) -> list[str]:
    if mode == "agg":
        return ["both"] * args.agg_engines
    return ["prefill"] * args.prefill_engines + ["decode"] * args.decode_engines


def engine_speeds(args, count: int) -> list[float]:
    """``--engine-speeds`` for ``count`` engines (in start order); missing ones run at 1x."""
    speeds = [float(x) for x in (args.engine_speeds or "").split(",") if x.strip()]
    if any(not 0.01 <= x <= 100 for x in speeds):
        raise ValueError(f"--engine-speeds: every factor must be 0.01-100, not {args.engine_speeds!r}")
    return (speeds + [1.0] * count)[:count]


def start_engines(group: ProcessGroup, mode: str, args, cost: Cost) -> list[Engine]:
    roles = engine_roles(mode, args)
    speeds = engine_speeds(args, len(roles))

    def one(i: int, role: str) -> Engine:
        ev = f"ipc://{group.workdir}/kv-{i}.sock"
        rp = f"ipc://{group.workdir}/kvr-{i}.sock"
        child = group.start(f"sim-{i}", [
            "sim", "--host", "127.0.0.1", "--port", "0", "--role", role, "--engine-id", f"sim-{i}",
            *cost.sim_args(speeds[i]), "--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rp],
            env={"PYTHONHASHSEED": "0"})
        return Engine(f"sim-{i}", role, child.url, ev, rp, int(child.info.get("bootstrap_port") or child.port),
                      cost.max_num_seqs)

    with concurrent.futures.ThreadPoolExecutor(len(roles)) as pool:
        return list(pool.map(one, range(len(roles)), roles))


def start_ours(group: ProcessGroup, policy: str, mode: str, engines: list[Engine], extra_config: str = "",
               dp_args: tuple[str, ...] = (), cp_args: tuple[str, ...] = ()) -> str:
    """Our control plane and one data plane; ``extra_config``: TOML appended to the control
    plane's config (``--profiles``: custom policies, chosen by name in ``--policies``);
    ``dp_args``, ``cp_args``: more data-plane / control-plane flags (a later flag wins over the
    defaults here; ``slo_config``'s deployment targets)."""
    specs: list[str] = []
    for e in engines:
        spec = f"{e.url},role={e.role},id={e.name},kv_events={e.kv_events},kv_replay={e.kv_replay}"
        if e.max_num_seqs:
            spec += f",max_num_seqs={e.max_num_seqs}"
        if e.role == "prefill":
            spec += f",bootstrap_port={e.bootstrap_port}"
        specs += ["--worker", spec]
    cfg = group.workdir / "cp.toml"
    cfg.write_text(f'[kv_cache]\nblock_size = {SIM_BLOCK}\nhash_algo = "sha256"\nhash_seed = "0"\n'
                   + extra_config)
    cp = group.start("controlplane", ["controlplane", "--config", str(cfg), "--listen", "127.0.0.1:0",
                                      "--http-host", "127.0.0.1", "--http-port", "0", "--policy", policy,
                                      *(["--pd-flow", "sequential"] if mode == "pd" else []),
                                      "--log-level", "WARNING", *cp_args, *specs])
    dp = group.start("dataplane", ["dataplane", "--host", "127.0.0.1", "--port", "0",
                                   "--controlplane", cp.address, "--log-level", "WARNING",
                                   "--read-timeout", "600", *dp_args])
    return dp.url


def start_router(group: ProcessGroup, target: Target, mode: str, engines: list[Engine],
                 extra_config: str = "", cp_args: tuple[str, ...] = ()) -> str:
    if target.kind == "ours":
        return start_ours(group, target.policy, mode, engines, extra_config, cp_args=cp_args)
    from bench.tracedata import free_port
    eng = peerlib.Engines(both=[e.url for e in engines if e.role == "both"],
                          prefill=[e.url for e in engines if e.role == "prefill"],
                          decode=[e.url for e in engines if e.role == "decode"],
                          bootstrap_ports={e.url: e.bootstrap_port for e in engines})
    child = peerlib.start_peer(group, target.kind, target.policy, mode, eng, free_port(), free_port())
    return child.url


# ---- the client ----------------------------------------------------------------------

@dataclass
class Outcome:
    idx: int
    ok: bool = False
    ttft: float | None = None      # wall seconds
    tpot: float | None = None
    e2e: float | None = None
    tokens: int = 0
    error: str = ""


def completion_tokens(choices: list) -> int:
    """Tokens in one /v1/completions stream event: a choice with text is one."""
    return sum(1 for c in choices if c.get("text"))


def chat_tokens(choices: list) -> int:
    """Tokens in one /v1/chat/completions stream event: one if any choice's delta has content."""
    return 1 if any((c.get("delta") or {}).get("content") for c in choices) else 0


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, t0: float,
                  out: Outcome, count: Callable[[list], int] = completion_tokens) -> None:
    """One streamed request: TTFT, TPOT and tokens into ``out`` (``count``: an event's tokens)."""
    first: float | None = None
    last = 0.0   # read only once first is set
    done = False
    async with session.post(url, data=orjson.dumps(body), headers={**JSON, **headers}) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            return
        buf = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                event = event.strip()
                if event == b"data: [DONE]":
                    done = True
                elif event.startswith(b"data: {"):
                    n = count(orjson.loads(event[6:]).get("choices") or [])
                    if n:
                        out.tokens += n
                        first = first or now
                        last = now
    out.e2e = time.perf_counter() - t0
    if first is not None:
        out.ttft = first - t0
        if out.tokens > 1:
            out.tpot = (last - first) / (out.tokens - 1)
    if not done:
        out.error = "stream did not end with [DONE]"
    elif not out.tokens:
        out.error = "no tokens"
    out.ok = not out.error


JSON = {"Content-Type": "application/json"}


def slo_headers(args) -> dict[str, str]:
    """The SLO the run measures, as per-request headers (``X-SLO-TTFT-Ms``, ``X-SLO-TPOT-Ms``) in
    wall time, the clock every router sees: model time times ``--time-scale``. Every router gets
    them; the peers ignore them, ours places by them (the scorer's targets and the near-best
    picker's band). Off by default: without them (or ``slo_config``) our 2 s default targets
    are 2 s of wall time, twice the measured SLO at the default time scale. ``slo_config`` tells
    our control plane the same targets once, for every request (the suite's default). With
    them longdoc 16x went 45.8 -> 53 %
    and no suite cell measured loses beyond noise; while the ``slo`` filter was in the default
    profile the heterogeneous fleet at 3x/4x and PD 2:2 at 3x lost 6-7 points
    (docs/benchmarks/workloads_notes.md)."""
    if not args.slo_headers:
        return {}
    return {"X-SLO-TTFT-Ms": f"{args.slo_ttft_ms * args.time_scale:g}",
            "X-SLO-TPOT-Ms": f"{args.slo_tpot_ms * args.time_scale:g}"}


def slo_config(args) -> tuple[str, ...]:
    """The SLO the run measures as our control plane's deployment targets (``[slo] ttft_ms`` /
    ``tpot_ms``, as flags), in wall time like ``slo_headers``: an operator configures the SLO
    the deployment is judged on. Every request without headers is then placed exactly as with
    them (the same context fields); the peers have no such setting. Off unless
    ``--slo-config`` (bench/workload_suite.py turns it on for our targets by default)."""
    if not args.slo_config:
        return ()
    return ("--slo-ttft-ms", f"{args.slo_ttft_ms * args.time_scale:g}",
            "--slo-tpot-ms", f"{args.slo_tpot_ms * args.time_scale:g}")


def slo_setup(cfg: dict) -> str:
    """The report's sentence on how ours was told the SLO (``slo_config``, ``slo_headers``)."""
    scale = cfg["cost"]["time_scale"]
    wall = f"{cfg['slo_ttft_ms'] * scale:g} ms / {cfg['slo_tpot_ms'] * scale:g} ms of wall time"
    if cfg.get("slo_config"):
        said = (f"Our control plane ran with the measured SLO as its deployment targets (`[slo] ttft_ms` / "
                f"`tpot_ms` = {wall}: SLO x time scale, `--slo-config`), as an operator configures the SLO "
                "the deployment is judged on; the peers have no such setting.")
    else:
        said = (f"Our control plane ran without deployment targets (`[slo]` unset): it judged candidates "
                f"against its default 2 s / 100 ms of wall time, while the SLO is {wall}.")
    if cfg.get("slo_headers"):
        said += f" Every request carried the SLO as `X-SLO-TTFT-Ms` / `X-SLO-TPOT-Ms` ({wall})."
    return said


async def send_router(session, url: str, body: dict, idx: int, headers: dict[str, str] | None = None) -> Outcome:
    out = Outcome(idx)
    try:
        await _stream(session, url + "/v1/completions", body, {"X-Request-Id": f"slo{idx}x", **(headers or {})},
                      time.perf_counter(), out)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def send_direct(session, engines: list[Engine], assign: dict, body: dict, idx: int) -> Outcome:
    """Aggregated: the engine directly. PD: vLLM's sequential flow by hand (P with
    max_tokens=1 and do_remote_decode, then D with P's kv_transfer_params)."""
    out = Outcome(idx)
    t0 = time.perf_counter()
    headers = {"X-Request-Id": f"slo{idx}x"}
    try:
        if "both" in assign:
            await _stream(session, engines[assign["both"]].url + "/v1/completions", body, headers, t0, out)
            return out
        pbody = {**body, "max_tokens": 1, "min_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                        "remote_engine_id": None, "remote_block_ids": None,
                                        "remote_host": None, "remote_port": None}}
        async with session.post(engines[assign["prefill"]].url + "/v1/completions", data=orjson.dumps(pbody),
                                headers={**JSON, **headers}) as r:
            data = await r.read()
            if r.status != 200:
                out.error = f"prefill HTTP {r.status}"
                return out
        kv = orjson.loads(data).get("kv_transfer_params")
        await _stream(session, engines[assign["decode"]].url + "/v1/completions",
                      {**body, "kv_transfer_params": kv}, headers, t0, out)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


# ---- engine-side observation ---------------------------------------------------------

class EngineWatcher:
    """Polls every engine's request log and state: who served which request (by the
    ``slo<N>x`` label in the request id or body), and queue depth over time."""

    def __init__(self, session: aiohttp.ClientSession, engines: list[Engine], interval: float) -> None:
        self.session, self.engines, self.interval = session, engines, interval
        self.seen: dict[tuple, tuple[float, int, str]] = {}   # (engine, rid, t) -> (t, label, role)
        self.waiting: list[list[int]] = [[] for _ in engines]
        self.running: list[list[int]] = [[] for _ in engines]

    async def poll(self, with_state: bool = True) -> None:
        for i, e in enumerate(self.engines):
            async with self.session.get(e.url + "/sim/requests") as r:
                entries = orjson.loads(await r.read())["requests"]
            for ent in entries:
                key = (i, ent["request_id"], ent["received_at"])
                if key in self.seen:
                    continue
                body = ent.get("body") if isinstance(ent.get("body"), dict) else {}
                label = None
                for text in (ent["request_id"], body.get("request_id"), body.get("user")):
                    m = LABEL.search(str(text or ""))
                    if m:
                        label = int(m.group(1))
                        break
                if label is not None:
                    self.seen[key] = (ent["received_at"], label, e.role)
            if with_state:
                st = await sim_state(self.session, e.url)
                self.waiting[i].append(st.get("waiting", 0))
                self.running[i].append(st.get("running", 0))

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)   # periodic sampling (not a wait for a condition)
            try:
                await self.poll()
            except (TimeoutError, aiohttp.ClientError):
                pass

    def assignment(self) -> dict[int, dict[str, int]]:
        """label -> {role: engine index}; the last leg received wins (a retry)."""
        out: dict[int, dict[str, int]] = {}
        for (i, _rid, _sent), (_t, label, role) in sorted(self.seen.items(), key=lambda kv: kv[1][0]):
            out.setdefault(label, {})[role] = i
        return out


# ---- one run -------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


async def open_loop(offsets: list[float], send, limit_s: float) -> tuple[list[Outcome], float]:
    """``await send(i)`` for every i, each at ``offsets[i]`` seconds after the start (open
    loop: arrivals never wait for earlier answers), all within ``limit_s``. Returns the
    outcomes (one per i; unfinished ones: "run time limit") and the wall time."""
    outcomes: list[Outcome] = []
    start = time.perf_counter()

    async def one(i: int) -> None:
        delay = offsets[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)   # open-loop arrival at trace time
        outcomes.append(await send(i))

    tasks = [asyncio.create_task(one(i)) for i in range(len(offsets))]
    _done, pending = await asyncio.wait(tasks, timeout=limit_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    finished = {o.idx for o in outcomes}
    outcomes += [Outcome(i, error="run time limit") for i in range(len(offsets)) if i not in finished]
    return outcomes, wall


async def drive(engines: list[Engine], rows: list[dict], bodies: list[dict], offsets: list[float], args,
                router_url: str | None, assignment: dict | None) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.max_run_seconds, sock_connect=10)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        base = []
        for e in engines:
            async with session.delete(e.url + "/sim/requests"):
                pass
            base.append(await sim_state(session, e.url))
        watcher = EngineWatcher(session, engines, args.poll_s)
        poller = asyncio.create_task(watcher.loop())
        slow = asyncio.create_task(slow_down(session, engines, offsets, args.slowdown)) if args.slowdown else None
        slo = slo_headers(args)

        async def send(i: int) -> Outcome:
            if router_url is not None:
                return await send_router(session, router_url, bodies[i], i, slo)
            if assignment is not None and i in assignment:
                return await send_direct(session, engines, assignment[i], bodies[i], i)
            return Outcome(i, error="no assignment recorded")

        outcomes, wall = await open_loop(offsets, send, args.max_run_seconds)
        poller.cancel()
        if slow is not None:
            slow.cancel()
        await asyncio.gather(poller, *([slow] if slow else []), return_exceptions=True)
        await watcher.poll(with_state=False)
        after = [await sim_state(session, e.url) for e in engines]
    out = summarize(engines, outcomes, base, after, watcher, wall, args)
    if router_url is not None:
        out["stages"] = await asyncio.to_thread(stage_means, router_url, args.time_scale)
    return out


def stage_means(url: str, time_scale: float) -> dict | None:
    """Our data plane's stage times over the run (fresh processes: the totals are the run's),
    mean model ms: the wait in the control plane's queue, and the prefill leg (sequential PD:
    P sent to P's answer). None for a peer router (no such metrics)."""
    text = prom.scrape(url)
    if not text:
        return None
    out = {}
    for key, name in (("queue", "omni_dp_queue_seconds"), ("prefill", "omni_dp_prefill_seconds"),
                      ("decode", "omni_dp_decode_seconds")):
        h = prom.histogram(text, name)
        if h and h["count"]:
            out[f"{key}_mean_ms"] = round(h["sum"] / h["count"] / time_scale * 1000, 1)
    return out or None


def parse_slowdown(spec: str) -> tuple[int, float, float]:
    """``ENGINE:AT:FACTOR``: engine index ENGINE (start order) runs FACTOR times slower from
    the fraction AT of the arrival window on."""
    try:
        idx, at, factor = spec.split(":")
        out = int(idx), float(at), float(factor)
    except ValueError:
        raise ValueError(f"--slowdown wants ENGINE:AT:FACTOR (e.g. 0:0.5:2), not {spec!r}") from None
    if not 0 <= out[1] <= 1 or not 0.01 <= out[2] <= 100:
        raise ValueError(f"--slowdown {spec!r}: AT is a fraction of the window (0-1), FACTOR 0.01-100")
    return out


async def slow_down(session: aiohttp.ClientSession, engines: list[Engine], offsets: list[float], spec: str) -> None:
    """Arm the simulator's ``slowdown`` fault on one engine part way through the arrivals."""
    idx, at, factor = parse_slowdown(spec)
    await asyncio.sleep(max(0.0, (offsets[-1] - offsets[0]) * at))
    async with session.post(engines[idx].url + "/sim/faults", json={"slowdown": factor}) as r:
        r.raise_for_status()


def fair_share(per_engine: list[dict], speeds: list[float], key: str = "requests") -> float | None:
    """The smallest share any engine got of its fair share among its equals (same role and
    speed, at least two of them): 1.0 is an even split, 0.0 an engine that got nothing.

    ``key`` is what is shared: ``requests``, or ``tokens`` (the prompt tokens a prefill or
    aggregated engine was asked for, the output tokens a decode engine produced). Request
    counts understate a fair split when requests differ in size (chat beside summaries of
    long documents): an engine given few long requests is not starved."""
    groups: dict[tuple[str, float], list[int]] = {}
    for pe, speed in zip(per_engine, speeds, strict=False):
        groups.setdefault((pe["role"], speed), []).append(pe[key])
    shares = [min(v) / (sum(v) / len(v)) for v in groups.values() if len(v) > 1 and sum(v) != 0]
    return round(min(shares), 3) if shares else None


def summarize(engines, outcomes, base, after, watcher, wall, args) -> dict:
    T = args.time_scale
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft / T * 1000 for o in ok]
    tpot = [o.tpot / T * 1000 for o in ok if o.tpot is not None]
    e2e = [o.e2e / T * 1000 for o in ok]

    def meets(o: Outcome) -> bool:
        return (o.ok and o.ttft / T * 1000 <= args.slo_ttft_ms
                and (o.tpot is None or o.tpot / T * 1000 <= args.slo_tpot_ms))

    hits = queries = 0
    per_engine = []
    assignment = watcher.assignment()
    produced = [0] * len(engines)
    for o in ok:
        legs = assignment.get(o.idx, {})
        engine = legs.get("decode", legs.get("both"))
        if engine is not None:
            produced[engine] += o.tokens
    for i, e in enumerate(engines):
        h = after[i].get("prefix_cache_hits_tokens", 0) - base[i].get("prefix_cache_hits_tokens", 0)
        q = after[i].get("prefix_cache_queries_tokens", 0) - base[i].get("prefix_cache_queries_tokens", 0)
        if e.role in ("both", "prefill"):
            hits, queries = hits + h, queries + q
        per_engine.append({
            "engine": e.name, "role": e.role,
            "requests": sum(1 for a in assignment.values() if a.get(e.role) == i),
            "hit_rate": round(h / q, 4) if q else None, "query_tokens": q,
            "tokens": produced[i] if e.role == "decode" else q,
            "waiting_mean": round(statistics.mean(watcher.waiting[i]), 2) if watcher.waiting[i] else None,
            "waiting_max": max(watcher.waiting[i]) if watcher.waiting[i] else None,
            "running_mean": round(statistics.mean(watcher.running[i]), 2) if watcher.running[i] else None})
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            key = o.error[:80]
            errors[key] = errors.get(key, 0) + 1

    def r(x, n=1):
        return None if x is None else round(x, n)

    return {
        "requests": len(outcomes), "ok": len(ok),
        "slo_attainment": round(sum(1 for o in outcomes if meets(o)) / max(len(outcomes), 1), 4),
        "ttft_p50_ms": r(_pct(ttft, .5)), "ttft_p90_ms": r(_pct(ttft, .9)), "ttft_p99_ms": r(_pct(ttft, .99)),
        "tpot_p50_ms": r(_pct(tpot, .5)), "tpot_p90_ms": r(_pct(tpot, .9)),
        "e2e_p50_ms": r(_pct(e2e, .5)), "e2e_p90_ms": r(_pct(e2e, .9)),
        "output_tok_s": r(sum(o.tokens for o in ok) / (wall / T), 1),
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "wall_s": round(wall, 1), "per_engine": per_engine, "errors": errors,
        "min_fair_share": fair_share(per_engine, engine_speeds(args, len(engines))),
        "min_token_share": fair_share(per_engine, engine_speeds(args, len(engines)), "tokens"),
        "ttft_ms_all": [r(x, 1) for x in sorted(ttft)],
        "assignment": {str(k): v for k, v in sorted(assignment.items())},
        # Per request (by index), for comparing targets request by request: only with --keep-logs.
        **({"ttft_ms_by_request": {str(o.idx): r(o.ttft / T * 1000, 1) for o in ok}} if args.keep_logs else {}),
    }


_RUN_SEQ = iter(range(1_000_000))


def _group(args, label: str) -> ProcessGroup:
    """A process group in a fresh temp dir, or under --keep-logs (kept for debugging)."""
    if not args.keep_logs:
        return ProcessGroup()
    d = args.keep_logs / f"{next(_RUN_SEQ):03d}-{label}"
    d.mkdir(parents=True, exist_ok=True)
    return ProcessGroup(str(d))


def predecessors(rows: list[dict]) -> dict[int, tuple[int, float, float]]:
    """For every row whose prompt shares a prefix with an earlier row of the window: (the
    latest such row with the deepest match, trace seconds since it arrived, match share)."""
    last: dict[tuple, int] = {}
    out = {}
    for i, row in enumerate(rows):
        h = row["hash_ids"]
        for k in range(len(h), 0, -1):
            j = last.get(tuple(h[:k]))
            if j is not None:
                out[i] = (j, (row["timestamp"] - rows[j]["timestamp"]) / 1000, k / len(h))
                break
        for k in range(1, len(h) + 1):
            last[tuple(h[:k])] = i
    return out


def followup_affinity(run: dict, preds: dict, scale: float, close_s: float) -> dict:
    """Share of follow-up requests (more than half of the prompt is an earlier request's) placed on the
    engine that served that earlier request, overall and when it arrived within
    ``close_s`` model seconds of it (its predecessor is then likely still queued or
    prefilling: its blocks are not in the engine's cache, nor in KV events, yet)."""
    assign = run.get("assignment") or {}

    def engine(i):
        a = assign.get(str(i)) or {}
        return a.get("both", a.get("prefill"))

    same = total = same_close = total_close = 0
    for i, (j, gap, share) in preds.items():
        if share <= 0.5:
            continue       # shares only a common head (a system prompt): not its conversation
        ei, ej = engine(i), engine(j)
        if ei is None or ej is None:
            continue
        total += 1
        same += ei == ej
        if gap / scale <= close_s:
            total_close += 1
            same_close += ei == ej
    return {"followups": total, "same_engine": round(same / total, 3) if total else None,
            f"followups_within_{close_s:g}s": total_close,
            f"same_engine_within_{close_s:g}s": round(same_close / total_close, 3) if total_close else None}


def as_text(body: dict) -> dict:
    """The same request with its token-id prompt written as text the simulator tokenizes back
    to one token per id (``t<id>`` pieces): as long, and sharing the same prefixes block for
    block, for a router that takes only strings (peers.TEXT_ONLY). The engines' tokenization
    cost is off in these runs (``Cost.sim_args``), so text costs the engines nothing more."""
    return {**body, "prompt": " ".join(f"t{i}" for i in body["prompt"])}


def run_once(target: Target, mode: str, rows, bodies, offsets, args, cost: Cost) -> tuple[dict, dict | None]:
    """The target's run through its router, then (when asked) its assignment replayed."""
    if target.kind in peerlib.TEXT_ONLY:
        bodies = [as_text(b) for b in bodies]
    with _group(args, f"{target.name.replace(':', '-')}-{mode}") as group:
        engines = start_engines(group, mode, args, cost)
        url = start_router(group, target, mode, engines, args.profiles.read_text() if args.profiles else "",
                           cp_args=slo_config(args))
        res = asyncio.run(drive(engines, rows, bodies, offsets, args, url, None))
    replay = None
    if args.replay and res["ok"] and (target.kind == "ours" or args.peer_replay):
        assignment = {int(k): v for k, v in res["assignment"].items()}
        with _group(args, f"replay-{target.name.replace(':', '-')}-{mode}") as group:
            engines = start_engines(group, mode, args, cost)
            replay = asyncio.run(drive(engines, rows, bodies, offsets, args, None, assignment))
    return res, replay


# ---- reporting -----------------------------------------------------------------------

def aggregate(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if run.get("skipped"):
            continue
        groups.setdefault((run["mode"], run["target"], run["rate"], run["path"]), []).append(run)
    rows = []
    for (mode, target, rate, path), rs in sorted(groups.items()):
        row = {"mode": mode, "target": target, "rate": rate, "path": path, "n": len(rs)}
        for key in ("slo_attainment", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p90_ms",
                    "output_tok_s", "prefix_hit_rate"):
            vals = [x[key] for x in rs if x.get(key) is not None]
            row[key] = {"mean": round(statistics.mean(vals), 4) if vals else None,
                        "min": min(vals) if vals else None, "max": max(vals) if vals else None,
                        "stdev": round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0}
        engines: dict[str, Any] = {}
        for x in rs:
            for pe in x["per_engine"]:
                engines.setdefault(pe["engine"], []).append(pe["requests"])
        row["requests_per_engine"] = {k: round(statistics.mean(v), 1) for k, v in engines.items()}
        aff = [x["followup_affinity"]["same_engine"] for x in rs
               if x.get("followup_affinity", {}).get("same_engine") is not None]
        row["followup_same_engine"] = round(statistics.mean(aff), 3) if aff else None
        row["ok_share"] = round(sum(x["ok"] for x in rs) / max(sum(x["requests"] for x in rs), 1), 4)
        for key in ("min_fair_share", "min_token_share"):
            shares = [x[key] for x in rs if x.get(key) is not None]
            row[key] = min(shares) if shares else None
        rows.append(row)
    return rows


def _fmt(stat: dict, scale: float = 1.0, digits: int = 0, spread: bool = True) -> str:
    if not stat or stat["mean"] is None:
        return "-"
    m = stat["mean"] * scale
    s = f"{m:.{digits}f}"
    if spread and stat["min"] != stat["max"]:
        s += f" [{stat['min'] * scale:.{digits}f}-{stat['max'] * scale:.{digits}f}]"
    return s


def write_markdown(path: Path, report: dict) -> None:
    cfg = report["config"]
    lines = ["# SLO replay: placement decision quality", "",
             f"Generated {report['generated']} by:", "", "```bash", report["command"], "```", "",
             (f"Workload `{cfg['workload']}` (bench/workloads.py, seed {cfg['seed']}, {cfg['requests']} requests, "
              f"{cfg['window_model_s']:.1f} s at 1x); base rate " if cfg.get("workload") else
              f"Trace window: rows {cfg['start']}..{cfg['start'] + cfg['requests'] - 1} of "
              f"`{cfg['trace_name']}` ({cfg['window_model_s']:.1f} s of trace time); base rate ") +
             f"{cfg['base_rate']}x the trace's rate; rate multipliers {cfg['rates']}; {cfg['repeats']} "
             f"repeats, interleaved. SLO: TTFT <= {cfg['slo_ttft_ms']:.0f} ms and TPOT <= "
             f"{cfg['slo_tpot_ms']:.0f} ms (model time). Output capped at {cfg['max_output']} tokens.", "",
             f"Engines: agg = {cfg['agg_engines']} x both; pd = {cfg['prefill_engines']} prefill + "
             f"{cfg['decode_engines']} decode"
             + (f"; engine speeds {cfg['engine_speeds']}" if cfg.get("engine_speeds") else "")
             + (f"; slowdown {cfg['slowdown']} (engine:at:factor)" if cfg.get("slowdown") else "")
             + ". Cost model (real units): prefill "
             f"{cfg['cost']['prefill_tok_s']:.0f} tok/s, decode step {cfg['cost']['decode_step_ms']} ms + "
             f"{cfg['cost']['decode_seq_ms']} ms/seq, chunk {cfg['cost']['max_batched_tokens']} tokens, "
             f"KV pool {cfg['cost']['kv_pool_tokens']} tokens; token scale {cfg['cost']['token_scale']} "
             f"(1 sim token = {cfg['cost']['token_scale']} trace tokens), time scale "
             f"{cfg['cost']['time_scale']} (wall s per model s). Latencies are model time.", "",
             slo_setup(cfg), "",
             "Cells: mean over repeats [min-max]. `router` = through the target; `replay` = the same "
             "request-to-engine assignment sent straight to fresh engines. Least fair share: the "
             "fewest requests any engine got, over the mean of its equals (same role and speed); "
             "1 is an even split, below 0.5 an engine starved.", ""]
    if cfg.get("reused_peers"):
        src = cfg["reused_peers"]
        lines += [f"The peers' runs are reused from an earlier report ({src['generated']}, commit "
                  f"{(src.get('commit') or '?')[:10]}; not interleaved with ours): `{src['command']}`", ""]
    for mode in cfg["modes"]:
        rows = [r for r in report["summary"] if r["mode"] == mode]
        if not rows:
            continue
        lines += [f"## {mode}", "",
                  "| target | rate | path | SLO attain % | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p90 | "
                  "hit rate % | follow-ups on predecessor's engine % | out tok/s | ok % | requests per engine | "
                  "least fair share |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["rate"], r["target"], r["path"])):
            lines.append(
                f"| {r['target']} | {r['rate']} | {r['path']} | {_fmt(r['slo_attainment'], 100, 1)} | "
                f"{_fmt(r['ttft_p50_ms'], spread=False)} | {_fmt(r['ttft_p90_ms'])} | "
                f"{_fmt(r['ttft_p99_ms'], spread=False)} | {_fmt(r['tpot_p90_ms'], digits=1)} | "
                f"{_fmt(r['prefix_hit_rate'], 100, 1)} | "
                f"{'-' if r['followup_same_engine'] is None else round(r['followup_same_engine'] * 100)} | "
                f"{_fmt(r['output_tok_s'], spread=False)} | "
                f"{r['ok_share'] * 100:.0f} | "
                f"{' / '.join(f'{v:g}' for v in r['requests_per_engine'].values())} | "
                f"{'-' if r.get('min_fair_share') is None else r['min_fair_share']} |")
        lines.append("")
    skipped = [r for r in report["runs"] if r.get("skipped")]
    if skipped:
        lines += ["## Skipped", ""]
        seen = set()
        for r in skipped:
            key = (r["target"], r["mode"])
            if key not in seen:
                seen.add(key)
                lines.append(f"- {r['target']} ({r['mode']}): {r['skipped'][:300]}")
        lines.append("")
    # Markdown images, so each plot shows on this page (tests/test_docs_figures.py checks every PNG is linked).
    plots = [Path(p).name for p in report.get("plots", []) if str(p).endswith(".png")]
    if plots:
        lines += ["Plots:", "", *(f"![{name}]({name})" for name in plots), ""]
    path.write_text("\n".join(lines))


def repo_relative(arg: str) -> str:
    """``arg`` as the report shows it: a path inside the repository (or beside it, like the
    shared traces) relative to the repository's root, so no machine's paths are written."""
    if not arg.startswith("/"):
        return arg
    # (as written and with links followed: ROOT is resolved, a link beside it, like a
    # shared/ that points elsewhere, is not)
    for path in (Path(os.path.normpath(arg)), Path(arg).resolve()):
        for base, shown in ((ROOT, ""), (ROOT.parent, "../")):
            if path.is_relative_to(base):
                return shown + str(path.relative_to(base))
    return arg


def write_plots(out_dir: Path, stem: str, report: dict, cdf_rate: float) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    files = []
    modes = [m for m in report["config"]["modes"] if any(r["mode"] == m for r in report["summary"])]
    if not modes:
        return []
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=False):
        rows = [r for r in report["summary"] if r["mode"] == mode]
        targets = sorted({r["target"] for r in rows})
        for ti, target in enumerate(targets):
            color = f"C{ti % 10}"
            for path, style in (("router", "-o"), ("replay", "--x")):
                pts = sorted((r["rate"], r["slo_attainment"]) for r in rows
                             if r["target"] == target and r["path"] == path)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1]["mean"] * 100 for p in pts], style, color=color,
                        label=f"{target} ({path})", alpha=1.0 if path == "router" else 0.6)
                ax.fill_between(xs, [p[1]["min"] * 100 for p in pts], [p[1]["max"] * 100 for p in pts],
                                color=color, alpha=0.08)
        ax.axhline(90, color="grey", lw=0.7, ls=":")
        ax.set_title(f"{mode}: SLO attainment vs rate")
        ax.set_xlabel("rate multiplier")
        ax.set_ylabel("requests meeting SLO (%)")
        ax.set_ylim(0, 102)
        ax.legend(fontsize=6)
    fig.tight_layout()
    p = out_dir / f"{stem}_attainment.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(str(p))

    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=False):
        runs = [r for r in report["runs"] if not r.get("skipped") and r["mode"] == mode
                and r["rate"] == cdf_rate]
        targets = sorted({r["target"] for r in runs})
        for ti, target in enumerate(targets):
            for path, style in (("router", "-"), ("replay", "--")):
                vals = sorted(v for r in runs if r["target"] == target and r["path"] == path
                              for v in r["ttft_ms_all"])
                if vals:
                    ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], style,
                            color=f"C{ti % 10}", label=f"{target} ({path})")
        ax.axvline(report["config"]["slo_ttft_ms"], color="grey", lw=0.7, ls=":")
        ax.set_xscale("log")
        ax.set_title(f"{mode}: TTFT CDF at rate {cdf_rate}")
        ax.set_xlabel("TTFT (ms, model time)")
        ax.set_ylabel("share of successful requests")
        ax.legend(fontsize=6)
    fig.tight_layout()
    p = out_dir / f"{stem}_ttft_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(str(p))
    return files


# ---- main ----------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default=None,
                   help="replay a generated workload shape (bench/workloads.py: "
                        "system_prompt, agent, longdoc, mixed) instead of the trace")
    p.add_argument("--seed", type=int, default=0, help="seed of --workload")
    p.add_argument("--engine-speeds", default="",
                   help="per-engine speed factors in start order, e.g. 1,1,0.5 (default: all 1)")
    p.add_argument("--slowdown", default="",
                   help="ENGINE:AT:FACTOR: that engine runs FACTOR times slower from the fraction AT of "
                        "the window on (e.g. 1:0.5:2)")
    p.add_argument("--trace", type=Path, default=None,
                   help="the Mooncake trace (default: shared/traces/ in or next to the repository root)")
    p.add_argument("--start", type=int, default=3500, help="first trace row")
    p.add_argument("--requests", type=int, default=150, help="rows replayed per run")
    p.add_argument("--rates", default="0.5,1,1.5,2", help="multipliers of --base-rate")
    p.add_argument("--base-rate", type=float, default=None,
                   help="multiplier of the trace's own arrival rate (default 0.25; 1 with --workload)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="agg,pd", help="agg and/or pd")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="our control-plane policies, any names")
    p.add_argument("--profiles", type=Path, default=None,
                   help="TOML with [profiles.NAME] tables for our control plane (custom policies named in --policies)")
    p.add_argument("--peers", default="vllm-router,smg", help="peer routers (vllm-router, smg)")
    p.add_argument("--peer-policies", default="cache_aware,round_robin",
                   help="policies of every peer; PEER:POLICY for one peer only (smg:cache_aware)")
    p.add_argument("--no-peers", action="store_true", help="only our policies")
    p.add_argument("--reuse-peers", type=Path, default=None, metavar="JSON",
                   help="run only our policies and take the peers' runs (same modes and rates) from this "
                        "earlier report of the same case; the report says so and where they came from")
    p.add_argument("--no-replay", dest="replay", action="store_false", help="skip the assignment replay")
    p.add_argument("--no-peer-replay", dest="peer_replay", action="store_false",
                   help="replay only our policies' assignments (the peers' decisions are measured through them)")
    p.add_argument("--agg-engines", type=int, default=4)
    p.add_argument("--prefill-engines", type=int, default=2)
    p.add_argument("--decode-engines", type=int, default=2)
    p.add_argument("--max-output", type=int, default=128, help="cap on output tokens per request")
    p.add_argument("--token-scale", type=int, default=8, help="trace tokens per simulated token")
    p.add_argument("--time-scale", type=float, default=0.5, help="wall seconds per model second")
    p.add_argument("--prefill-tok-s", type=float, default=20000.0, help="model prefill speed, real tokens/s")
    p.add_argument("--decode-step-ms", type=float, default=12.0)
    p.add_argument("--decode-seq-ms", type=float, default=0.15)
    p.add_argument("--kv-transfer-tok-s", type=float, default=200000.0)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="real tokens per step (chunked prefill)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-pool-tokens", type=int, default=450000, help="real tokens of KV per engine")
    p.add_argument("--max-model-len", type=int, default=131072, help="real tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo-headers", action="store_true",
                   help="send the measured SLO as request headers, in wall time (slo_headers)")
    p.add_argument("--slo-config", action="store_true",
                   help="start our control plane with the measured SLO as its deployment targets ([slo], in wall "
                        "time: slo_config)")
    p.add_argument("--max-run-seconds", type=float, default=300.0, help="wall-time bound of one run")
    p.add_argument("--poll-s", type=float, default=1.0, help="engine request-log / state sampling period")
    p.add_argument("--close-s", type=float, default=5.0,
                   help="follow-up affinity: a follow-up arriving within this many model seconds of its predecessor")
    p.add_argument("--cdf-rate", type=float, default=None, help="rate of the TTFT CDF plot (default: 1 or the middle)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="output directory")
    p.add_argument("--name", default="slo_replay", help="output file stem")
    p.add_argument("--git-ref", default=None,
                   help="run every process from `git archive REF` of this repository (e.g. HEAD), so "
                        "uncommitted edits in the working tree do not leak into the measurement")
    p.add_argument("--keep-logs", type=Path, default=None, help="keep every run's process logs under this directory")
    return p, p.parse_args(argv)


def source_snapshot(ref: str) -> tuple[Path, str]:
    """Extract ``git archive ref`` into a fresh temp dir; children run from there."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True,
                            text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="slo-replay-src-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp, commit


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    if args.base_rate is None:
        args.base_rate = 1.0 if args.workload else 0.25
    try:
        if args.slowdown:
            parse_slowdown(args.slowdown)
        engine_speeds(args, 0)
    except ValueError as exc:
        parser.error(str(exc))
    if args.workload:
        trace = Path(f"workload:{args.workload}")
    else:
        try:
            trace = resolve_trace(args.trace)
        except TraceMissing as exc:
            parser.error(str(exc))
    args.out = args.out.resolve()
    if args.reuse_peers:
        args.reuse_peers = args.reuse_peers.resolve()
    if args.keep_logs:
        args.keep_logs = args.keep_logs.resolve()
    with code_from(args.git_ref) as code:
        return _main(parser, args, trace, code)


@contextlib.contextmanager
def code_from(git_ref: str | None):
    """Yields what code the children run (commit, dirty working tree). With ``git_ref``,
    from ``git archive git_ref`` in a temp dir (cwd and PYTHONPATH point there meanwhile),
    so uncommitted edits in the working tree do not leak into the measurement."""
    snapshot = None
    code: dict[str, Any] = {"git_ref": git_ref}
    try:
        code["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", git_ref or "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
        if not git_ref:
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True).stdout
            code["working_tree_dirty"] = bool(dirty.strip())
    except OSError:
        pass
    saved_path = os.environ.get("PYTHONPATH")
    if git_ref:
        snapshot, code["commit"] = source_snapshot(git_ref)
        # python -m puts the cwd first on sys.path, PYTHONPATH comes next: both the snapshot.
        os.environ["PYTHONPATH"] = str(snapshot) + os.pathsep + (saved_path or "")
        os.chdir(snapshot)
    try:
        yield code
    finally:
        if snapshot is not None:
            os.chdir(ROOT)
            if saved_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved_path
            shutil.rmtree(snapshot, ignore_errors=True)


def reused_peer_runs(path: Path, modes: list[str], rates: list[float]) -> dict[str, Any]:
    """The peers' runs of an earlier report, for a rerun of our policies alone.

    Peers do not change between our commits, so when only our side changed a case can be
    rerun in a fraction of the time; the report names the run they came from (its date,
    commit and command), since they were not interleaved with ours."""
    old = json.loads(path.read_text())
    runs = [r for r in old["runs"] if not r["target"].startswith("ours:") and r["mode"] in modes
            and r["rate"] in rates]
    missing = sorted({(m, r) for m in modes for r in rates} - {(x["mode"], x["rate"]) for x in runs})
    if missing:
        raise SystemExit(f"--reuse-peers {path}: no peer runs for (mode, rate) {missing}")
    return {"runs": runs, "targets": list(dict.fromkeys(r["target"] for r in runs)),
            "peer_versions": old["config"].get("peer_versions", {}),
            # A report whose peers were reused itself names where they were run: that run.
            "source": old["config"].get("reused_peers") or {
                "generated": old["generated"], "commit": old["code"].get("commit"), "command": old["command"]}}


def _main(parser, args, trace: Path, code: dict) -> int:
    if args.workload:
        try:
            rows = generate_workload(args.workload, args.requests, args.seed)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        rows = load_rows(trace, args.start, args.requests)
    if len(rows) < 2:
        parser.error(f"need at least 2 rows from row {args.start} of {trace}")
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    modes = [m for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("agg", "pd"):
            parser.error(f"unknown mode {m!r}")
    cost = Cost(args.token_scale, args.time_scale, args.prefill_tok_s, args.decode_step_ms, args.decode_seq_ms,
                args.kv_transfer_tok_s, args.max_batched_tokens, args.max_num_seqs, args.kv_pool_tokens,
                args.max_model_len)
    sim_max_len = args.max_model_len // args.token_scale
    bodies = []
    for i, row in enumerate(rows):
        max_tokens = max(1, min(row["output_length"], args.max_output))
        bodies.append({"model": "sim-model", "prompt": prompt_for(row, args.token_scale, sim_max_len - max_tokens),
                       "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                       "user": f"slo{i}x"})
    preds = predecessors(rows)
    t0 = rows[0]["timestamp"]
    window_s = (rows[-1]["timestamp"] - t0) / 1000

    targets = [Target("ours", p) for p in args.policies.split(",") if p.strip()]
    skipped_peer: dict[str, str] = {}
    reused = reused_peer_runs(args.reuse_peers, modes, rates) if args.reuse_peers else None
    if not args.no_peers and reused is None:
        peer_names = [x for x in args.peers.split(",") if x.strip()]
        for peer in peer_names:
            if peer not in peerlib.PEER_PACKAGES:
                parser.error(f"unknown peer {peer!r}")
        skipped_peer = peerlib.ensure_installed(peer_names)
        for pol in (x.strip() for x in args.peer_policies.split(",") if x.strip()):
            peer, sep, policy = pol.rpartition(":")
            if sep and peer not in peer_names:
                parser.error(f"--peer-policies {pol!r}: {peer!r} is not one of --peers")
            targets += [Target(peer, policy)] if sep else [Target(p, pol) for p in peer_names]

    from rich.console import Console
    from rich.markup import escape
    console = Console(stderr=True, highlight=False, width=250)
    runs: list[dict] = []
    broken: dict[tuple[str, str], str] = {}
    total = args.repeats * len(modes) * len(rates) * len(targets)
    n = 0
    started = time.time()
    for rep in range(args.repeats):
        order = targets[rep % len(targets):] + targets[:rep % len(targets)]   # interleave: rotate per repeat
        for mode in modes:
            for rate in rates:
                offsets = [(r["timestamp"] - t0) / 1000 / (args.base_rate * rate) * args.time_scale for r in rows]
                for target in order:
                    n += 1
                    meta = {"target": target.name, "mode": mode, "rate": rate, "repeat": rep}
                    reason = skipped_peer.get(target.kind) or broken.get((target.name, mode))
                    if reason:
                        runs.append({**meta, "path": "router", "skipped": reason})
                        continue
                    t_run = time.time()
                    try:
                        res, rep_res = run_once(target, mode, rows, bodies, offsets, args, cost)
                    except LaunchError as exc:
                        broken[(target.name, mode)] = f"could not start: {exc}"
                        runs.append({**meta, "path": "router", "skipped": broken[(target.name, mode)]})
                        # (the first line says which process; the log's last line says why)
                        said = [line for line in str(exc).splitlines() if line.strip()] or [""]
                        why = said[0] + (f" ... {said[-1]}" if len(said) > 1 else "")
                        console.print(f"[{n}/{total}] {target.name} {mode} x{rate}: [red]skipped[/] "
                                      f"({escape(why[:300])})")
                        continue
                    if res["ok"] < 0.5 * res["requests"]:
                        broken[(target.name, mode)] = (f"{res['ok']}/{res['requests']} requests succeeded; "
                                                       f"errors: {json.dumps(res['errors'])[:300]}")
                    res["followup_affinity"] = followup_affinity(res, preds, args.base_rate * rate,
                                                                 args.close_s)
                    runs.append({**meta, "path": "router", **res})
                    if rep_res is not None:
                        runs.append({**meta, "path": "replay", **rep_res})
                    rp = (f" | replay {rep_res['slo_attainment'] * 100:5.1f}% TTFT p90 {rep_res['ttft_p90_ms']}"
                          if rep_res else "")
                    console.print(
                        f"[{n}/{total}] rep {rep} {mode} x{rate:g} {target.name:<24} "
                        f"SLO {res['slo_attainment'] * 100:5.1f}% ok {res['ok']}/{res['requests']} "
                        f"TTFT p50/p90 {res['ttft_p50_ms']}/{res['ttft_p90_ms']} TPOT p90 {res['tpot_p90_ms']} "
                        f"hit {res['prefix_hit_rate']} per-engine "
                        f"{[pe['requests'] for pe in res['per_engine']]} follow-ups on predecessor's engine "
                        f"{res['followup_affinity']['same_engine']}{rp}"
                        + (f" stages {res['stages']}" if res.get("stages") else "")
                        + f" ({time.time() - t_run:.0f}s)")

    if reused is not None:
        runs += reused["runs"]
        targets += [Target(*name.split(":", 1)) for name in reused["targets"]]
    cdf_rate = args.cdf_rate if args.cdf_rate is not None else (1.0 if 1.0 in rates else rates[len(rates) // 2])
    report: dict[str, Any] = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/slo_replay.py " + " ".join(shlex.quote(repo_relative(a)) for a in args.argv),
        "elapsed_s": round(time.time() - started, 1),
        "code": code,
        "config": {"trace_name": trace.name, "workload": args.workload, "seed": args.seed,
                   "engine_speeds": args.engine_speeds, "slowdown": args.slowdown, "start": args.start,
                   "requests": len(rows), "window_model_s": window_s,
                   "rates": rates, "base_rate": args.base_rate, "repeats": args.repeats, "modes": modes,
                   "targets": [t.name for t in targets], "slo_ttft_ms": args.slo_ttft_ms,
                   "slo_tpot_ms": args.slo_tpot_ms, "slo_config": args.slo_config,
                   "slo_headers": args.slo_headers, "max_output": args.max_output,
                   "agg_engines": args.agg_engines, "prefill_engines": args.prefill_engines,
                   "decode_engines": args.decode_engines, "cost": cost.describe(),
                   "peer_versions": (reused["peer_versions"] if reused is not None else
                                     dict(peerlib.PEER_PACKAGES) if not args.no_peers else {}),
                   "reused_peers": None if reused is None else reused["source"]},
        "summary": aggregate(runs),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report["plots"] = [repo_relative(p) for p in write_plots(args.out, args.name, report, cdf_rate)]
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    write_markdown(args.out / f"{args.name}.md", report)
    console.print(f"wrote {args.out / (args.name + '.json')}, .md and {len(report['plots'])} plots "
                  f"in {report['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
