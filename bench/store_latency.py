"""Benchmark: what the state store costs one placement, MemoryStore vs RedisStore.

Issue 10's goal: "the Redis store costs at most 1.5x the in-memory placement latency at
p99". Measured here, in process, on uvloop, against a real redis-server on loopback (TCP
127.0.0.1 and a unix socket; no persistence, as a cache-only Redis; ``--appendonly``
turns on ``appendonly yes, appendfsync everysec``):

* **store calls**: the calls one placement and its end make, one after another:
  ``loads`` of 16 candidates (16 HMGETs in one write: one round trip), ``reserve`` (one Lua
  script), ``end`` (one Lua script); p50/p99 of loads+reserve (what the placement waits
  for) and of all three. ``redis-tcp-mirror`` is the Redis store with
  ``loads_max_age_s = 0.05``: loads from this replica's copy (refreshed at most every 50 ms,
  and from every reserve/end reply), so a placement makes one round trip, not two;
  ``redis-tcp-mirror-wb`` adds ``write_behind = true``: the reserve is sent without waiting
  for its reply, so a placement makes no round trip (the end still waits for its);
* **placement**: ``Placer.place`` (policy least_load, 16 aggregated workers, no prefix
  chain), the whole pipeline, with each store; then ``end``;
* **throughput**: 32 placements' store calls in flight at once (loads+reserve+end per
  placement): cycles per second;
* **gRPC Place**: what a data plane waits for. A real ``ControlPlane`` (gRPC server) with
  each store and a data plane's ``PlacementClient``, both in this process (one event loop,
  so client work counts too), 16 healthy workers, the FINISHED report sent after each
  answer as a data plane does: p50/p99 of ``place()``.

The configurations run in interleaved rounds (each once per round), so a noisy neighbour
slows all alike. Bounded: fixed counts, well under a minute. Usage::

    python bench/store_latency.py [--rounds 5] [--count 2000] [--appendonly] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.fleet import Fleet  # noqa: E402
from controlplane.placement import Placer  # noqa: E402
from controlplane.scheduling import build_profile  # noqa: E402
from controlplane.state import Charge, MemoryStore, RequestRecord  # noqa: E402
from controlplane.state.redis import RedisStore  # noqa: E402
from controlplane.workers import Health, HealthState, Role, WorkerSpec  # noqa: E402
from protos import omni_proxy_pb2 as pb  # noqa: E402
from tests.redis_fixtures import RedisServer  # noqa: E402

CANDIDATES = 16
CONCURRENCY = 32
GOAL_RATIO = 1.5
MIRROR_AGE_S = 0.05   # [state] loads_max_age_s for the "-mirror" configuration


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000   # ns -> us


class RpcBench:
    """A control plane on ``store`` and a PlacementClient on its gRPC port."""

    def __init__(self, name: str, store) -> None:
        self.name, self.store = name, store
        self.samples: list[int] = []
        self.seq = 0

    async def start(self) -> None:
        from controlplane.config import ControlPlaneConfig
        from controlplane.server import ControlPlane
        from dataplane.placement_client import PlacementClient

        config = ControlPlaneConfig(listen="127.0.0.1:0")
        config.health.interval_s = 3600.0      # the workers are fake: never checked after start
        config.health.poll_metrics = False
        self.plane = ControlPlane(config, store=self.store)
        await self.plane.start()
        for i in range(CANDIDATES):
            spec = WorkerSpec(id=f"w{i:02d}", url=f"http://10.0.0.{i + 1}:8000", role=Role.BOTH, model="m")
            await self.store.put_spec(spec)
            self.plane.fleet.put(spec)
            self.plane.fleet.set_state(spec.id, HealthState(health=Health.HEALTHY))
        self.client = PlacementClient(f"127.0.0.1:{self.plane.grpc_port}", f"bench-{self.name}", timeout_s=10.0)
        await self.client.start()
        if not await self.client.wait_connected(10):
            raise RuntimeError("the placement client did not connect")

    async def one(self, measure: bool) -> None:
        self.seq += 1
        rid = f"rpc-{self.name}-{self.seq}"
        req = pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=512, max_tokens=128)
        t0 = time.perf_counter_ns()
        out = await self.client.place(req)
        dt = time.perf_counter_ns() - t0
        if out.error:
            raise RuntimeError(f"{self.name}: placement failed: {out.error_message}")
        self.client.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED, worker_id=out.decode.worker_id))
        if measure:
            self.samples.append(dt)

    async def stop(self) -> None:
        await self.client.close()
        await self.plane.stop()


class Config:
    def __init__(self, name: str, store) -> None:
        self.name = name
        self.store = store
        self.fleet = Fleet()
        self.placer: Placer | None = None
        self.ids = [f"w{i:02d}" for i in range(CANDIDATES)]
        self.seq = 0
        self.samples: dict[str, list[int]] = {k: [] for k in ("loads", "reserve", "end", "placement_calls",
                                                               "all_calls", "place", "place_end")}
        self.rates: list[float] = []

    async def setup(self) -> None:
        for wid in self.ids:
            spec = WorkerSpec(id=wid, url=f"http://10.0.0.{int(wid[1:]) + 1}:8000", role=Role.BOTH, model="m")
            await self.store.put_spec(spec)
            self.fleet.put(spec)
            self.fleet.set_state(wid, HealthState(health=Health.HEALTHY))
        self.placer = Placer(self.store, self.fleet, build_profile("least_load"))

    def rid(self) -> str:
        self.seq += 1
        return f"{self.name}-{self.seq}"

    async def store_cycle(self, measure: bool) -> None:
        store, s = self.store, self.samples
        rid = self.rid()
        now = time.monotonic()
        t0 = time.perf_counter_ns()
        loads = await store.loads(self.ids)
        t1 = time.perf_counter_ns()
        wid = min(self.ids, key=lambda w: loads[w].requests)
        await store.reserve(RequestRecord(request_id=rid, model="m", prompt_tokens=512, max_tokens=128,
                                          session="s1", created_at=now, placed_at=now),
                            (Charge(wid, "aggregated", 640, 512),), work_ahead_tokens=512, decode_batch=1)
        t2 = time.perf_counter_ns()
        await store.end(rid)
        t3 = time.perf_counter_ns()
        if measure:
            s["loads"].append(t1 - t0)
            s["reserve"].append(t2 - t1)
            s["end"].append(t3 - t2)
            s["placement_calls"].append(t2 - t0)
            s["all_calls"].append(t3 - t0)

    async def place_cycle(self, measure: bool) -> None:
        rid = self.rid()
        req = pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=512, max_tokens=128)
        placer = self.placer
        assert placer is not None   # made by start()
        t0 = time.perf_counter_ns()
        out = await placer.place(req, "s1")
        t1 = time.perf_counter_ns()
        if out is None or out.error:
            raise RuntimeError(f"{self.name}: placement failed: {out}")
        await self.store.end(rid)
        t2 = time.perf_counter_ns()
        if measure:
            self.samples["place"].append(t1 - t0)
            self.samples["place_end"].append(t2 - t0)

    async def throughput(self, count: int) -> float:
        per = count // CONCURRENCY

        async def worker() -> None:
            for _ in range(per):
                await self.store_cycle(measure=False)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return per * CONCURRENCY / (time.perf_counter() - t0)


def summary(c: Config) -> dict:
    out: dict[str, Any] = {}
    for key, xs in c.samples.items():
        out[key] = {"p50_us": round(pct(xs, 0.5), 2), "p99_us": round(pct(xs, 0.99), 2),
                    "mean_us": round(statistics.fmean(xs) / 1000, 2), "n": len(xs)}
    out["throughput_cycles_per_s"] = round(statistics.median(c.rates))
    out["throughput_spread"] = [round(min(c.rates)), round(max(c.rates))]
    return out


def markdown(result: dict) -> str:
    res = result["results"]
    names = list(res)
    mem = res["memory"]
    lines = [
        "# State store latency: MemoryStore vs RedisStore",
        "",
        f"`python bench/store_latency.py --rounds {result['rounds']} --count {result['count']}"
        f"{' --appendonly' if result['appendonly'] else ''}` on {result['machine']} "
        f"(Python {result['python']}, uvloop, redis-server {result['redis_version']}, "
        f"{'appendonly everysec' if result['appendonly'] else 'no persistence'}). "
        f"{result['rounds']} interleaved rounds x {result['count']} placements per configuration; "
        f"16 candidate workers; all on one shared machine (load average {result['loadavg']}), so absolute "
        "numbers are noisy; ratios are what to read.",
        "",
        "## One placement's store calls (sequential)",
        "",
        "| store | loads(16) p50 / p99 | reserve p50 / p99 | end p50 / p99 | **loads+reserve p50 / p99** "
        "| loads+reserve+end p50 / p99 | p99 vs memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in names:
        r = res[n]
        lines.append(f"| {n} | {r['loads']['p50_us']:.1f} / {r['loads']['p99_us']:.1f} us "
                     f"| {r['reserve']['p50_us']:.1f} / {r['reserve']['p99_us']:.1f} us "
                     f"| {r['end']['p50_us']:.1f} / {r['end']['p99_us']:.1f} us "
                     f"| **{r['placement_calls']['p50_us']:.1f} / {r['placement_calls']['p99_us']:.1f} us** "
                     f"| {r['all_calls']['p50_us']:.1f} / {r['all_calls']['p99_us']:.1f} us "
                     f"| {r['placement_calls']['p99_us'] / mem['placement_calls']['p99_us']:.1f}x |")
    lines += [
        "",
        "## The whole placement (`Placer.place`, least_load, 16 workers) with each store",
        "",
        "| store | place p50 / p99 | place+end p50 / p99 | **place p99 vs memory** (goal <= 1.5x) "
        f"| store cycles/s, {CONCURRENCY} in flight |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        r = res[n]
        ratio = r["place"]["p99_us"] / mem["place"]["p99_us"]
        lines.append(f"| {n} | {r['place']['p50_us']:.1f} / {r['place']['p99_us']:.1f} us "
                     f"| {r['place_end']['p50_us']:.1f} / {r['place_end']['p99_us']:.1f} us "
                     f"| **{ratio:.1f}x** | {r['throughput_cycles_per_s']:,} "
                     f"({r['throughput_spread'][0]:,}-{r['throughput_spread'][1]:,}) |")
    if "rpc" in result:
        rpc = result["rpc"]
        lines += [
            "",
            "## gRPC Place as a data plane sees it (control plane + PlacementClient in one process)",
            "",
            "| store | Place p50 / p99 | **p99 vs memory** (goal <= 1.5x) |",
            "|---|---|---|",
        ]
        for n, r in rpc.items():
            lines.append(f"| {n} | {r['p50_us']:.0f} / {r['p99_us']:.0f} us "
                         f"| **{r['p99_us'] / rpc['memory']['p99_us']:.2f}x** |")
    lines += ["", "## Reading", ""] + [f"* {line}" for line in result["reading"]]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> dict:
    servers = [RedisServer(tcp=True), RedisServer()]
    for s in servers:
        s.appendonly = args.appendonly
        s.start()
    try:
        if args.appendonly:   # everysec, as production would run it (the fixture uses "always")
            for s in servers:
                probe = RedisStore(s.url, key_prefix="bench:")
                await probe.redis.config_set("appendfsync", "everysec")
                await probe.close()
        configs = [Config("memory", MemoryStore()),
                   Config("redis-tcp", RedisStore(servers[0].url, key_prefix="bench:")),
                   Config("redis-unix", RedisStore(servers[1].url, key_prefix="bench:")),
                   Config("redis-tcp-mirror", RedisStore(servers[0].url, key_prefix="bench-m:",
                                                         loads_max_age_s=MIRROR_AGE_S)),
                   Config("redis-tcp-mirror-wb", RedisStore(servers[0].url, key_prefix="bench-w:",
                                                            loads_max_age_s=MIRROR_AGE_S, write_behind=True))]
        info = await configs[1].store.redis.info("server")
        for c in configs:
            await c.setup()
            for _ in range(300):   # warm: connections, scripts loaded, caches
                await c.store_cycle(measure=False)
                await c.place_cycle(measure=False)
        for r in range(args.rounds):
            for c in configs:
                gc.collect()
                for _ in range(args.count):
                    await c.store_cycle(measure=True)
                for _ in range(args.count):
                    await c.place_cycle(measure=True)
                c.rates.append(await c.throughput(args.count))
                log(f"round {r + 1}/{args.rounds} {c.name}: store calls p50 "
                    f"{pct(c.samples['placement_calls'], 0.5):.1f} us, "
                    f"place p99 {pct(c.samples['place'], 0.99):.1f} us, "
                    f"{c.rates[-1]:,.0f} cycles/s")
        results = {c.name: summary(c) for c in configs}
        for c in configs[1:]:
            await c.store.close()

        rpcs = [RpcBench("memory", MemoryStore()),
                RpcBench("redis-tcp", RedisStore(servers[0].url, key_prefix="rpc:")),
                RpcBench("redis-unix", RedisStore(servers[1].url, key_prefix="rpc:")),
                RpcBench("redis-tcp-mirror", RedisStore(servers[0].url, key_prefix="rpc-m:",
                                                        loads_max_age_s=MIRROR_AGE_S)),
                RpcBench("redis-tcp-mirror-wb", RedisStore(servers[0].url, key_prefix="rpc-w:",
                                                           loads_max_age_s=MIRROR_AGE_S, write_behind=True))]
        for b in rpcs:
            await b.start()
        try:
            for b in rpcs:
                for _ in range(300):
                    await b.one(measure=False)
            for r in range(args.rounds):
                for b in rpcs:
                    gc.collect()
                    for _ in range(args.count):
                        await b.one(measure=True)
                    log(f"round {r + 1}/{args.rounds} gRPC {b.name}: Place p50 {pct(b.samples, 0.5):.0f} us, "
                        f"p99 {pct(b.samples, 0.99):.0f} us")
        finally:
            for b in rpcs:
                await b.stop()
                if isinstance(b.store, RedisStore):
                    await b.store.close()
        rpc = {b.name: {"p50_us": round(pct(b.samples, 0.5), 1), "p99_us": round(pct(b.samples, 0.99), 1),
                        "n": len(b.samples)} for b in rpcs}
        rpc_ratio = rpc["redis-tcp"]["p99_us"] / rpc["memory"]["p99_us"]
        mem, tcp, mir = results["memory"], results["redis-tcp"], results["redis-tcp-mirror"]
        ratio = tcp["place"]["p99_us"] / mem["place"]["p99_us"]
        rpc_mirror_ratio = rpc["redis-tcp-mirror"]["p99_us"] / rpc["memory"]["p99_us"]
        rpc_wb_ratio = rpc["redis-tcp-mirror-wb"]["p99_us"] / rpc["memory"]["p99_us"]
        reading = [
            f"Redis adds two loopback round trips to a placement (16 HMGETs in one write, then the reserve "
            f"script): loads+reserve p50 {tcp['placement_calls']['p50_us']:.0f} us over TCP vs "
            f"{mem['placement_calls']['p50_us']:.1f} us in memory, where no call suspends. With the load mirror "
            f"it is one round trip: {mir['placement_calls']['p50_us']:.0f} us p50, "
            f"{mir['placement_calls']['p99_us']:.0f} us p99.",
            f"Whole placement p99: {tcp['place']['p99_us']:.0f} us with Redis (TCP) vs {mem['place']['p99_us']:.0f} us "
            f"in memory = {ratio:.1f}x: the 1.5x goal is "
            + ("met" if ratio <= GOAL_RATIO else "NOT met at this level") + ". "
            + ("" if ratio <= GOAL_RATIO else
               "In-process placement is a few tens of microseconds, so any network store multiplies it; "
               "where a data plane sees it (gRPC Place), the same absolute cost is a smaller factor (below)."),
            f"Where a data plane sees it (gRPC Place, client and control plane in one process): p99 "
            f"{rpc['redis-tcp']['p99_us']:.0f} us with Redis (TCP) vs {rpc['memory']['p99_us']:.0f} us in memory = "
            f"{rpc_ratio:.2f}x: the goal is " + ("met" if rpc_ratio <= GOAL_RATIO else "NOT met")
            + f"; with the load mirror {rpc['redis-tcp-mirror']['p99_us']:.0f} us = {rpc_mirror_ratio:.2f}x: "
            + ("met" if rpc_mirror_ratio <= GOAL_RATIO else "NOT met")
            + f"; with mirror and write-behind {rpc['redis-tcp-mirror-wb']['p99_us']:.0f} us = {rpc_wb_ratio:.2f}x: "
            + ("met." if rpc_wb_ratio <= GOAL_RATIO else "NOT met."),
            "A unix socket saves a little per round trip over loopback TCP when Redis runs on the same host.",
            "The load mirror and write-behind remove round trips from the placement itself (in-process placement "
            f"p99 {mir['place']['p99_us']:.0f} and {results['redis-tcp-mirror-wb']['place']['p99_us']:.0f} us vs "
            f"{tcp['place']['p99_us']:.0f} us), but at the gRPC level the control plane still makes one round trip "
            "per request for its end report on the same event loop, and this machine's scheduling noise decides "
            "the p99: compare the p50s there.",
            "Absolute numbers are from a shared 2-CPU sandbox where one redis-py round trip costs ~70 us of CPU "
            "and a raw socket PING ~20 us; on a dedicated host every Redis figure here shrinks, the in-memory "
            "ones barely.",
            f"Throughput with {CONCURRENCY} placements in flight: {tcp['throughput_cycles_per_s']:,} store cycles/s on "
            f"Redis (TCP) vs {mem['throughput_cycles_per_s']:,} in memory: Redis round trips overlap across "
            "concurrent placements, so throughput falls far less than sequential latency rises.",
        ]
        return {"rounds": args.rounds, "count": args.count, "appendonly": args.appendonly,
                "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "python": platform.python_version(),
                "loadavg": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
                "redis_version": info.get("redis_version", "?"), "candidates": CANDIDATES,
                "concurrency": CONCURRENCY, "goal_ratio": GOAL_RATIO, "place_p99_ratio_tcp": round(ratio, 2),
                "rpc_place_p99_ratio_tcp": round(rpc_ratio, 2),
                "rpc_place_p99_ratio_tcp_mirror": round(rpc_mirror_ratio, 2),
                "rpc_place_p99_ratio_tcp_mirror_write_behind": round(rpc_wb_ratio, 2),
                "mirror_max_age_s": MIRROR_AGE_S, "results": results, "rpc": rpc, "reading": reading}
    finally:
        for s in servers:
            s.close()


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--appendonly", action="store_true", help="redis with appendonly yes, appendfsync everysec")
    p.add_argument("--out", default="docs/benchmarks", help="directory for store_latency.json and .md")
    args = p.parse_args()
    from omni_runtime import install_fast_loop

    install_fast_loop()
    result = asyncio.run(main(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_latency.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "store_latency.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    cli()
