"""bench/workloads.py (the seeded workload shapes), bench/slo_replay.py's fleet knobs
(engine speeds, a mid-run slowdown, the fair-share figure) and the simulator's
``slowdown`` fault they rely on."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import slo_replay  # noqa: E402
from bench.workloads import BLOCK, SHAPES, generate, main  # noqa: E402
from omni_runtime import start_http_site  # noqa: E402
from simulator.config import SimConfig  # noqa: E402
from simulator.context import SIM  # noqa: E402
from simulator.engine import Engine, StepPlan  # noqa: E402
from simulator.server import build_app  # noqa: E402


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_are_seeded_and_well_formed(shape):
    rows = generate(shape, 150, seed=7)
    assert rows == generate(shape, 150, seed=7)
    assert rows != generate(shape, 150, seed=8)
    assert len(rows) == 150
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]
    for r in rows:
        # a prompt fills its blocks but the last, which it may fill partly
        assert (len(r["hash_ids"]) - 1) * BLOCK < r["input_length"] <= len(r["hash_ids"]) * BLOCK
        assert r["output_length"] >= 1


def _first_blocks(rows: list[dict], n: int) -> set[tuple[int, ...]]:
    return {tuple(r["hash_ids"][:n]) for r in rows}


def _extends_an_earlier_prompt(rows: list[dict]) -> int:
    seen: set[tuple[int, ...]] = set()
    count = 0
    for r in rows:
        ids = tuple(r["hash_ids"])
        count += any(ids[:k] in seen for k in range(len(ids) - 1, 2, -1))
        seen.add(ids)
    return count


def test_system_prompt_every_request_shares_one_prefix_and_conversations_grow():
    rows = generate("system_prompt", 300, seed=0)
    assert len(_first_blocks(rows, 2)) == 1                   # 1,024 tokens shared by every request
    assert len(_first_blocks(rows, 3)) > 50                   # then conversations of their own
    assert _extends_an_earlier_prompt(rows) > 100             # follow-up turns extend their history


def test_agent_turns_grow_by_tool_results_back_to_back():
    rows = generate("agent", 300, seed=0)
    assert len(_first_blocks(rows, 4)) == 1                   # the shared tool manifest
    assert _extends_an_earlier_prompt(rows) > 200
    assert max(r["output_length"] for r in rows) <= 120


def test_longdoc_few_long_documents_many_questions():
    rows = generate("longdoc", 120, seed=0)
    docs = {tuple(r["hash_ids"][:-1]) for r in rows}
    assert 2 <= len(docs) <= 6
    assert all(30_000 <= len(d) * BLOCK <= 100_000 + BLOCK for d in docs)


def test_mixed_has_chat_beside_long_batch_jobs():
    rows = generate("mixed", 300, seed=0)
    batch = [r for r in rows if r["output_length"] >= 400]
    chat = [r for r in rows if r["output_length"] <= 300]
    assert 0.1 < len(batch) / len(rows) < 0.5 and chat
    assert min(r["input_length"] for r in batch) >= 8_000 - BLOCK


def test_bad_arguments_are_one_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown workload"):
        generate("nope", 10)
    with pytest.raises(SystemExit):
        main(["--shape", "agent", "--requests", "0"])
    assert "requests must be >= 1" in capsys.readouterr().err


def test_cli_writes_jsonl(tmp_path):
    out = tmp_path / "w.jsonl"
    assert main(["--shape", "mixed", "--requests", "20", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 20


def test_text_prompts_for_string_only_routers_tokenize_to_the_same_shape():
    """smg gets the prompts as text (slo_replay.as_text): the simulator's tokenizer gives as many
    tokens, and two prompts share exactly as many leading tokens as their ids do."""
    from bench.tracedata import prompt_for
    from simulator.tokens import text_token_ids

    rows = generate("system_prompt", 40, seed=3)
    bodies = [{"prompt": prompt_for(r, 8), "user": "u"} for r in rows]
    texts = [text_token_ids(slo_replay.as_text(b)["prompt"]) for b in bodies]

    def shared(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for i in range(1, len(bodies)):
        a, b = bodies[i - 1]["prompt"], bodies[i]["prompt"]
        assert len(texts[i]) == len(b)
        assert shared(texts[i - 1], texts[i]) == shared(a, b)
    assert slo_replay.as_text(bodies[0])["user"] == "u"


def test_fair_share_compares_equal_engines_only():
    pe = [{"role": "both", "requests": n} for n in (0, 16, 24, 40)]
    assert slo_replay.fair_share(pe, [1, 1, 1, 1]) == 0.0
    # engine 3 is faster: it is not compared with the others
    assert slo_replay.fair_share(pe[1:], [1, 1, 2]) == round(16 / 20, 3)
    assert slo_replay.fair_share(pe[:1], [1]) is None


def test_engine_speeds_and_slowdown_are_validated():
    args = argparse.Namespace(engine_speeds="1,0.5")
    assert slo_replay.engine_speeds(args, 3) == [1.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        slo_replay.engine_speeds(argparse.Namespace(engine_speeds="1,0"), 2)
    assert slo_replay.parse_slowdown("1:0.5:2") == (1, 0.5, 2.0)
    for bad in ("1:2:2", "1-0.5-2", "x:0.5:2"):
        with pytest.raises(ValueError):
            slo_replay.parse_slowdown(bad)


def test_slower_engine_flags_scale_every_step_cost():
    cost = slo_replay.Cost(8, 0.5, 20000.0, 12.0, 0.15, 200000.0, 2048, 128, 450000, 131072)
    fast, slow = cost.sim_args(1.0), cost.sim_args(0.5)

    def flag(argv, name):
        return float(argv[argv.index(name) + 1])

    for name in ("--prefill-ms-per-token", "--decode-ms-per-step", "--decode-ms-per-seq"):
        assert flag(slow, name) == pytest.approx(2 * flag(fast, name), rel=1e-3)


def test_slowdown_multiplies_the_step_time():
    engine = Engine(SimConfig())
    plan = StepPlan()
    plan.prefill.append((None, 1000))
    base = engine.step_duration(plan)
    engine.slowdown = 2.5
    assert engine.step_duration(plan) == pytest.approx(2.5 * base)


async def test_slowdown_fault_reaches_the_engine_and_clears():
    app = build_app(SimConfig())
    runner, port = await start_http_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/sim/faults"
    engines = app[SIM].engines
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"slowdown": 3}) as r:
                assert r.status == 200 and (await r.json())["slowdown"] == 3.0
            assert engines and all(e.slowdown == 3.0 for e in engines)
            async with http.post(url, json={"slowdown": 0}) as r:
                assert r.status == 400
            assert all(e.slowdown == 3.0 for e in engines)
            async with http.post(url, json={"clear": True}) as r:
                assert r.status == 200
            assert all(e.slowdown == 1.0 for e in engines)
    finally:
        await runner.cleanup()


@pytest.mark.timeout(120)
def test_a_workload_case_runs_end_to_end_and_is_summarized(tmp_path):
    """One tiny case through real engines, control plane and data plane: the report names
    the workload and fleet knobs, round robin's split is fair, and the suite's summary
    page reads it. Asserts no timings."""
    from bench import workload_suite

    cmd = [sys.executable, str(ROOT / "bench" / "slo_replay.py"), "--workload", "system_prompt", "--requests", "12",
           "--policies", "round_robin", "--no-peers", "--no-replay", "--modes", "agg", "--rates", "1",
           "--repeats", "1", "--time-scale", "0.25", "--max-output", "8", "--max-run-seconds", "40",
           "--engine-speeds", "1,1,1,0.5", "--slowdown", "0:0.5:2", "--out", str(tmp_path),
           "--name", "workload_system_prompt"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "workload_system_prompt.json").read_text())
    cfg = report["config"]
    assert (cfg["workload"], cfg["engine_speeds"], cfg["slowdown"]) == ("system_prompt", "1,1,1,0.5", "0:0.5:2")
    (run,) = [r for r in report["runs"] if not r.get("skipped")]
    assert run["ok"] == 12 and [e["requests"] for e in run["per_engine"]] == [3, 3, 3, 3]
    assert run["min_fair_share"] == 1.0
    page = workload_suite.summarize(tmp_path, ["system_prompt", "agent"], "python bench/workload_suite.py --x")
    text = page.read_text()
    assert "## system_prompt" in text and "| 1 | - | round_robin " in text
    assert "## agent\n\nnot run" in text
