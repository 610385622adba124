"""Why do two targets' placements differ? Reads a bench/slo_replay.py JSON report and the
same trace window, and prints per (target, rate), averaged over repeats (router path):

* follow-ups on their predecessor's engine: requests sharing a prefix with an earlier
  request of the window, placed where that request ran;
* new-prompt pile-up: requests with no earlier prefix that went to the same engine as the
  previous new prompt when it arrived less than --close-s model seconds before (blind
  spots: a router that learns placements only from KV events does not yet see the blocks
  of a prompt that is still queued);
* per-engine work: requests, prompt tokens (real) and the queue depth the engines reported;

and, once per report, the attainment no router can exceed: a request whose prompt, less
the deepest prefix any earlier request of the window shares with it, takes longer than the
TTFT target to prefill on an idle engine misses the SLO wherever it goes.

    python bench/slo_analyze.py docs/benchmarks/slo_replay.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.slo_replay import predecessors  # noqa: E402
from bench.tracedata import load_rows, resolve_trace  # noqa: E402


def engine_of(assign: dict, i: int):
    a = assign.get(str(i)) or {}
    return a.get("both", a.get("prefill"))


def _cv(values: list[int]) -> float | None:
    """Coefficient of variation of prompt tokens over the engines that prefill."""
    return statistics.pstdev(values) / statistics.mean(values) if values and any(values) else None


def analyze(run: dict, rows: list[dict], preds: dict, scale: float, close_s: float) -> dict:
    assign = run["assignment"]
    n_eng = len(run["per_engine"])
    tokens = [0] * n_eng
    for i, row in enumerate(rows):
        e = engine_of(assign, i)
        if e is not None and e < n_eng:
            tokens[e] += row["input_length"]
    fresh = [i for i in range(len(rows)) if i not in preds]
    same = close = 0
    for a, b in zip(fresh, fresh[1:], strict=False):
        gap = (rows[b]["timestamp"] - rows[a]["timestamp"]) / 1000 / scale
        ea, eb = engine_of(assign, a), engine_of(assign, b)
        if gap <= close_s and ea is not None and eb is not None:
            close += 1
            same += ea == eb
    follow = [engine_of(assign, i) == engine_of(assign, j) for i, (j, _g, _s) in preds.items()
              if engine_of(assign, i) is not None]
    return {"followup_same": statistics.mean(follow) if follow else None,
            "fresh_pileup": same / close if close else None, "fresh_pairs": close,
            "tokens_k": [round(t / 1000) for t in tokens],
            "tokens_cv": _cv([t for t, pe in zip(tokens, run["per_engine"], strict=False)
                              if pe["role"] in ("both", "prefill")]),
            "waiting_max": [pe["waiting_max"] for pe in run["per_engine"]],
            "waiting_mean": [pe["waiting_mean"] for pe in run["per_engine"]]}


def doomed(rows: list[dict], preds: dict, cfg: dict) -> list[int]:
    """Rows that miss the TTFT target on an idle engine even with every earlier shared prefix
    cached (trace blocks of 512 tokens; the engine recomputes at least the last token)."""
    cost = cfg["cost"]
    out = []
    for i, row in enumerate(rows):
        share = preds[i][2] if i in preds else 0.0
        held = min(round(share * len(row["hash_ids"])) * 512, row["input_length"] - 1)
        if (row["input_length"] - held) / cost["prefill_tok_s"] * 1000 > cfg["slo_ttft_ms"]:
            out.append(i)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument("--close-s", type=float, default=3.0)
    args = p.parse_args()
    report = json.loads(args.report.read_text())
    cfg = report["config"]
    rows = load_rows(resolve_trace(args.trace), cfg["start"], cfg["requests"])
    preds = predecessors(rows)
    print(f"{len(preds)} of {len(rows)} requests share a prefix with an earlier one in the window")
    lost = doomed(rows, preds, cfg)
    print(f"{len(lost)} of {len(rows)} cannot meet TTFT <= {cfg['slo_ttft_ms']:g} ms on an idle engine with every "
          f"earlier prefix cached: no router exceeds {100 * (1 - len(lost) / len(rows)):.1f} % SLO attainment")
    groups: dict[tuple, list[dict]] = {}
    for run in report["runs"]:
        if run.get("skipped") or run["path"] != "router":
            continue
        a = analyze(run, rows, preds, cfg["base_rate"] * run["rate"], args.close_s)
        a["slo"] = run["slo_attainment"]
        a["hit"] = run["prefix_hit_rate"]
        groups.setdefault((run["mode"], run["rate"], run["target"]), []).append(a)
    print(f"{'mode':4} {'rate':>4} {'target':26} {'SLO%':>5} {'hit%':>5} {'follow%':>7} "
          f"{'pileup%':>7} tokens(k) per engine [cv]  queue max per engine")
    for (mode, rate, target), rs in sorted(groups.items()):
        def m(key, rs=rs):
            vals = [r[key] for r in rs if r[key] is not None]
            return statistics.mean(vals) if vals else float("nan")
        print(f"{mode:4} {rate:>4} {target:26} {m('slo') * 100:5.1f} {m('hit') * 100:5.1f} "
              f"{m('followup_same') * 100:7.0f} {m('fresh_pileup') * 100:7.0f} "
              f"{rs[0]['tokens_k']} [{m('tokens_cv'):.2f}]  {rs[0]['waiting_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
