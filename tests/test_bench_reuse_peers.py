"""bench/slo_replay.py --reuse-peers and the workload suite's summary of partial reruns:
the peers' runs come from an earlier report of the same case, only for the modes and rates
asked, and every page that shows them says where they came from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import slo_replay, workload_suite  # noqa: E402


def _run(target: str, rate: float, slo: float, mode: str = "agg") -> dict:
    return {"target": target, "mode": mode, "rate": rate, "repeat": 0, "path": "router", "requests": 10, "ok": 10,
            "slo_attainment": slo, "ttft_p50_ms": 100, "ttft_p90_ms": 200, "ttft_p99_ms": 300, "tpot_p50_ms": 10,
            "tpot_p90_ms": 20, "e2e_p50_ms": 500, "e2e_p90_ms": 900, "output_tok_s": 50.0, "prefix_hit_rate": 0.5,
            "per_engine": [{"engine": "e0", "requests": 5}, {"engine": "e1", "requests": 5}], "errors": {},
            "min_fair_share": 1.0, "min_token_share": None}


def _earlier(tmp_path: Path) -> Path:
    runs = [_run("ours:predicted_latency", 2, 0.9), _run("vllm-router:cache_aware", 2, 0.8),
            _run("vllm-router:cache_aware", 4, 0.5), _run("smg:cache_aware", 2, 0.7)]
    path = tmp_path / "workload_x.json"
    path.write_text(json.dumps({"generated": "2026-01-01 00:00 UTC", "command": "python bench/slo_replay.py --x",
                                "code": {"commit": "0123456789abcdef"},
                                "config": {"peer_versions": {"vllm-router": "0.1.17"}}, "runs": runs}))
    return path


def test_reused_peer_runs_keep_only_peers_at_the_rates_asked(tmp_path):
    got = slo_replay.reused_peer_runs(_earlier(tmp_path), ["agg"], [2.0])
    assert [(r["target"], r["rate"]) for r in got["runs"]] == [("vllm-router:cache_aware", 2),
                                                              ("smg:cache_aware", 2)]
    assert got["targets"] == ["vllm-router:cache_aware", "smg:cache_aware"]
    assert got["source"] == {"generated": "2026-01-01 00:00 UTC", "commit": "0123456789abcdef",
                             "command": "python bench/slo_replay.py --x"}
    assert got["peer_versions"] == {"vllm-router": "0.1.17"}


def test_peers_reused_twice_name_the_run_that_made_them(tmp_path):
    """A report whose peers were themselves reused passes on where they were run, not its own
    date and commit (a second partial rerun would otherwise date the peers' runs to the first)."""
    earlier = _earlier(tmp_path)
    first = json.loads(earlier.read_text())
    src = slo_replay.reused_peer_runs(earlier, ["agg"], [2.0])
    second = tmp_path / "workload_y.json"
    second.write_text(json.dumps({**first, "generated": "2026-02-02 00:00 UTC", "code": {"commit": "fedcba98"},
                                  "command": "python bench/slo_replay.py --reuse-peers x",
                                  "config": {**first["config"], "reused_peers": src["source"]}}))
    got = slo_replay.reused_peer_runs(second, ["agg"], [2.0])
    assert got["source"] == src["source"] and got["source"]["commit"] == "0123456789abcdef"


def test_reused_peer_runs_refuse_a_rate_the_earlier_report_lacks(tmp_path):
    with pytest.raises(SystemExit, match=r"no peer runs for \(mode, rate\) \[\('agg', 8.0\)\]"):
        slo_replay.reused_peer_runs(_earlier(tmp_path), ["agg"], [2.0, 8.0])


def test_pages_say_the_peers_were_reused(tmp_path):
    src = slo_replay.reused_peer_runs(_earlier(tmp_path), ["agg"], [2.0])
    runs = [_run("ours:predicted_latency", 2, 0.95), *src["runs"]]
    report = {"generated": "2026-02-02 00:00 UTC", "command": "python bench/slo_replay.py --y",
              "code": {"commit": "fedcba9876543210"},
              "config": {"trace_name": "t", "workload": "system_prompt", "seed": 0, "requests": 10,
                         "window_model_s": 1.0, "base_rate": 1.0, "rates": [2.0], "repeats": 1, "modes": ["agg"],
                         "slo_ttft_ms": 2000, "slo_tpot_ms": 100, "max_output": 16, "agg_engines": 2,
                         "prefill_engines": 0, "decode_engines": 0,
                         "cost": {"prefill_tok_s": 1, "decode_step_ms": 1, "decode_seq_ms": 1,
                                  "max_batched_tokens": 1, "kv_pool_tokens": 1, "token_scale": 1, "time_scale": 1},
                         "reused_peers": src["source"]},
              "summary": slo_replay.aggregate(runs), "runs": runs}
    slo_replay.write_markdown(tmp_path / "page.md", report)
    text = (tmp_path / "page.md").read_text()
    assert "reused from an earlier report (2026-01-01 00:00 UTC, commit 0123456789" in text

    out = tmp_path / "suite"
    out.mkdir()
    (out / "workload_system_prompt.json").write_text(json.dumps(report))
    page = workload_suite.summarize(out, list(workload_suite.CASES), "python bench/workload_suite.py --z").read_text()
    section = page.split("## system_prompt")[1].split("## ")[0]
    assert ("run 2026-02-02 00:00 UTC at fedcba9876; ours: no [slo]; "
            "peers' runs from 2026-01-01 00:00 UTC at 0123456789") in section
    assert "| 2 | 95.0 | - | 80.0 (vllm-router:cache_aware) | +15.0 | - | 1.0 | - | 1.0 |" in section
    assert "## agent\n\nnot run" in page   # every case is listed, run or not


def test_fair_share_in_requests_and_in_tokens():
    # Two equal aggregated engines: one took 3 long requests, the other 9 short ones.
    per_engine = [{"role": "both", "requests": 3, "tokens": 30_000}, {"role": "both", "requests": 9, "tokens": 27_000},
                  {"role": "decode", "requests": 12, "tokens": 400}]
    assert slo_replay.fair_share(per_engine, [1.0, 1.0, 1.0]) == 0.5              # 3 of a mean of 6
    assert slo_replay.fair_share(per_engine, [1.0, 1.0, 1.0], "tokens") == 0.947  # 27k of a mean of 28.5k
    # a slower engine is not the equal of the others; a lone decode engine has no equals
    assert slo_replay.fair_share(per_engine, [1.0, 0.5, 1.0], "tokens") is None
