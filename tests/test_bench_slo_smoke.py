"""Smoke test of bench/slo_replay.py: our round_robin only, one rate, a few requests, no
peers. Checks the report's shape and that its numbers are sane; asserts no timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.tracedata import default_trace  # noqa: E402

pytestmark = pytest.mark.skipif(default_trace() is None, reason="shared/traces/mooncake_synthetic_trace.jsonl absent")


@pytest.mark.timeout(90)
def test_slo_replay_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "slo_replay.py"), "--policies", "round_robin", "--no-peers",
           "--modes", "agg", "--rates", "1", "--repeats", "1", "--start", "3600", "--requests", "20",
           "--base-rate", "0.5", "--time-scale", "0.25", "--max-output", "16", "--max-run-seconds", "40",
           "--out", str(out), "--name", "smoke"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "smoke.json").read_text())
    assert (out / "smoke.md").read_text().startswith("# SLO replay")
    assert "python bench/slo_replay.py" in report["command"]
    assert report["config"]["targets"] == ["ours:round_robin"]

    runs = [r for r in report["runs"] if not r.get("skipped")]
    assert {r["path"] for r in runs} == {"router", "replay"}, report["runs"]
    for run in runs:
        assert run["requests"] == 20
        assert run["ok"] >= 18, run["errors"]
        assert 0.0 <= run["slo_attainment"] <= 1.0
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p90_ms"] <= run["ttft_p99_ms"]
        assert run["tpot_p90_ms"] > 0 and run["output_tok_s"] > 0
        assert run["prefix_hit_rate"] is None or 0.0 <= run["prefix_hit_rate"] <= 1.0
        assert sum(e["requests"] for e in run["per_engine"]) == run["ok"]
        assert len(run["per_engine"]) == 4
    router = next(r for r in runs if r["path"] == "router")
    # round robin spreads 20 requests over 4 engines evenly
    assert sorted(e["requests"] for e in router["per_engine"]) == [5, 5, 5, 5]
    replay = next(r for r in runs if r["path"] == "replay")
    assert replay["assignment"] == router["assignment"]

    summary = report["summary"]
    assert {(s["target"], s["path"]) for s in summary} == {("ours:round_robin", "router"),
                                                           ("ours:round_robin", "replay")}
    for s in summary:
        for key in ("slo_attainment", "ttft_p90_ms", "tpot_p90_ms", "prefix_hit_rate", "output_tok_s"):
            assert set(s[key]) == {"mean", "min", "max", "stdev"}
