"""The README's first command: the demo runs traffic through both flows and stops cleanly."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_sends_traffic_through_aggregated_and_pd_workers():
    out = subprocess.run([sys.executable, "-m", "omni_proxy", "demo", "--requests", "16", "--concurrency", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] == summary["sent"] == 16
    assert summary["pd"] > 0 and summary["aggregated"] > 0
    assert "where requests ran" in out.stdout and "prefill-0" in out.stdout
