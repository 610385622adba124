"""Data-plane added latency at concurrency 1: direct to the engine vs through omni-proxy.

    python bench/overhead.py --requests 300

Starts one aggregated engine simulator, a control plane and a data plane (separate
processes, loopback), then alternates identical requests sent directly to the engine and
through the data plane, so both see the same machine noise. Reports p50/p90 of each and
the median of paired differences: non-streaming total latency, and streaming time to
first byte. Bounded by --requests and --max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni_proxy.launcher import ProcessGroup  # noqa: E402
from omni_proxy.loadgen import send  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(direct: str, proxied: str, *, requests: int, max_tokens: int, max_seconds: float) -> dict:
    out: dict[str, dict] = {}
    deadline = time.monotonic() + max_seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for mode, stream in (("non_streaming_latency_ms", False), ("streaming_ttfb_ms", True)):
            body = {"model": "sim-model", "prompt": "measure the proxy overhead", "max_tokens": max_tokens,
                    "stream": stream}
            d_vals, p_vals = [], []
            for i in range(requests + 10):
                if time.monotonic() > deadline:
                    break
                order = [(direct, d_vals), (proxied, p_vals)]
                if i % 2:
                    order.reverse()  # alternate who goes first
                for base, bucket in order:
                    r = await send(session, base + "/v1/completions", body)
                    if r.error:
                        raise SystemExit(f"request failed: {r.error}")
                    if i >= 10:  # warm-up: connection pools, caches
                        bucket.append((r.ttft_s if stream else r.latency_s) * 1000)
            diffs = [p - d for p, d in zip(p_vals, d_vals)]
            out[mode] = {
                "n": len(d_vals),
                "direct_p50": round(pct(d_vals, 0.5), 3), "direct_p90": round(pct(d_vals, 0.9), 3),
                "proxied_p50": round(pct(p_vals, 0.5), 3), "proxied_p90": round(pct(p_vals, 0.9), 3),
                "added_median": round(statistics.median(diffs), 3),
                "ratio_p50": round(pct(p_vals, 0.5) / pct(d_vals, 0.5), 3),
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=240)
    args = p.parse_args()
    with ProcessGroup() as group:
        sim = group.start("sim", ["sim", "--role", "both", "--port", "0"])
        cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                          "--worker", sim.url, "--log-level", "WARNING"])
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                       "--log-level", "WARNING"])
        result = asyncio.run(measure(sim.url, dp.url, requests=args.requests, max_tokens=args.max_tokens,
                                     max_seconds=args.max_seconds))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
