"""Burst: the data plane's placement latency and event-loop stall while replaying the
Mooncake trace at its burstiest.

    python bench/burst.py --window-s 30 --speedups 1,2,4,8 --repeats 3

The trace's densest ``--window-s`` window of arrivals (most rows; bench/tracedata.py turns
rows into token-id prompts that share prefixes through ``hash_ids``, at full length) is
replayed open-loop at its own timing divided by each speedup, as streaming completions,
through one data plane and one control plane (policy ``cache_aware``, following the
engines' KV events, as the product is meant to run; the data plane at its default log
level, access log on). The engines are simulators made fast (prefill 200k tokens/s,
2 ms decode steps, output capped at ``--max-output``) so the router, not the engines, is
what is measured. Every cell (one speedup, one repeat) gets a fresh set of processes,
a short warm-up on other rows of the trace, then the window. Repeats are interleaved
(the order of speedups rotates per repeat).

Measured per cell, all from our own processes:

* placement latency per request in the data plane (block hashes computed to the control
  plane's answer: the quantity of ``omni_dp_placement_seconds``), exactly, from the data
  plane's access log (``stages_ms``), and as a cross-check from that histogram's delta;
* the control plane's own placement time (``omni_placement_seconds`` delta: decide and
  reserve, queue waits excluded);
* the data plane's event loop: ticks of its 10 ms timer, how many were over 5 ms late, and
  the longest stall (``omni_dp_event_loop_lag_*``; exact where the 10 s max tells it,
  else the bucket bound);
* requests, errors, client-side TTFT, CPU share of the data- and control-plane processes.

Targets (reported against, never asserted): placement p99 <= 2 ms under the bursts,
longest event-loop stall <= 5 ms. Writes ``--out``/``--name``.{json,md,png}. Everything
binds 127.0.0.1; bounded by ``--max-requests`` per cell and ``--max-seconds`` overall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import prom  # noqa: E402
from bench.overhead import cpu_seconds, host_line, lag_delta, loop_lag, process_tree, write_keeping_notes  # noqa: E402
from bench.slo_replay import (Cost, _group, _pct, code_from, open_loop, send_router,  # noqa: E402
                              start_engines, start_ours)
from bench.tracedata import TraceMissing, densest_window, load_rows, peak_rate, prompt_for, resolve_trace  # noqa: E402

PLACEMENT_TARGET_MS = 2.0
STALL_TARGET_MS = 5.0
WARM_ID = 1_000_000        # warm-up requests are labelled slo<WARM_ID + i>x


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- one cell ------------------------------------------------------------------------

def access_placements(log_path: Path, offset: int) -> dict[int, float]:
    """Request index -> placement wait (ms) from the data plane's access log after byte
    ``offset``: placed - matched (placed - received when no hashes were computed), the
    quantity ``omni_dp_placement_seconds`` observes."""
    out = {}
    with log_path.open("rb") as f:
        f.seek(offset)
        for line in f:
            if b" omni_proxy.access: " not in line:
                continue
            rec = orjson.loads(line.split(b" omni_proxy.access: ", 1)[1])
            label = rec.get("client_request_id") or ""
            if not (label.startswith("slo") and label.endswith("x")):
                continue
            st = rec.get("stages_ms") or {}
            if st.get("placed") is not None:
                out[int(label[3:-1])] = st["placed"] - (st.get("matched") or 0.0)
    return out


async def send_all(url: str, bodies: list[dict], offsets: list[float], limit_s: float, base: int = 0):
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit_s, sock_connect=10),
                                     connector=conn) as session:
        return await open_loop(offsets, lambda i: send_router(session, url, bodies[i], base + i), limit_s)


def dist(values: list[float]) -> dict:
    r = lambda x: None if x is None else round(x, 3)   # noqa: E731
    return {"n": len(values), "p50": r(_pct(values, .5)), "p90": r(_pct(values, .9)),
            "p99": r(_pct(values, .99)), "max": r(max(values) if values else None)}


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def run_cell(speedup: float, repeat: int, bodies: list[dict], offsets: list[float], warm: list[dict],
             args, cost: Cost) -> dict:
    offsets = [t / speedup for t in offsets]
    with _group(args, f"x{speedup:g}-r{repeat}") as group:
        engines = start_engines(group, "agg", args, cost)
        dp_url = start_ours(group, args.policy, "agg", engines, dp_args=("--log-level", "INFO"))
        kids = {c.name: c for c in group.children}
        dp, cp = kids["dataplane"], kids["controlplane"]
        cp_url = f"http://127.0.0.1:{cp.info['http_port']}"
        dp_pids, cp_pids = process_tree(dp.proc.pid), process_tree(cp.proc.pid)
        # warm-up: other rows, a few at a time (connections, first-call paths, the KV index)
        asyncio.run(send_all(dp_url, warm, [0.05 * i for i in range(len(warm))], 30, WARM_ID))
        time.sleep(0.3)
        dp0, cp0 = prom.scrape(dp_url), prom.scrape(cp_url)
        lag0 = loop_lag(dp_url)
        cpu0 = cpu_seconds(dp_pids), cpu_seconds(cp_pids)
        log_offset = dp.log_path.stat().st_size
        spies = []
        if args.profile and speedup == max(args.speedup_list) and repeat == 0:
            args.profile.mkdir(parents=True, exist_ok=True)
            spies = [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(max(2, int(offsets[-1]) + 2)),
                                       "-r", "200", "-f", "raw", "-o", str(args.profile / f"{name}-x{speedup:g}.txt"),
                                       "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for name, pid in (("dataplane", dp.proc.pid), ("controlplane", cp.proc.pid))]
        outcomes, wall = asyncio.run(send_all(dp_url, bodies, offsets, args.cell_timeout))
        time.sleep(0.2)   # the last access-log lines and lifecycle reports
        cpu1 = cpu_seconds(dp_pids), cpu_seconds(cp_pids)
        lag1 = loop_lag(dp_url)
        dp1, cp1 = prom.scrape(dp_url), prom.scrape(cp_url)
        placements = access_placements(dp.log_path, log_offset)
        for spy in spies:
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
    ok = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error[:80]] = errors.get(o.error[:80], 0) + 1
    dp_hist = prom.delta(*(prom.histogram(t, "omni_dp_placement_seconds") if t else None for t in (dp0, dp1)))
    cp_hist = prom.delta(*(prom.histogram(t, "omni_placement_seconds") if t else None for t in (cp0, cp1)))
    lag = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in (lag_delta(lag0, lag1) or {}).items()}
    samples = [placements[i] for i in sorted(placements)]
    return {
        "speedup": speedup, "repeat": repeat, "requests": len(outcomes), "ok": len(ok), "errors": errors,
        "wall_s": round(wall, 2), "arrival_peak_rps": peak_rate(offsets), "arrival_mean_rps":
            round(len(offsets) / max(offsets[-1], 1e-9), 1),
        "placement_ms": dist(samples),
        "placement_hist": {"count": dp_hist["count"] if dp_hist else None,
                           "p50_le_ms": ms(prom.quantile(dp_hist, .5)), "p99_le_ms": ms(prom.quantile(dp_hist, .99)),
                           "max_le_ms": ms((prom.top_bucket(dp_hist) or (0, None))[1])},
        "cp_placement": {"count": cp_hist["count"] if cp_hist else None,
                         "mean_ms": ms(cp_hist["sum"] / cp_hist["count"]) if cp_hist and cp_hist["count"] else None,
                         "p99_le_ms": ms(prom.quantile(cp_hist, .99)),
                         "max_le_ms": ms((prom.top_bucket(cp_hist) or (0, None))[1])},
        "loop": {"ticks": lag.get("ticks"), "ticks_over_5ms": lag.get("ticks_over_5ms"),
                 "longest_ms": lag.get("longest_ms"), "longest_le_ms": lag.get("longest_le_ms"),
                 "longest_best_ms": lag.get("longest_ms") or lag.get("longest_le_ms")},
        "dp_cpu_share": round((cpu1[0] - cpu0[0]) / wall, 3), "cp_cpu_share": round((cpu1[1] - cpu0[1]) / wall, 3),
        "ttft_ms": dist([o.ttft * 1000 for o in ok if o.ttft is not None]),
        "placement_samples_ms": [round(x, 3) for x in samples],
    }


# ---- reporting -----------------------------------------------------------------------

METRICS = {   # summary key -> (cell path, label)
    "placement_p50_ms": (("placement_ms", "p50"), "placement p50 ms"),
    "placement_p99_ms": (("placement_ms", "p99"), "placement p99 ms"),
    "placement_max_ms": (("placement_ms", "max"), "placement max ms"),
    "hist_p99_le_ms": (("placement_hist", "p99_le_ms"), "histogram p99 <= ms"),
    "cp_mean_ms": (("cp_placement", "mean_ms"), "control plane mean ms"),
    "cp_p99_le_ms": (("cp_placement", "p99_le_ms"), "control plane p99 <= ms"),
    "stall_ms": (("loop", "longest_best_ms"), "longest stall ms"),
    "ticks_over_5ms": (("loop", "ticks_over_5ms"), "ticks > 5 ms"),
    "dp_cpu_share": (("dp_cpu_share",), "data plane CPU"),
    "ttft_p50_ms": (("ttft_ms", "p50"), "TTFT p50 ms"),
}


def _get(cell: dict, path: tuple) -> float | None:
    for k in path:
        cell = cell.get(k) if isinstance(cell, dict) else None
    return cell


def summarize(cells: list[dict]) -> list[dict]:
    out = []
    for speedup in sorted({c["speedup"] for c in cells}):
        cs = [c for c in cells if c["speedup"] == speedup]
        row = {"speedup": speedup, "repeats": len(cs), "requests": sum(c["requests"] for c in cs),
               "errors": sum(c["requests"] - c["ok"] for c in cs),
               "arrival_peak_rps": cs[0]["arrival_peak_rps"], "arrival_mean_rps": cs[0]["arrival_mean_rps"],
               "stall_exact_cells": sum(c["loop"]["longest_ms"] is not None for c in cs),
               "pooled_placement_ms": dist(sorted(x for c in cs for x in c["placement_samples_ms"]))}
        for key, (path, _label) in METRICS.items():
            vals = [v for v in (_get(c, path) for c in cs) if v is not None]
            row[key] = ({"median": round(statistics.median(vals), 3), "min": round(min(vals), 3),
                         "max": round(max(vals), 3)} if vals else None)
        out.append(row)
    return out


def _cell(stat: dict | None, digits: int = 2) -> str:
    if not stat:
        return "-"
    s = f"{stat['median']:.{digits}f}"
    if stat["min"] != stat["max"]:
        s += f" ({stat['min']:.{digits}f}..{stat['max']:.{digits}f})"
    return s


def verdict(summary: list[dict]) -> list[str]:
    lines = []
    for row in summary:
        p99 = row["pooled_placement_ms"]["p99"]
        worst_p99 = row["placement_p99_ms"]["max"] if row["placement_p99_ms"] else None
        stall = row["stall_ms"]["max"] if row["stall_ms"] else None
        ok_p = p99 is not None and worst_p99 is not None and worst_p99 <= PLACEMENT_TARGET_MS
        ok_s = stall is not None and stall <= STALL_TARGET_MS
        lines.append(
            f"- {row['speedup']:g}x (peak {row['arrival_peak_rps']:.0f} req/s in one second): placement p99 "
            f"{p99} ms pooled, worst repeat {worst_p99} ms -> **{'meets' if ok_p else 'misses'}** <= "
            f"{PLACEMENT_TARGET_MS:g} ms; longest stall {stall} ms -> **{'meets' if ok_s else 'misses'}** <= "
            f"{STALL_TARGET_MS:g} ms; {row['errors']} errors in {row['requests']} requests.")
    return lines


def write_markdown(path: Path, report: dict) -> None:
    cfg = report["config"]
    w = cfg["window"]
    lines = ["# Burst: placement latency and event-loop stall at the trace's burstiest", "",
             f"Command: `{report['command']}`", "",
             f"Host: {report['host']}; generated {report['generated']}, {report['elapsed_s']:.0f} s; "
             f"commit {report['code'].get('commit', '?')[:12]}"
             f"{' (working tree dirty)' if report['code'].get('working_tree_dirty') else ''}.", "",
             f"Window: rows {w['start']}..{w['start'] + w['rows'] - 1} of `{cfg['trace_name']}`, the densest "
             f"{cfg['window_s']:g} s of arrivals ({w['rows']} requests at trace time {w['t0_s']:.1f} s; "
             f"{w['mean_rps']:.1f} req/s in the window, peak {w['peak_rps']:.0f} req/s in one second, against "
             f"{cfg['trace_mean_rps']:.1f} req/s over the whole trace). Prompts at full length "
             f"({w['prompt_tokens_mean']:.0f} tokens mean, {w['prompt_tokens_max']} max), output capped at "
             f"{cfg['max_output']} tokens, streamed. Replayed open-loop at speedups {cfg['speedups']}; "
             f"{cfg['repeats']} interleaved repeats, fresh processes per cell, {cfg['warmup']} warm-up requests "
             f"on other rows first.", "",
             f"Setup: {cfg['agg_engines']} simulated engines (`{' '.join(cfg['sim_args'])}`, KV events over ipc), "
             f"our control plane (`--policy {cfg['policy']}`, following the KV events) and one data plane "
             "(default log level, access log on), all on loopback.", "",
             "Placement = block hashes computed to the control plane's answer, per request, from the data "
             "plane's access log (exact); `histogram p99` is the same quantity from `omni_dp_placement_seconds` "
             "(upper bucket edge). Control plane = `omni_placement_seconds` (decide and reserve, no queue). "
             "Longest stall = lateness of the data plane's 10 ms loop timer (exact where the 10 s max tells "
             "it, else the bucket's upper edge). Cells: median over repeats (min..max).", "",
             "| speedup | peak req/s | requests | errors | placement p50 ms | placement p99 ms | placement max ms "
             "| pooled p99 ms | histogram p99 <= ms | control plane mean ms | longest stall ms | ticks > 5 ms "
             "| data plane CPU | TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["summary"]:
        lines.append(
            f"| {r['speedup']:g}x | {r['arrival_peak_rps']:.0f} | {r['requests']} | {r['errors']} | "
            f"{_cell(r['placement_p50_ms'])} | {_cell(r['placement_p99_ms'])} | {_cell(r['placement_max_ms'])} | "
            f"{r['pooled_placement_ms']['p99']} | {_cell(r['hist_p99_le_ms'])} | {_cell(r['cp_mean_ms'], 3)} | "
            f"{_cell(r['stall_ms'], 1)} | {_cell(r['ticks_over_5ms'], 0)} | {_cell(r['dp_cpu_share'])} | "
            f"{_cell(r['ttft_p50_ms'], 1)} |")
    lines += ["", f"Against the targets (placement p99 <= {PLACEMENT_TARGET_MS:g} ms, longest stall <= "
              f"{STALL_TARGET_MS:g} ms):", "", *verdict(report["summary"]), "",
              f"![placement latency and loop stall per speed-up]({path.with_suffix('.png').name})", ""]
    write_keeping_notes(path, "\n".join(lines))


def _spread(ax, xs: list[float], stats: list[dict | None], **kw) -> None:
    """Medians over repeats as a line, min..max as error bars; cells without a value skipped."""
    pts = [(x, s) for x, s in zip(xs, stats) if s]
    if pts:
        med = [s["median"] for _, s in pts]
        ax.errorbar([x for x, _ in pts], med, yerr=[[max(0, m - s["min"]) for m, (_, s) in zip(med, pts)],
                                                    [max(0, s["max"] - m) for m, (_, s) in zip(med, pts)]],
                    fmt="-o", capsize=3, **kw)


def write_plot(path: Path, report: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    xs = [r["speedup"] for r in summary]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for key, label, color in (("placement_p50_ms", "p50", "C0"), ("placement_p99_ms", "p99", "C1"),
                              ("placement_max_ms", "max", "C3"), ("cp_mean_ms", "control plane mean", "C2")):
        _spread(ax, xs, [r[key] for r in summary], color=color, label=label)
    ax.axhline(PLACEMENT_TARGET_MS, color="grey", ls=":", label=f"target p99 {PLACEMENT_TARGET_MS:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("speedup of the burst window")
    ax.set_ylabel("ms")
    ax.set_title("data-plane placement latency (median over repeats, min..max)")
    ax.legend(fontsize=7)

    ax = axes[1]
    for i, r in enumerate(summary):
        vals = r["pooled_placement_ms"]
        samples = sorted(x for c in report["cells"] if c["speedup"] == r["speedup"] for x in c["placement_samples_ms"])
        if samples:
            ax.plot(samples, [(j + 1) / len(samples) for j in range(len(samples))], color=f"C{i}",
                    label=f"{r['speedup']:g}x (p99 {vals['p99']} ms)")
    ax.axvline(PLACEMENT_TARGET_MS, color="grey", ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("placement latency (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("placement latency CDF, repeats pooled")
    ax.legend(fontsize=7)

    ax = axes[2]
    _spread(ax, xs, [r["stall_ms"] for r in summary], color="C3", label="longest stall")
    ax.axhline(STALL_TARGET_MS, color="grey", ls=":", label=f"target {STALL_TARGET_MS:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("speedup of the burst window")
    ax.set_ylabel("longest event-loop stall (ms)")
    ax2 = ax.twinx()
    ticks = [(x, r["ticks_over_5ms"]) for x, r in zip(xs, summary) if r["ticks_over_5ms"]]
    if ticks:
        ax2.bar([t[0] for t in ticks], [t[1]["median"] for t in ticks], width=[t[0] * 0.25 for t in ticks],
                alpha=0.25, color="C0", label="ticks > 5 ms (median)")
    ax2.set_ylabel("10 ms ticks over 5 ms late")
    ax.set_title("data-plane event loop")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", type=Path, default=None,
                   help="the Mooncake trace (default: shared/traces/ in or next to the repository root)")
    p.add_argument("--window-s", type=float, default=30.0, help="length of the densest window, trace seconds")
    p.add_argument("--speedups", default="1,2,4,8", help="replay speed multipliers of the window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-requests", type=int, default=300, help="rows of the window replayed per cell (the first N)")
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests per cell (rows before the window)")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--agg-engines", type=int, default=4)
    p.add_argument("--max-output", type=int, default=16, help="cap on output tokens per request")
    p.add_argument("--prefill-tok-s", type=float, default=200000.0, help="simulated prefill speed")
    p.add_argument("--decode-step-ms", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=262144)
    p.add_argument("--cell-timeout", type=float, default=90.0, help="wall-time bound of one cell's replay")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="overall bound: no new cell starts after this many seconds")
    p.add_argument("--profile", type=Path, default=None,
                   help="py-spy the data plane (raw stacks into this directory) during the fastest cell of repeat 0")
    p.add_argument("--keep-logs", type=Path, default=None, help="keep every cell's process logs under this directory")
    p.add_argument("--git-ref", default=None,
                   help="run every process from `git archive REF` of this repository (e.g. HEAD), so "
                        "uncommitted edits in the working tree do not leak into the measurement")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="output directory")
    p.add_argument("--name", default="burst", help="output file stem")
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    try:
        trace = resolve_trace(args.trace)
    except TraceMissing as exc:
        parser.error(str(exc))
    args.speedup_list = [float(x) for x in args.speedups.split(",") if x.strip()]
    for name in ("keep_logs", "profile", "out"):
        if getattr(args, name):
            setattr(args, name, getattr(args, name).resolve())
    with code_from(args.git_ref) as code:
        return _main(args, trace, argv, code)


def _main(args, trace: Path, argv: list[str], code: dict) -> int:
    rows = load_rows(trace, 0, 10 ** 9)
    start, count = densest_window(rows, args.window_s)
    window = rows[start:start + min(count, args.max_requests)]
    warm_rows = rows[max(0, start - args.warmup):start]
    cost = Cost(token_scale=1, time_scale=1.0, prefill_tok_s=args.prefill_tok_s, decode_step_ms=args.decode_step_ms,
                decode_seq_ms=0.02, kv_transfer_tok_s=1e6, max_batched_tokens=8192, max_num_seqs=256,
                kv_pool_tokens=640_000, max_model_len=args.max_model_len)

    def body(row: dict) -> dict:
        out = max(1, min(row["output_length"], args.max_output))
        return {"model": "sim-model", "prompt": prompt_for(row, 1, args.max_model_len - out), "stream": True,
                "max_tokens": out, "ignore_eos": True}

    bodies, warm = [body(r) for r in window], [body(r) for r in warm_rows]
    t0 = window[0]["timestamp"]
    offsets = [(r["timestamp"] - t0) / 1000 for r in window]
    lengths = [len(b["prompt"]) for b in bodies]
    win = {"start": start, "rows": len(window), "rows_in_window": count, "t0_s": t0 / 1000,
           "span_s": offsets[-1], "mean_rps": len(window) / args.window_s, "peak_rps": peak_rate(offsets),
           "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths)}
    log(f"window: rows {start}..{start + len(window) - 1} ({len(window)} requests, peak {win['peak_rps']:.0f} "
        f"req/s, {win['prompt_tokens_mean']:.0f} prompt tokens mean); speedups {args.speedup_list} x "
        f"{args.repeats} repeats")
    started = time.monotonic()
    cells: list[dict] = []
    total = args.repeats * len(args.speedup_list)
    n = 0
    for rep in range(args.repeats):
        k = rep % len(args.speedup_list)
        for speedup in args.speedup_list[k:] + args.speedup_list[:k]:   # interleaved: rotate per repeat
            n += 1
            if time.monotonic() - started > args.max_seconds:
                log(f"[{n}/{total}] --max-seconds reached: no more cells")
                break
            log(f"[{n}/{total}] repeat {rep} speedup {speedup:g}x: starting")
            c = run_cell(speedup, rep, bodies, offsets, warm, args, cost)
            cells.append(c)
            pm, lp = c["placement_ms"], c["loop"]
            log(f"[{n}/{total}] repeat {rep} {speedup:g}x: ok {c['ok']}/{c['requests']} placement p50/p99/max "
                f"{pm['p50']}/{pm['p99']}/{pm['max']} ms (histogram p99 <= {c['placement_hist']['p99_le_ms']}) "
                f"control plane mean {c['cp_placement']['mean_ms']} ms; longest stall {lp['longest_best_ms']} ms, "
                f"{lp['ticks_over_5ms']:.0f}/{lp['ticks']:.0f} ticks > 5 ms; data plane CPU {c['dp_cpu_share']:.0%} "
                f"({c['wall_s']:.1f} s)" + (f" errors {c['errors']}" if c["errors"] else ""))
        else:
            continue
        break

    report = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/burst.py " + " ".join(shlex.quote(a) for a in argv),
        "host": host_line(), "elapsed_s": round(time.monotonic() - started, 1), "code": code,
        "targets": {"placement_p99_ms": PLACEMENT_TARGET_MS, "longest_stall_ms": STALL_TARGET_MS},
        "config": {"trace_name": trace.name, "window_s": args.window_s, "window": win,
                   "trace_mean_rps": len(rows) / ((rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000),
                   "speedups": args.speedup_list, "repeats": args.repeats, "warmup": len(warm),
                   "policy": args.policy, "agg_engines": args.agg_engines, "max_output": args.max_output,
                   "sim_args": cost.sim_args()},
        "summary": summarize(cells),
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    write_markdown(out.with_suffix(".md"), report)
    try:
        write_plot(out.with_suffix(".png"), report)
    except Exception as exc:   # noqa: BLE001 - the plot is a convenience
        log(f"plot failed: {exc}")
    log(f"wrote {out}.json, .md, .png in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
