"""Phase-aligned DP dispatch against per-rank dispatch, on a DP engine whose ranks step together.

    python bench/dp_phase.py --rates 3,5,7,9 --repeats 2 --seconds 25 \
        --out docs/benchmarks/dp_phase.md

One simulated engine with ``--dp-size`` ranks and the DP barrier on (a step lasts as long
as the slowest rank's, as with DP attention before MoE layers: ``simulator/dp_barrier.py``),
behind our control plane and one data plane, serves a seeded open-loop mix of long prompts
(prefill-heavy, short answers: documents, RAG) and chat turns (short prompts, longer
answers, the decodes a long prefill holds). Targets, interleaved per rate and repeat:

* ``balance``: the default DP-rank rule (deepest match, fewest requests, tokens, turn);
* ``rank``: a profile with ``dp_rank = "phase_aligned"`` (the rank where the prompt's
  prefill ends the engine's prefill phase soonest: beside a prefill under way, not behind);
* ``window``: the same plus the ``phase_window`` queue stage: a long prompt for an engine
  with no prefill under way waits up to ``--window-s`` for others, to be dispatched together;
* ``free`` (optional): ``balance`` on an engine without the barrier (independent ranks),
  which shows what the barrier itself costs.

All use the ``predicted_latency`` scorer's worker choice without the default's queue stage
(``predicted_latency_unqueued``: one engine, so the choice only decides the rank, and the
``omni`` queue would hold prompts for reasons of its own) and, as that policy, no ``slo``
filter. Per run: SLO attainment (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms; a
failed request misses), output tokens per second over the run (first send to last
answer), TTFT / chat TPOT percentiles, and the engine's barrier counters (``/sim/state``'s
``dp_barrier``): the share of steps that were mixed (a rank prefilling while another only
decodes) and the rank-seconds ranks with work waited at the barrier. Model time is real
time here (no scaling), so keep rates within what the machine's cores can stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.slo_replay import Outcome, _pct, open_loop, send_router  # noqa: E402
from bench.tracedata import sim_state  # noqa: E402
from omni_proxy.launcher import ProcessGroup  # noqa: E402

TARGETS = ("balance", "rank", "window", "free")
PROFILES = """
[profiles.rank]
scorers = [{name = "predicted_latency"}]
picker = "near_best"
dp_rank = "phase_aligned"

[profiles.window]
scorers = [{name = "predicted_latency"}]
picker = "near_best"
dp_rank = "phase_aligned"
queue = {name = "phase_window", window_s = %(window_s)s, min_tokens = %(min_tokens)s}
"""


@dataclass(frozen=True)
class Request:
    at: float            # seconds after the start
    prompt: list[int]
    max_tokens: int
    long: bool


def workload(rate: float, seconds: float, long_share: float, seed: int) -> list[Request]:
    """Poisson arrivals at ``rate`` for ``seconds``: a ``long_share`` of long prompts
    (4000-8000 tokens, 16-token answers), the rest chat turns (100-400 tokens, 32-64-token
    answers). Distinct random token ids, so no prefix cache hit blurs the prefill cost."""
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        long = rng.random() < long_share
        n = rng.randint(4000, 8000) if long else rng.randint(100, 400)
        out.append(Request(t, [rng.randrange(1000, 30000) for _ in range(n)],
                           16 if long else rng.randint(32, 64), long))


def sim_args(args, barrier: bool) -> list[str]:
    return ["sim", "--host", "127.0.0.1", "--port", "0", "--dp-size", str(args.dp_size),
            "--dp-barrier" if barrier else "--no-dp-barrier",
            "--prefill-ms-per-token", str(args.prefill_ms_per_token), "--decode-ms-per-step",
            str(args.decode_ms_per_step), "--decode-ms-per-seq", str(args.decode_ms_per_seq),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", "64",
            "--max-model-len", "16384", "--num-gpu-blocks", "8192", "--tokenize-us-per-char", "0"]


async def _run(url: str, sim_url: str, reqs: list[Request], args) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.seconds * 4 + 60, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        bodies = [{"prompt": [r.prompt], "max_tokens": r.max_tokens, "stream": True, "ignore_eos": True}
                  for r in reqs]

        async def send(i: int) -> Outcome:
            return await send_router(session, url, bodies[i], i)

        outcomes, wall = await open_loop([r.at for r in reqs], send, args.seconds * 4 + 30)
        state = await sim_state(session, sim_url)
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    met = [o.ok and o.ttft is not None and o.ttft <= slo_ttft and (o.tpot is None or o.tpot <= slo_tpot)
           for o in outcomes]
    by_idx = {o.idx: o for o in outcomes}
    chat = [by_idx[i] for i, r in enumerate(reqs) if not r.long]
    barrier = state.get("dp_barrier") or {}
    return {
        "requests": len(reqs),
        "errors": sum(1 for o in outcomes if not o.ok),
        "slo": 100.0 * sum(met) / max(1, len(met)),
        "tok_s": sum(o.tokens for o in outcomes) / wall,
        "ttft_p50_ms": 1000 * (_pct([o.ttft for o in outcomes if o.ttft is not None], 0.5) or 0),
        "ttft_p90_ms": 1000 * (_pct([o.ttft for o in outcomes if o.ttft is not None], 0.9) or 0),
        "chat_ttft_p90_ms": 1000 * (_pct([o.ttft for o in chat if o.ttft is not None], 0.9) or 0),
        "long_ttft_p90_ms": 1000 * (_pct([t for i, r in enumerate(reqs)
                                          if r.long and (t := by_idx[i].ttft) is not None], 0.9) or 0),
        "chat_tpot_p50_ms": 1000 * (_pct([o.tpot for o in chat if o.tpot is not None], 0.5) or 0),
        "chat_tpot_p90_ms": 1000 * (_pct([o.tpot for o in chat if o.tpot is not None], 0.9) or 0),
        "mixed_share": 100.0 * barrier.get("mixed_steps", 0) / max(1, barrier.get("steps", 0)),
        "held_rank_s": barrier.get("held_rank_s", 0.0),
        "prefill_steps": barrier.get("prefill_steps", 0),
        "prefill_phases": barrier.get("prefill_phases", 0),
        "prefill_share": 100.0 * barrier.get("prefill_s", 0.0) / max(1e-9, wall),
        "ranks_per_prefill_step": barrier.get("prefill_rank_steps", 0) / max(1, barrier.get("prefill_steps", 0)),
        "ranks_prefilling_by_time": barrier.get("prefill_work_s", 0.0) / max(1e-9, barrier.get("prefill_s", 0.0)),
        "group_busy_s": barrier.get("busy_s", 0.0),
        "wall_s": wall,
    }


def run_once(target: str, reqs: list[Request], args) -> dict:
    with ProcessGroup() as group:
        sim = group.start("sim", sim_args(args, barrier=target != "free"))
        cfg = group.workdir / "cp.toml"
        cfg.write_text(PROFILES % {"window_s": args.window_s, "min_tokens": args.min_tokens})
        cp = group.start("controlplane", [
            "controlplane", "--config", str(cfg), "--listen", "127.0.0.1:0", "--http-host", "127.0.0.1",
            "--http-port", "0", "--policy", target if target in ("rank", "window") else "predicted_latency_unqueued",
            "--log-level", "WARNING", "--worker", f"{sim.url},role=both,id=sim,dp_size={args.dp_size}"])
        dp = group.start("dataplane", ["dataplane", "--host", "127.0.0.1", "--port", "0", "--controlplane",
                                       cp.address, "--log-level", "WARNING", "--read-timeout", "600"])
        return asyncio.run(_run(dp.url, sim.url, reqs, args))


def aggregate(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: statistics.fmean(r[k] for r in runs) for k in keys} | {"n": len(runs),
                                                                     "slo_runs": [r["slo"] for r in runs]}


def write_markdown(path: Path, report: dict) -> None:
    a = report["args"]
    lines = [
        "# Phase-aligned DP dispatch (bench/dp_phase.py)", "",
        f"Command: `{report['command']}`", "",
        f"One simulated engine, dp_size {a['dp_size']}, prefill {a['prefill_ms_per_token']} ms/token, "
        f"decode step {a['decode_ms_per_step']} ms + {a['decode_ms_per_seq']} ms/sequence, "
        f"{a['max_num_batched_tokens']}-token step budget per rank; {100 * a['long_share']:.0f} % long prompts "
        f"(4000-8000 tokens, 16-token answers), the rest chat (100-400 tokens, 32-64-token answers); "
        f"Poisson arrivals for {a['seconds']} s per run, seed {a['seed']} (the same requests for every target "
        f"at a rate). SLO: TTFT <= {a['slo_ttft_ms']} ms and TPOT <= {a['slo_tpot_ms']} ms. "
        f"{a['repeats']} interleaved repeats; attainment per run in brackets.", "",
        "| rate (req/s) | target | SLO % | output tok/s | TTFT p50 / p90 ms | chat TPOT p50 / p90 ms "
        "| prefill phases | time in prefill steps % | ranks prefilling per prefill step (by steps / by time) "
        "| rank-s held at the barrier | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        s = row["stats"]
        lines.append(
            f"| {row['rate']:g} | {row['target']} | {s['slo']:.1f} ({', '.join(f'{x:.1f}' for x in s['slo_runs'])}) "
            f"| {s['tok_s']:.0f} | {s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f} "
            f"| {s['chat_tpot_p50_ms']:.1f} / {s['chat_tpot_p90_ms']:.1f} | {s['prefill_phases']:.0f} "
            f"| {s['prefill_share']:.1f} | {s['ranks_per_prefill_step']:.2f} / "
            f"{s.get('ranks_prefilling_by_time', 0):.2f} "
            f"| {s['held_rank_s']:.1f} | {s['errors']:.1f} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    marker = "<!-- results -->"
    table = "\n".join(lines) + "\n"
    if marker in text:   # keep the analysis written below the marker
        text = table + "\n" + marker + text.split(marker, 1)[1]
    else:
        text = table
    path.write_text(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="3,5,7,9", help="request rates to sweep, req/s")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seconds", type=float, default=25.0, help="arrival window per run")
    p.add_argument("--window-s", type=float, default=0.3, help="the window target's phase_window.window_s")
    p.add_argument("--min-tokens", type=int, default=2048, help="the window target's phase_window.min_tokens")
    p.add_argument("--targets", default="balance,rank,window", help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--dp-size", type=int, default=4)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    p.add_argument("--decode-ms-per-step", type=float, default=10.0)
    p.add_argument("--decode-ms-per-seq", type=float, default=0.1)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=40.0)
    p.add_argument("--out", type=Path, help="markdown table (its text below '<!-- results -->' is kept)")
    p.add_argument("--json", type=Path, help="raw results")
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        p.error(f"--targets: each of {', '.join(TARGETS)}, got {args.targets!r}")
    args.target_list = targets
    args.rate_list = [float(x) for x in args.rates.split(",") if x.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs: dict[tuple[float, str], list[dict]] = {}
    for rate in args.rate_list:
        reqs = workload(rate, args.seconds, args.long_share, args.seed)
        for rep in range(args.repeats):
            for target in args.target_list:
                t0 = time.monotonic()
                res = run_once(target, reqs, args)
                runs.setdefault((rate, target), []).append(res)
                print(f"rate {rate:g} rep {rep} {target}: SLO {res['slo']:.1f} % tok/s {res['tok_s']:.0f} "
                      f"chat TPOT p90 {res['chat_tpot_p90_ms']:.1f} ms TTFT p90 chat {res['chat_ttft_p90_ms']:.0f} "
                      f"long {res['long_ttft_p90_ms']:.0f} ms "
                      f"phases {res['prefill_phases']} in prefill {res['prefill_share']:.1f} % "
                      f"x{res['ranks_per_prefill_step']:.2f}/{res['ranks_prefilling_by_time']:.2f} "
                      f"held {res['held_rank_s']:.1f} rank-s "
                      f"errors {res['errors']} ({time.monotonic() - t0:.0f} s)", flush=True)
    report = {"command": "python bench/dp_phase.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
              "rows": [{"rate": r, "target": t, "stats": aggregate(v), "runs": v} for (r, t), v in runs.items()]}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.out:
        write_markdown(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
