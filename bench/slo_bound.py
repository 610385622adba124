"""An upper bound on SLO attainment for a workload shape: what no placement can beat.

    python bench/slo_bound.py --workload system_prompt --engines 2 --rates 2,3,4

The fleet's prefill capacity as one pooled server (``--engines`` engine-equivalents of
``--prefill-tok-s`` real tokens a second each: 2 for PD 2:2's prefill engines, 2.5 for the
heterogeneous fleet of 1x, 1x and 0.5x), every prompt block ever seen before already cached
(an ideal, unbounded cache shared by every engine), no decode, no KV pull, no overhead. A
request meets the SLO when its prompt is computed within ``--slo-ttft-ms`` of its arrival.
Two orders: FIFO (what every router measured here does: an engine computes prompts in the
order they reach it) and shortest-first without preemption (a queue that orders by prompt
cost). Placement decides only how close a fleet gets to the FIFO figure; beyond it, only
the order of prompts can gain (docs/benchmarks/workloads_notes.md).

Rates are multiples of the shape's default session rate, as in bench/slo_replay.py.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.workloads import BLOCK, generate  # noqa: E402


def prompt_seconds(rows: list[dict], capacity_tok_s: float) -> list[tuple[float, float]]:
    """(arrival at 1x in seconds, seconds of pooled prefill) per row, blocks seen before cached."""
    seen: set[int] = set()
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        new = 0
        for h in r["hash_ids"]:
            if h not in seen:
                seen.add(h)
                new += BLOCK
        out.append(((r["timestamp"] - t0) / 1000, new / capacity_tok_s))
    return out


def attainment(jobs: list[tuple[float, float]], rate: float, slo_s: float, shortest_first: bool) -> float:
    """Share of jobs computed within ``slo_s`` of arrival on one server, FIFO or shortest-first."""
    t, ok, i = 0.0, 0, 0
    queue: list[tuple[float, float, float]] = []
    arrivals = [(at / rate, work) for at, work in jobs]
    while i < len(arrivals) or queue:
        if not queue:
            t = max(t, arrivals[i][0])
        while i < len(arrivals) and arrivals[i][0] <= t:
            at, work = arrivals[i]
            heapq.heappush(queue, (work if shortest_first else at, at, work))
            i += 1
        _, at, work = heapq.heappop(queue)
        t += work
        ok += t - at <= slo_s
    return ok / len(arrivals)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="system_prompt", help="a bench/workloads.py shape")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=float, required=True, help="prefill capacity in engine-equivalents")
    p.add_argument("--rates", default="1", help="comma-separated multiples of the shape's rate")
    p.add_argument("--prefill-tok-s", type=float, default=20000.0, help="one engine's prefill speed, real tokens/s")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    args = p.parse_args(argv)
    if args.engines <= 0 or args.prefill_tok_s <= 0:
        p.error("--engines and --prefill-tok-s must be > 0")
    jobs = prompt_seconds(generate(args.workload, args.requests, args.seed), args.engines * args.prefill_tok_s)
    print("| rate | FIFO % | shortest-first % |\n|---|---|---|")
    for rate in (float(x) for x in args.rates.split(",") if x.strip()):
        fifo = attainment(jobs, rate, args.slo_ttft_ms / 1000, shortest_first=False)
        sjf = attainment(jobs, rate, args.slo_ttft_ms / 1000, shortest_first=True)
        print(f"| {rate:g} | {100 * fifo:.1f} | {100 * sjf:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
