"""The workload suite: every shape of bench/workloads.py, fleet and PD ratio, through
bench/slo_replay.py, against the peers, then one summary page.

    python bench/workload_suite.py                       # everything (hours on 2 cores)
    python bench/workload_suite.py --only system_prompt,pd_1_3 --rates 1,2 --repeats 1

Each case is one slo_replay run (its own ``docs/benchmarks/workload_<case>.{md,json}`` and
plots: attainment against rate, TTFT CDF), with the assignment replay. The summary,
``docs/benchmarks/workloads.md``, puts side by side, per case and rate: our default
policy, our other policies and the best peer's SLO attainment, and the least fair share
any equal engine got (below 0.5: an engine starved). ``--summarize-only`` rebuilds it
from the JSON files already there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import slo_replay  # noqa: E402

DEFAULT_POLICY = "predicted_latency"

# case name -> slo_replay flags (besides the targets, rates and repeats the suite sets)
CASES: dict[str, list[str]] = {
    "system_prompt": ["--workload", "system_prompt", "--requests", "300", "--modes", "agg"],
    "agent": ["--workload", "agent", "--requests", "300", "--modes", "agg"],
    "longdoc": ["--workload", "longdoc", "--requests", "120", "--modes", "agg"],
    "mixed": ["--workload", "mixed", "--requests", "300", "--modes", "agg", "--max-output", "1000"],
    "hetero": ["--workload", "system_prompt", "--requests", "300", "--modes", "agg", "--agg-engines", "3",
               "--engine-speeds", "1,1,0.5"],
    "slowdown": ["--workload", "system_prompt", "--requests", "300", "--modes", "agg",
                 "--slowdown", "1:0.5:2"],
    "pd_1_3": ["--workload", "system_prompt", "--requests", "300", "--modes", "pd",
               "--prefill-engines", "1", "--decode-engines", "3"],
    "pd_2_2": ["--workload", "system_prompt", "--requests", "300", "--modes", "pd",
               "--prefill-engines", "2", "--decode-engines", "2"],
    "pd_3_1": ["--workload", "system_prompt", "--requests", "300", "--modes", "pd",
               "--prefill-engines", "3", "--decode-engines", "1"],
}

# Each case's rate multipliers for ``--rates auto``: around where the best peer met the SLO for
# 80 % of requests in the last full run (docs/benchmarks/workloads.md): one rate above it, one
# near it and one where the targets are near or below 50 %.
AUTO_RATES: dict[str, str] = {
    "system_prompt": "4,8,16", "agent": "8,12,16", "longdoc": "4,8,16", "mixed": "2,3,4", "hetero": "2,3,4",
    "slowdown": "4,6,8", "pd_1_3": "1,1.5,2", "pd_2_2": "2,3,4", "pd_3_1": "4,6,8",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help=f"comma-separated cases (default all: {', '.join(CASES)})")
    p.add_argument("--rates", default="auto", help="rate multipliers for every case, or auto (AUTO_RATES)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", default=f"{DEFAULT_POLICY},cache_aware,round_robin")
    p.add_argument("--peers", default="vllm-router,smg")
    p.add_argument("--peer-policies", default="cache_aware,round_robin",
                   help="passed to slo_replay (in PD, vllm-router's own PD mode whatever the policy)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--reuse-peers", type=Path, default=None, metavar="DIR",
                   help="run only our policies; take each case's peer runs from DIR/workload_<case>.json "
                        "(an earlier suite run; passed to slo_replay, whose pages then say so)")
    p.add_argument("--no-replay", action="store_true", help="passed to slo_replay: skip the assignment replay")
    p.add_argument("--no-peer-replay", action="store_true", help="passed to slo_replay: replay only our assignments")
    p.add_argument("--slo-headers", action="store_true",
                   help="passed to slo_replay: send the measured SLO as request headers (X-SLO-TTFT-Ms/X-SLO-TPOT-Ms)")
    p.add_argument("--slo-config", action=argparse.BooleanOptionalAction, default=True,
                   help="passed to slo_replay (on by default): start our control plane with the measured SLO as "
                        "its deployment targets ([slo] ttft_ms/tpot_ms, in wall time); --no-slo-config: its "
                        "default 2 s / 100 ms targets")
    p.add_argument("--time-scale", default="0.5")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--git-ref", default=None, help="passed to slo_replay (run the processes from git archive REF)")
    p.add_argument("--profiles", type=Path, default=None,
                   help="passed to slo_replay: custom policies named in --policies (e.g. bench/profiles/no_queue.toml "
                        "for predicted_latency held vs not held)")
    return p.parse_args(argv)


def run_case(case: str, args) -> int:
    rates = AUTO_RATES[case] if args.rates == "auto" else args.rates
    argv = [*CASES[case], "--rates", rates, "--repeats", str(args.repeats), "--policies", args.policies,
            "--time-scale", args.time_scale, "--out", str(args.out), "--name", f"workload_{case}"]
    if args.reuse_peers:
        argv += ["--reuse-peers", str(args.reuse_peers / f"workload_{case}.json")]
    elif args.no_peers:
        argv += ["--no-peers"]
    else:
        argv += ["--peers", args.peers, "--peer-policies", args.peer_policies]
    if args.no_peer_replay:
        argv += ["--no-peer-replay"]
    if args.git_ref:
        argv += ["--git-ref", args.git_ref]
    if args.no_replay:
        argv += ["--no-replay"]
    if args.slo_headers:
        argv += ["--slo-headers"]
    if args.slo_config:
        argv += ["--slo-config"]
    if args.profiles:
        argv += ["--profiles", str(args.profiles)]
    print(f"== {case}: python bench/slo_replay.py {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    return slo_replay.main(argv)


def summarize(out: Path, cases: list[str], command: str) -> Path:
    lines = ["# Workload suite: SLO attainment by shape, fleet and PD ratio", "",
             "Last generated by (each case below says when its own runs were made):", "", "```bash", command,
             "```", "",
             "Per case and rate multiplier: SLO attainment % (mean over repeats) through each router; "
             f"`ours` is our default policy ({DEFAULT_POLICY}); `best peer` the best of the peers' policies; "
             "`replay` our default's assignment sent straight to fresh engines. `fair`: the least "
             "fair share of requests any equal engine got over all targets' runs (below 0.5: an engine starved); "
             "`fair tokens`: the same in tokens (prompt tokens asked of a prefill or aggregated engine, output "
             "tokens of a decode engine), which is what an engine's share of the work is when requests differ "
             "in size. "
             "`ours` runs with the measured SLO as its control plane's deployment targets (`[slo] ttft_ms` / "
             "`tpot_ms`, in wall time: SLO x time scale; `--slo-config`, the suite's default) where a case says "
             "`[slo] set`: an operator configures the SLO the deployment is judged on; the peers have no such "
             "setting. "
             "Each case's own page has every target, TTFT/TPOT percentiles and the plots.", ""]
    for case in cases:
        path = out / f"workload_{case}.json"
        if not path.is_file():
            lines += [f"## {case}", "", "not run", ""]
            continue
        report = json.loads(path.read_text())
        summary = report["summary"]
        ran = f"run {report['generated']} at {(report['code'].get('commit') or '?')[:10]}"
        ran += "; ours: [slo] set" if report["config"].get("slo_config") else "; ours: no [slo]"
        if report["config"].get("reused_peers"):
            src = report["config"]["reused_peers"]
            ran += f"; peers' runs from {src['generated']} at {(src.get('commit') or '?')[:10]}"
        lines += [f"## {case}", "", f"[details](workload_{case}.md) - `{' '.join(CASES.get(case, []))}` ({ran})", "",
                  "| rate | ours | other policies | best peer | ours - best peer | replay (ours) | fair (ours) "
                  "| fair tokens (ours) | fair (all) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        rates = sorted({r["rate"] for r in summary})
        for rate in rates:
            at = [r for r in summary if r["rate"] == rate]
            router = [r for r in at if r["path"] == "router"]

            def pct(r):
                m = r["slo_attainment"]["mean"]
                return None if m is None else round(m * 100, 1)

            ours = next((r for r in router if r["target"] == f"ours:{DEFAULT_POLICY}"), None)
            others = [f"{r['target'].split(':', 1)[1]} {pct(r)}" for r in router
                      if r["target"].startswith("ours:") and r is not ours]
            peers = [r for r in router if not r["target"].startswith("ours:")]
            best = max(peers, key=lambda r: pct(r) or 0.0, default=None)
            replay = next((r for r in at if r["path"] == "replay" and r["target"] == f"ours:{DEFAULT_POLICY}"), None)
            fair_all = [r["min_fair_share"] for r in router if r.get("min_fair_share") is not None]
            best_cell = f"{pct(best)} ({best['target']})" if best else "-"
            lead = (f"{(pct(ours) or 0.0) - (pct(best) or 0.0):+.1f}" if ours and best else "-")
            lines.append(
                f"| {rate:g} | {pct(ours) if ours else '-'} | {', '.join(others) or '-'} | {best_cell} | {lead} | "
                f"{pct(replay) if replay else '-'} | "
                f"{ours.get('min_fair_share') if ours and ours.get('min_fair_share') is not None else '-'} | "
                f"{ours.get('min_token_share') if ours and ours.get('min_token_share') is not None else '-'} | "
                f"{min(fair_all) if fair_all else '-'} |")
        lines.append("")
    path = out / "workloads.md"
    path.write_text("\n".join(lines))
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [c for c in args.only.split(",") if c.strip()] or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    args.out = args.out.resolve()
    if args.reuse_peers:
        args.reuse_peers = args.reuse_peers.resolve()
    failed = []
    if not args.summarize_only:
        for case in cases:
            if run_case(case, args) != 0:
                failed.append(case)
    command = "python bench/workload_suite.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    # The summary covers every case whose page is in --out, not only the ones just run, so a
    # rerun of one case does not drop the others from workloads.md.
    print(f"wrote {summarize(args.out, list(CASES), command)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
