"""Smoke test of bench/burst.py: one speedup, one repeat, two engines, a dozen requests of
the trace's densest window. Checks the outputs exist and hang together; asserts no timings."""

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


@pytest.mark.timeout(60)
def test_burst_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "burst.py"), "--speedups", "4", "--repeats", "1",
           "--window-s", "5", "--max-requests", "12", "--warmup", "2", "--agg-engines", "2",
           "--cell-timeout", "30", "--out", str(tmp_path), "--name", "smoke"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=55, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[1/1]" in res.stderr          # progress
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").read_text().startswith("# Burst")
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert "python bench/burst.py" in report["command"]

    (cell,) = report["cells"]
    assert cell["requests"] == 12 and cell["ok"] >= 11, cell["errors"]
    pm = cell["placement_ms"]
    assert pm["n"] == cell["ok"]            # one access-log line per placed request
    assert 0 < pm["p50"] <= pm["p99"] <= pm["max"]
    assert cell["placement_hist"]["count"] == pm["n"]
    assert cell["cp_placement"]["count"] >= pm["n"]
    assert cell["loop"]["ticks"] > 0 and cell["loop"]["longest_best_ms"] is not None
    (row,) = report["summary"]
    assert row["speedup"] == 4 and row["requests"] == 12
    assert set(row["placement_p99_ms"]) == {"median", "min", "max"}
