"""Scale-out: placements/s and p99 placement latency with 1-3 data planes against 1-2
control-plane replicas, in-memory store vs Redis store (issue 10).

    python bench/scaleout.py [--rounds 5] [--seconds 1] [--concurrency 8] [--stores memory redis ...] \
        [--out docs/benchmarks]

What runs, all real processes on 127.0.0.1, every one of them ending with the benchmark
(``omni_proxy.launcher``: lifeline + process groups):

* one zero-latency engine (``bench/mock_engine.py``) behind 16 workers (``[[workers]]``
  with their own ids on the same URL), so every control plane has 16 healthy candidates;
* a redis-server the benchmark starts in a temporary directory (``tests/redis_fixtures``,
  loopback TCP, no persistence);
* control planes started by the launcher (``python -m omni_proxy.launcher controlplane
  --config ...``), policy ``least_load``: one on the memory store, and for each Redis
  configuration two replicas sharing one key prefix. Redis configurations (``--stores``):
  ``redis`` (the defaults: shared ledger, every placement waits for Redis),
  ``redis-mirror-wb`` (``loads_max_age_s = 0.05``, ``write_behind = true``) and
  ``redis-local`` (``ledger = "local"``, controlplane/state/local.py);
* up to three "data planes": each a process of its own holding a
  ``dataplane.placement_client.PlacementClient`` session with one control plane (data plane
  ``i`` talks to replica ``i mod replicas``), placing requests as fast as its
  ``--concurrency`` loops allow and sending the FINISHED report of each request as soon as
  its placement is back, exactly as the data plane does for a request that finished at once.

Why the gRPC Place round trip and not whole HTTP requests through data-plane processes: a
placement is what the store changes. Whole requests against zero-latency engines would add
HTTP parsing, proxying and engine emulation (several hundred microseconds of CPU per request
on this machine, more processes on the same two cores) to every sample, so the store's share
of a request's latency would be diluted and the noise of everything else would decide the
p99. ``PlacementClient.place`` is the call a data plane's request awaits before it can
open its upstream connection: the latency measured is the one a request waits for its
placement (stream write, control-plane placement with its store calls, reply), and the
placements/s are what the control-plane replicas sustain through their data-plane sessions.

Cells: store x control planes x data planes (memory with one control plane only: the
memory store is not shared, two replicas on it would be two independent ledgers). Every
round runs every cell once, in an order rotated per round, so a noisy neighbour slows all
alike. In a cell, its data planes start together (a common wall-clock instant, after
``--warm`` seconds of unmeasured load) and place for ``--seconds`` or ``--max-count``
placements each, whichever comes first; placements/s is the sum over data planes of their
measured placements over their measured time, p99 is over all their placements together.
Reported: the median over rounds and the spread (min..max); the Redis/memory p99 ratio is
taken per round (same data-plane count, one memory control plane) and its median and spread
reported. Bounded: ``--max-seconds`` in all (default 900). Writes
``scaleout.{json,md,png}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "sim-model"
WORKERS = 16
GOAL_RATIO = 1.5
NOTES_MARK = "<!-- analysis: kept across reruns -->"
# Redis configurations: [state] keys (besides backend, redis_url, key_prefix).
STORES: dict[str, dict] = {
    "memory": {},
    "redis": {},                                                     # the defaults
    "redis-mirror-wb": {"loads_max_age_s": 0.05, "write_behind": True},
    "redis-exact": {"loads_max_age_s": 0.0, "write_behind": False},   # every placement reads and writes Redis
    "redis-local": {"ledger": "local"},                              # controlplane/state/local.py
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


# ---------------------------------------------------------------------------- data plane

class Driver:
    """One data plane's placements: a PlacementClient per control plane it is sent to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clients: dict[str, Any] = {}   # PlacementClients (imported in the driver process)
        self.seq = 0
        self.held: list[tuple[str, str]] = []    # (request, worker) of an accuracy burst

    async def client(self, target: str):
        from dataplane.placement_client import PlacementClient

        c = self.clients.get(target)
        if c is None:
            c = self.clients[target] = PlacementClient(target, f"{self.name}-{target}", timeout_s=10.0)
            await c.start()
            if not await c.wait_connected(30):
                raise RuntimeError(f"{self.name}: no session with {target}")
        return c

    async def run(self, job: dict) -> dict:
        from protos import omni_proxy_pb2 as pb

        client = await self.client(job["target"])
        if job.get("release"):      # the end of an accuracy burst: every held request finishes
            for rid, wid in self.held:
                client.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED, worker_id=wid))
            n, self.held = len(self.held), []
            return {"released": n}
        hold = job.get("hold", False)
        placed_on: dict[str, int] = {}
        start_at, seconds, max_count = job["start_at"], job["seconds"], job["max_count"]
        warm_from = start_at - job["warm"]
        stop_at = start_at + seconds
        samples: list[int] = []
        errors: list[str] = []
        last_end = [start_at]
        tag = job["tag"]
        while time.time() < warm_from - 0.002:
            await asyncio.sleep(min(0.05, warm_from - time.time()))

        async def loop() -> None:
            while True:
                now = time.time()
                if now >= stop_at or len(samples) >= max_count:
                    return
                self.seq += 1
                rid = f"{tag}-{self.name}-{self.seq}"
                req = pb.PlaceRequest(request_id=rid, model=MODEL, leg=pb.LEG_ENTRY, prompt_tokens=512,
                                      max_tokens=128)
                t0 = time.perf_counter_ns()
                out = await client.place(req)
                dt = time.perf_counter_ns() - t0
                if out.error:
                    if len(errors) < 5:
                        errors.append(f"{pb.ErrorCode.Name(out.error)}: {out.error_message}")
                    await asyncio.sleep(0.01)
                    continue
                if hold:            # accuracy burst: the request stays in flight until released
                    self.held.append((rid, out.decode.worker_id))
                    placed_on[out.decode.worker_id] = placed_on.get(out.decode.worker_id, 0) + 1
                else:
                    client.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED,
                                                    worker_id=out.decode.worker_id))
                if now >= start_at and len(samples) < max_count:
                    samples.append(dt // 1000)   # us
                    last_end[0] = time.time()

        await asyncio.gather(*(loop() for _ in range(job["concurrency"])))
        elapsed = max(1e-6, min(stop_at, last_end[0]) - start_at) if samples else seconds
        return {"n": len(samples), "elapsed_s": elapsed, "samples_us": samples, "errors": errors,
                "placed_on": placed_on}


async def driver_main(name: str, ready_file: str) -> None:
    """A data-plane process: runs the jobs the benchmark sends on a loopback socket (JSON lines)."""
    driver = Driver(name)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            job = json.loads(line)
            try:
                out = await driver.run(job)
            except Exception as exc:  # noqa: BLE001 - reported to the benchmark
                out = {"n": 0, "elapsed_s": 0.0, "samples_us": [], "errors": [f"{type(exc).__name__}: {exc}"]}
            writer.write(json.dumps(out).encode() + b"\n")
            await writer.drain()
        writer.close()
        done.set()

    done = asyncio.Event()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tmp = ready_file + ".tmp"
    Path(tmp).write_text(json.dumps({"port": port}))
    os.replace(tmp, ready_file)
    await done.wait()
    for c in driver.clients.values():
        await c.close()
    server.close()


# ---------------------------------------------------------------------------- the benchmark

def config_toml(engine_url: str, store: str, redis_url: str) -> str:
    lines = ['policy = "least_load"', "", "[health]", "interval_s = 30.0", "poll_metrics = false", ""]
    if store != "memory":
        lines += ["[state]", 'backend = "redis"', f'redis_url = "{redis_url}"', f'key_prefix = "{store}:"']
        for key, value in STORES[store].items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    for i in range(WORKERS):
        lines += ["[[workers]]", f'id = "w{i:02d}"', f'url = "{engine_url}/w{i:02d}"', f'model = "{MODEL}"', ""]
    return "\n".join(lines)


def cells(stores: list[str], dataplanes: list[int], replicas: list[int]) -> list[tuple[str, int, int]]:
    out = []
    for store in stores:
        for cps in ([1] if store == "memory" else replicas):
            for dps in dataplanes:
                out.append((store, cps, dps))
    return out


def cell_key(store: str, cps: int, dps: int) -> str:
    return f"{store} {cps}cp {dps}dp"


async def run(args: argparse.Namespace) -> dict:
    from bench.overhead import cpu_seconds, process_tree
    from omni_proxy.launcher import ProcessGroup, port_in
    from tests.redis_fixtures import RedisServer

    stores = args.stores
    todo = cells(stores, args.dataplanes, args.replicas)
    started = time.monotonic()
    deadline = started + args.max_seconds
    redis = RedisServer(tcp=True) if any(s != "memory" for s in stores) else None
    result: dict = {"rounds": [], "cells": [cell_key(*c) for c in todo]}
    try:
        if redis is not None:
            redis.start()
            log(f"redis-server on {redis.url} (dir {redis.dir})")
        with ProcessGroup(ready_timeout=90) as group:
            engine = group.start_program("engine", [sys.executable, str(ROOT / "bench" / "mock_engine.py"), "--port",
                                                    "0", "--ready-file", str(group.workdir / "engine.ready")],
                                         port_in(group.workdir / "engine.ready"))
            log(f"engine on {engine.url}")
            planes: dict[str, list] = {}
            for store in stores:
                cfg = group.workdir / f"{store}.toml"
                cfg.write_text(config_toml(engine.url, store, redis.url if redis else ""))
                n = 1 if store == "memory" else max(args.replicas)
                planes[store] = [group.start(f"cp-{store}-{i}", ["controlplane", "--config", str(cfg), "--listen",
                                                                 "127.0.0.1:0", "--http-port", "0", "--log-level",
                                                                 "WARNING"]) for i in range(n)]
                log(f"control planes {store}: {', '.join(p.address for p in planes[store])}")
            drivers = []
            groups: dict[str, int] = {"redis": redis.proc.pid} if redis is not None and redis.proc else {}
            for i in range(max(args.dataplanes)):
                ready = group.workdir / f"dp{i}.ready"
                child = group.start_program(f"dp{i}", [sys.executable, str(Path(__file__).resolve()), "--driver",
                                                       f"dp{i}", "--ready-file", str(ready)], port_in(ready))
                reader, writer = await asyncio.open_connection("127.0.0.1", child.port, limit=1 << 26)
                drivers.append((reader, writer))
                groups[f"dp{i}"] = child.proc.pid
            log(f"{len(drivers)} data planes up; {len(todo)} cells x {args.rounds} rounds")

            async def job(i: int, target: str, tag: str, start_at: float, warm: float,
                          seconds: float = args.seconds, max_count: int = args.max_count, hold: bool = False) -> dict:
                reader, writer = drivers[i]
                writer.write(json.dumps({"target": target, "tag": tag, "start_at": start_at, "warm": warm,
                                         "seconds": seconds, "max_count": max_count, "hold": hold,
                                         "concurrency": args.concurrency}).encode() + b"\n")
                await writer.drain()
                return json.loads(await reader.readline())

            async def release(i: int, target: str) -> dict:
                reader, writer = drivers[i]
                writer.write(json.dumps({"target": target, "release": True}).encode() + b"\n")
                await writer.drain()
                return json.loads(await reader.readline())

            async def cpu_at(t: float, roots: dict[str, int]) -> dict[str, tuple[list[int], float]]:
                """Each process's tree (a guard and its program, a control plane's helpers) and its CPU
                seconds at ``t``."""
                await asyncio.sleep(max(0.0, t - time.time()))
                trees = {k: process_tree(pid) for k, pid in roots.items()}
                return {k: (pids, cpu_seconds(pids)) for k, pids in trees.items()}

            # Sessions up and workers healthy everywhere before the first measured cell.
            for store, cps, dps in todo:
                for i in range(dps):
                    tag = f"w-{store}-{cps}-{dps}"
                    out = await job(i, planes[store][i % cps].address, tag, time.time() + 0.1, 0.0, 0.3)
                    if out["errors"] and not out["n"]:
                        raise RuntimeError(f"{cell_key(store, cps, dps)}: {out['errors']}")
            log(f"warmed up in {time.monotonic() - started:.0f}s")
            for r in range(args.rounds):
                order = todo[r % len(todo):] + todo[:r % len(todo)]
                rnd: dict = {}
                for store, cps, dps in order:
                    if time.monotonic() > deadline:
                        log("--max-seconds reached: stopping")
                        result["rounds"].append(rnd)
                        result["stopped_early"] = True
                        return result
                    start_at = time.time() + 0.3 + args.warm
                    tag = f"r{r}-{store}-{cps}-{dps}"
                    roots = {**{f"cp{i}": planes[store][i].proc.pid for i in range(cps)},
                             **({"redis": groups["redis"]} if store != "memory" else {}),
                             **{f"dp{i}": groups[f"dp{i}"] for i in range(dps)}}
                    cpu_from = asyncio.ensure_future(cpu_at(start_at, roots)) if args.cpu else None
                    outs = await asyncio.gather(*(job(i, planes[store][i % cps].address, tag, start_at, args.warm)
                                                  for i in range(dps)))
                    samples = [x for o in outs for x in o["samples_us"]]
                    res = {"placements_per_s": round(sum(o["n"] / o["elapsed_s"] for o in outs if o["n"]), 1),
                           "p50_us": pct(samples, 0.5), "p99_us": pct(samples, 0.99), "n": len(samples),
                           "errors": [e for o in outs for e in o["errors"]]}
                    if cpu_from is not None and samples:
                        used = {k: cpu_seconds(pids) - at for k, (pids, at) in (await cpu_from).items()}
                        used["dps"] = sum(used.pop(f"dp{i}") for i in range(dps))
                        res["cpu_us_per_placement"] = {k: round(v / len(samples) * 1e6, 1) for k, v in used.items()}
                    rnd[cell_key(store, cps, dps)] = res
                    log(f"round {r + 1}/{args.rounds} {cell_key(store, cps, dps):24s} "
                        f"{res['placements_per_s']:8.0f} placements/s  p50 {res['p50_us']:6.0f} us  "
                        f"p99 {res['p99_us']:6.0f} us  n={res['n']}"
                        + (f"  errors: {res['errors'][:2]}" if res["errors"] else "")
                        + ("  CPU us/placement " + " ".join(f"{k} {v:.0f}" for k, v in cpu.items())
                           if (cpu := res.get("cpu_us_per_placement")) else ""))
                result["rounds"].append(rnd)
            if args.burst:
                result["accuracy"] = await accuracy_bursts(args, stores, planes, job, release)
            for _, writer in drivers:
                writer.close()
    finally:
        if redis is not None:
            redis.close()
    return result


async def accuracy_bursts(args: argparse.Namespace, stores: list[str], planes: dict, job, release) -> dict:
    """Load accuracy: two data planes each place a burst of ``--burst`` requests at once (one
    replica each with Redis, both on the one memory control plane) and keep them all in flight.
    An informed least_load never puts more than an even share (ceil(N / workers)) on a worker
    while every request stays open, so each placement beyond that share on any worker was made
    on a stale view of the loads. Reported per store: that count over N, median of the rounds."""
    out: dict = {}
    for r in range(args.burst_rounds):
        for store in stores:
            cps = 1 if store == "memory" else max(args.replicas)
            start_at = time.time() + 0.3
            tag = f"b{r}-{store}"
            outs = await asyncio.gather(*(job(i, planes[store][i % cps].address, tag, start_at, 0.0, seconds=30.0,
                                              max_count=args.burst, hold=True) for i in range(2)))
            counts: dict[str, int] = {}
            for o in outs:
                for wid, n in o["placed_on"].items():
                    counts[wid] = counts.get(wid, 0) + n
            total = sum(counts.values())
            share = -(-total // WORKERS)
            stale = sum(max(0, n - share) for n in counts.values())
            await asyncio.gather(*(release(i, planes[store][i % cps].address) for i in range(2)))
            row = out.setdefault(store, {"stale_fraction": [], "max_on_one": [], "placed": []})
            row["stale_fraction"].append(round(stale / total, 4) if total else None)
            row["max_on_one"].append(max(counts.values(), default=0))
            row["placed"].append(total)
            log(f"burst {r + 1}/{args.burst_rounds} {store:16s} {total} placed, even share {share}, most on one "
                f"worker {max(counts.values(), default=0)}, placed beyond the share {stale} "
                f"({stale / max(total, 1):.1%})")
            # the released requests' ends reach every replica's view before the next burst
            await asyncio.sleep(1.0)
    for row in out.values():
        row["stale_fraction_median"] = statistics.median(x for x in row["stale_fraction"] if x is not None)
    return out


def spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)} \
        if xs else {}


def summarize(result: dict) -> dict:
    rounds = [r for r in result["rounds"] if r]
    summary: dict = {}
    for key in result["cells"]:
        got = [r[key] for r in rounds if key in r]
        if not got:
            continue
        store, cps, dps = key.split()
        s: dict[str, Any] = {m: spread([g[m] for g in got]) for m in ("placements_per_s", "p50_us", "p99_us")}
        mem_key = f"memory 1cp {dps}"
        if store != "memory":
            pairs = [(r[key], r[mem_key]) for r in rounds if key in r and mem_key in r]
            s["p99_vs_memory"] = spread([a["p99_us"] / b["p99_us"] for a, b in pairs if b["p99_us"]])
            s["p50_vs_memory"] = spread([a["p50_us"] / b["p50_us"] for a, b in pairs if b["p50_us"]])
            s["throughput_vs_memory"] = spread([a["placements_per_s"] / b["placements_per_s"]
                                                for a, b in pairs if b["placements_per_s"]])
        cpu = [g["cpu_us_per_placement"] for g in got if "cpu_us_per_placement" in g]
        if cpu:
            s["cpu_us_per_placement"] = {k: spread([c[k] for c in cpu if k in c]) for k in cpu[0]}
        s["rounds"] = len(got)
        summary[key] = s
    return summary


def _f(s: dict, fmt: str = "{:.0f}") -> str:
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def markdown(result: dict, summary: dict) -> str:
    lines = [
        "# Scale-out: placements/s and p99 placement latency, memory vs Redis store",
        "",
        f"`{result['command']}` on {result['host']} (load average at start {result['loadavg']}); "
        f"{result['args']['rounds']} interleaved rounds, {result['args']['seconds']:g} s measured per cell after "
        f"{result['args']['warm']:g} s of warm-up, {result['args']['concurrency']} placements in flight per data "
        f"plane, {WORKERS} workers, policy least_load, redis-server {result.get('redis_version', '?')} on loopback "
        f"TCP. Latency is the gRPC Place round trip as a data plane's request waits for it "
        "(`PlacementClient.place`, each data plane its own process); every placed request is reported FINISHED at "
        "once. Cells show the median over rounds and the spread (min-max). Redis configurations: "
        + "; ".join(f"`{k}`: " + (", ".join(f"{kk} = {json.dumps(vv)}" for kk, vv in v.items()) or "defaults")
                    for k, v in STORES.items() if k != "memory" and k in result["args"]["stores"]) + ".",
        "",
        "| store | control planes | data planes | placements/s | p50 us | p99 us | **p99 vs memory** (goal <= 1.5x) "
        "| placements/s vs memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        store, cps, dps = key.split()
        ratio = s.get("p99_vs_memory")
        lines.append(f"| {store} | {cps[:-2]} | {dps[:-2]} | {_f(s['placements_per_s'])} | {_f(s['p50_us'])} "
                     f"| {_f(s['p99_us'])} | "
                     + (f"**{_f(ratio, '{:.2f}')}x**" if ratio else "1") + " | "
                     + (f"{_f(s['throughput_vs_memory'], '{:.2f}')}x" if ratio else "1") + " |")
    cpu_rows = [(key, s["cpu_us_per_placement"]) for key, s in summary.items() if "cpu_us_per_placement" in s]
    if cpu_rows:
        lines += ["", "CPU per placement (`--cpu`: /proc user + system time of each process from a cell's start to "
                  "its end over its placements, us; median over rounds and spread; cp0/cp1: the control planes, "
                  "dps: the data planes together):", "", "| cell | CPU us per placement |", "|---|---|"]
        lines += [f"| {key} | " + ", ".join(f"{k} {_f(v)}" for k, v in cpu.items()) + " |" for key, cpu in cpu_rows]
    lines += ["", "![placements/s and p99 placement latency per data-plane count](scaleout.png)", "",
              "## Reading", ""]
    for store in result["args"]["stores"]:
        if store == "memory":
            continue
        ratios = {k: s["p99_vs_memory"] for k, s in summary.items() if k.startswith(store + " ") and
                  s.get("p99_vs_memory")}
        if not ratios:
            continue
        worst = max(ratios, key=lambda k: ratios[k]["median"])
        met = all(r["median"] <= GOAL_RATIO for r in ratios.values())
        tput = [s["throughput_vs_memory"]["median"] for k, s in summary.items() if k in ratios]
        above = ("" if not met or all(r['max'] <= GOAL_RATIO for r in ratios.values())
                 else " (single rounds above it: see the spreads; this machine is shared)")
        lines.append(f"* `{store}`: p99 vs memory {min(r['median'] for r in ratios.values()):.2f}x to "
                     f"{ratios[worst]['median']:.2f}x (worst: {worst}, spread {_f(ratios[worst], '{:.2f}')}); the "
                     f"1.5x goal is {'met in every cell by the median over rounds' if met else 'NOT met'}"
                     f"{above}"
                     f". Placements/s "
                     f"{min(tput):.2f}x to {max(tput):.2f}x of memory.")
    lines.append("* Two replicas on Redis are compared with one memory control plane (the memory store is not "
                 "shared); on this machine every process shares the same two cores, so a second replica adds "
                 "CPU contention rather than capacity.")
    errors = {k: v["errors"] for r in result["rounds"] for k, v in r.items() if v.get("errors")}
    if errors:
        lines += ["", "Errors seen: " + "; ".join(f"{k}: {v[:2]}" for k, v in errors.items())]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list] = {}
    for key, s in summary.items():
        store, cps, dps = key.split()
        series.setdefault(f"{store} {cps}", []).append((int(dps[:-2]), s))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], "placements_per_s", "placements/s"),
                              (axes[1], "p99_us", "p99 placement latency (us)")):
        for name, points in series.items():
            points.sort()
            xs = [p[0] for p in points]
            med = [p[1][metric]["median"] for p in points]
            err = [[m - p[1][metric]["min"] for m, p in zip(med, points, strict=False)],
                   [p[1][metric]["max"] - m for m, p in zip(med, points, strict=False)]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xlabel("data planes")
        ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
        ax.set_title(title)
        if metric == "p99_us":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0, help="measured seconds per cell")
    p.add_argument("--warm", type=float, default=0.3, help="unmeasured seconds of load before each cell")
    p.add_argument("--max-count", type=int, default=50_000, help="at most this many placements per data plane and cell")
    p.add_argument("--concurrency", type=int, default=8, help="placements in flight per data plane")
    p.add_argument("--dataplanes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="control planes (Redis stores only)")
    p.add_argument("--stores", nargs="+", default=list(STORES), choices=list(STORES))
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop after this long in all")
    p.add_argument("--burst", type=int, default=0,
                   help="load accuracy: each of two data planes places this many requests at once and holds them")
    p.add_argument("--burst-rounds", type=int, default=3)
    p.add_argument("--cpu", action="store_true",
                   help="also report each process's CPU per placement in every cell (/proc user + system time of "
                        "its process tree from the cell's start to its end: control planes, redis-server, the data "
                        "planes together); use --seconds >= 5 (the clock tick is 10 ms)")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="directory for scaleout.{json,md,png}")
    p.add_argument("--driver", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    from omni_runtime import install_fast_loop

    install_fast_loop()
    if args.driver:
        asyncio.run(driver_main(args.driver, args.ready_file))
        return 0
    if "memory" not in args.stores:
        p.error("--stores needs memory: the ratios are to it")
    command = "python bench/scaleout.py " + " ".join(sys.argv[1:])
    result: dict[str, Any] = {"command": command.strip(), "host": f"{platform.machine()}, {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}", "loadavg": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
              "args": {k: v for k, v in vars(args).items() if k not in ("driver", "ready_file", "out")}}
    try:
        import subprocess
        from tests.redis_fixtures import REDIS_SERVER
        result["redis_version"] = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True,
                                                 timeout=10).stdout.split("v=")[1].split()[0]
    except Exception:  # noqa: BLE001 - a label only
        pass
    t0 = time.time()
    result.update(asyncio.run(run(args)))
    result["wall_s"] = round(time.time() - t0, 1)
    summary = result["summary"] = summarize(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaleout.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result, summary)
    md_path = out / "scaleout.md"
    old = md_path.read_text() if md_path.exists() else ""
    if NOTES_MARK in old:   # hand-written analysis below the mark survives a rerun
        md = md + "\n" + old[old.index(NOTES_MARK):]
    md_path.write_text(md)
    try:
        plot(summary, out / "scaleout.png")
    except Exception as exc:  # noqa: BLE001 - the plot is a convenience
        log(f"plot failed: {exc}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
