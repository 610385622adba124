"""bench/slo_bound.py: the pooled, ideal-cache upper bound on SLO attainment (fixed numbers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.slo_bound import attainment, main, prompt_seconds  # noqa: E402
from bench.workloads import BLOCK  # noqa: E402


def row(ms: int, ids: list[int]) -> dict:
    return {"timestamp": ms, "input_length": len(ids) * BLOCK, "output_length": 8, "hash_ids": ids}


def test_blocks_seen_before_cost_nothing():
    rows = [row(0, [1, 2]), row(500, [1, 2, 3]), row(900, [4])]
    assert prompt_seconds(rows, capacity_tok_s=BLOCK) == [(0.0, 2.0), (0.5, 1.0), (0.9, 1.0)]


def test_fifo_against_shortest_first():
    # A 3 s prompt at 0, then three 0.5 s prompts at 0.1 s: FIFO makes all three wait for the
    # long one (only it meets 3.5 s); shortest-first cannot preempt it either, but orders the
    # short ones by work.
    jobs = [(0.0, 3.0), (0.1, 0.5), (0.1, 0.5), (0.1, 0.5)]
    assert attainment(jobs, rate=1.0, slo_s=3.5, shortest_first=False) == pytest.approx(2 / 4)
    # Twice the rate: the arrivals come in half the time, the work is the same.
    assert attainment([(0.0, 1.0), (1.0, 1.0)], rate=2.0, slo_s=1.0, shortest_first=False) == pytest.approx(1 / 2)
    # Short ones queued together: shortest first finishes more of them in time.
    jobs = [(0.0, 0.1), (0.05, 2.0), (0.06, 0.3), (0.07, 0.3)]
    fifo = attainment(jobs, rate=1.0, slo_s=1.0, shortest_first=False)
    sjf = attainment(jobs, rate=1.0, slo_s=1.0, shortest_first=True)
    assert (fifo, sjf) == (pytest.approx(1 / 4), pytest.approx(3 / 4))


def test_the_command_prints_a_row_per_rate(capsys):
    assert main(["--workload", "system_prompt", "--requests", "60", "--engines", "2", "--rates", "1,100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| 1 | 100.0 |") and out[3].startswith("| 100 |")
    with pytest.raises(SystemExit):
        main(["--engines", "0"])
