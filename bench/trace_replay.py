"""Replay the Mooncake trace against simulated engines and compare placement policies.

    python bench/trace_replay.py --start 3600 --requests 300 --speedup 5

Each trace row has an arrival time (ms), an input length, an output length and
``hash_ids``: one id per 512-token block, equal ids meaning equal content. Every id becomes
512 deterministic token ids, so requests that share ids share prefixes exactly as the
trace intends, and the simulators' prefix caches (vLLM block hashes) see the same reuse.

For every policy a fresh system is started: N aggregated simulators with a prefix cache
and ZMQ KV events, a control plane (following those events) and a data plane. Requests
are sent open-loop at the trace's times divided by --speedup, as streaming completions
with token-id prompts. Reported per policy: the engines' prefix-cache hit rate (from the
simulators' own counters), the router's predicted hit rate, TTFT p50/p90, and output
throughput. Bounded by --requests and --max-seconds per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.tracedata import (TraceMissing, load_rows, prompt_for, resolve_trace,  # noqa: E402
                             sim_counters)
from omni_proxy.launcher import ProcessGroup  # noqa: E402
from omni_proxy.loadgen import send  # noqa: E402


async def replay(dp_url: str, rows: list[dict], speedup: float, max_seconds: float, max_output: int) -> dict:
    results = []
    start = time.perf_counter()
    t0 = rows[0]["timestamp"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max_seconds)) as session:
        async def one(row: dict) -> None:
            delay = (row["timestamp"] - t0) / 1000 / speedup - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)   # open-loop arrivals at trace time (not a wait for a condition)
            body = {"model": "sim-model", "prompt": prompt_for(row), "stream": True,
                    "max_tokens": max(1, min(row["output_length"], max_output))}
            results.append(await send(session, dp_url + "/v1/completions", body))

        await asyncio.wait_for(asyncio.gather(*(one(r) for r in rows)), max_seconds)
    wall = time.perf_counter() - start
    ok = [r for r in results if not r.error]
    ttfts = sorted(r.ttft_s * 1000 for r in ok)
    return {"sent": len(results), "ok": len(ok),
            "ttft_p50_ms": round(ttfts[len(ttfts) // 2], 1) if ttfts else None,
            "ttft_p90_ms": round(ttfts[int(len(ttfts) * 0.9)], 1) if ttfts else None,
            "tokens_per_s": round(sum(r.completion_tokens for r in ok) / wall, 1), "wall_s": round(wall, 1)}


def run_policy(policy: str, rows: list[dict], args) -> dict:
    with ProcessGroup() as group:
        sims, specs = [], []
        for i in range(args.workers):
            # The sim binds free ports for its KV events itself and reports them in its ready
            # file: no port is picked here and lost to another process before the sim binds it.
            sim = group.start(f"sim-{i}", [
                "sim", "--port", "0", "--block-size", str(args.block_size), "--max-model-len", "262144",
                "--num-gpu-blocks", str(args.gpu_blocks), "--prefill-ms-per-token", str(args.prefill_ms_per_token),
                "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"],
                env={"PYTHONHASHSEED": "0"})
            sims.append(sim)
            specs += ["--worker", f"{sim.url},id=sim-{i},kv_events=tcp://127.0.0.1:{sim.info['kv_events_port']},"
                                  f"kv_replay=tcp://127.0.0.1:{sim.info['kv_replay_port']}"]
        cfg = group.workdir / "cp.toml"
        cfg.write_text(f'[kv_cache]\nblock_size = {args.block_size}\nhash_algo = "sha256"\nhash_seed = "0"\n')
        cp = group.start("controlplane", ["controlplane", "--config", str(cfg), "--listen", "127.0.0.1:0",
                                          "--http-port", "0", "--policy", policy, "--log-level", "WARNING", *specs])
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                       "--log-level", "WARNING", "--read-timeout", "120"])

        async def measure() -> dict:
            async with aiohttp.ClientSession() as s:
                h0, q0 = await sim_counters(s, [x.url for x in sims])
            out = await replay(dp.url, rows, args.speedup, args.max_seconds, args.max_output)
            async with aiohttp.ClientSession() as s:
                h1, q1 = await sim_counters(s, [x.url for x in sims])
                async with s.get(f"http://127.0.0.1:{cp.info['http_port']}/metrics") as r:
                    text = await r.text()
            pred = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                       if ln.startswith("omni_kv_predicted_hit_blocks_total"))
            query = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                        if ln.startswith("omni_kv_query_blocks_total"))
            out["engine_hit_rate"] = round((h1 - h0) / max(q1 - q0, 1), 3)
            out["predicted_hit_rate"] = round(pred / query, 3) if query else None
            return out

        return asyncio.run(measure())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=None,
                   help="the Mooncake trace (default: shared/traces/ in or next to the repository root)")
    p.add_argument("--start", type=int, default=3600, help="first trace row (reuse grows along the trace)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--speedup", type=float, default=40.0, help="trace time / replay time")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policies", default="round_robin,least_load,cache_aware,apc_first")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=40000, help="per simulator: KV pool size in blocks")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.02)
    p.add_argument("--max-output", type=int, default=64, help="cap on output tokens per request")
    p.add_argument("--max-seconds", type=float, default=300.0, help="per policy")
    args = p.parse_args()
    try:
        trace = resolve_trace(args.trace)
    except TraceMissing as exc:
        p.error(str(exc))
    rows = load_rows(trace, args.start, args.requests)
    if not rows:
        p.error(f"no rows in {trace} from row {args.start}")
    table = {}
    for policy in args.policies.split(","):
        table[policy] = run_policy(policy, rows, args)
        print(policy, json.dumps(table[policy]), flush=True)
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
