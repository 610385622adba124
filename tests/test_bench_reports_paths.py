"""Benchmark reports committed under docs/ name no machine's paths: their commands and plot
lists are relative to the repository (bench/slo_replay.py's ``repo_relative``). A scratch
directory the reader makes for the run (``--baseline-tree /tmp/...``: a git worktree of the
older commit, as the pages say) is the one absolute path a command may show."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from bench.slo_replay import ROOT, repo_relative

REPORTS = ROOT / "docs" / "benchmarks"


def test_repo_relative_shows_paths_inside_and_beside_the_repository_relative():
    assert repo_relative(str(ROOT / "docs" / "benchmarks")) == "docs/benchmarks"
    assert repo_relative(str(ROOT.parent / "shared" / "traces" / "t.jsonl")) == "../shared/traces/t.jsonl"
    assert repo_relative("--rates") == "--rates" and repo_relative("docs/x") == "docs/x"


def test_committed_reports_have_no_absolute_paths():
    checked = 0
    for path in sorted(REPORTS.glob("*.json")):
        report = json.loads(path.read_text())
        if not isinstance(report, dict) or "command" not in report:
            continue
        checked += 1
        words = shlex.split(report["command"])
        assert not [w for w in words if w.startswith("/") and not w.startswith("/tmp/")], (path.name, report["command"])
        assert not [p for p in report.get("plots", []) if Path(p).is_absolute()], (path.name, report["plots"])
    assert checked >= 9     # the workload suite's pages at least
