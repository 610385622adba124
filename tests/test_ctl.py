"""omni-ctl against real processes: typed JSON, unclipped tables, add refusing overwrites,
drain --wait, weights taking effect at once, explain --prompt match depth, stats, events."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import Cluster, start_cluster, wait_until
from tests.data.tokenizer.fixture_dirs import build

MODEL = "sim-model"
PROMPT = ("omni-ctl explain tokenizes this prompt the way the data plane does, so the prefix index can "
          "say how many of its blocks each engine already holds. " * 3)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build("tiny_llama", tmp_path_factory.mktemp("tok") / "tiny_llama")


@pytest.fixture(scope="module")
def cluster(tok_dir):
    c = start_cluster({"a": "both", "b": "both"}, policy="cache_aware", dp_args=["--tokenizer", str(tok_dir)])
    yield c
    c.group.close()


@pytest.fixture
async def fresh(cluster: Cluster):
    await cluster.fresh()
    try:
        yield cluster
    finally:
        await cluster.restore()


def _ctl_argv(cluster: Cluster, *argv: str) -> list[str]:
    return [sys.executable, "-m", "omni_proxy", "ctl", "--controlplane", cluster.cp.address, *argv]


async def ctl(cluster: Cluster, *argv: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = await asyncio.to_thread(subprocess.run, _ctl_argv(cluster, *argv), capture_output=True, text=True,
                                   timeout=60, env={**os.environ, "COLUMNS": "", **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


async def test_version_and_help_on_every_subcommand(cluster):
    rc, out, _ = await ctl(cluster, "--version")
    assert rc == 0 and out.startswith("omni-ctl ")
    for sub in ("workers", "drain", "undrain", "weight", "add", "remove", "stats", "explain", "events"):
        rc, out, _ = await ctl(cluster, sub, "--help")
        assert rc == 0 and "usage:" in out and "--json" in out, sub


async def test_workers_json_is_typed(fresh):
    rc, out, err = await ctl(fresh, "workers", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["policy"] == "cache_aware"
    w = {x["id"]: x for x in data["workers"]}["a"]
    assert w["role"] == "both" and w["status"] == "healthy" and w["circuit"] == "closed"
    assert isinstance(w["weight"], float) and w["weight"] == 1.0
    assert isinstance(w["load"]["inflight_requests"], int) and isinstance(w["placements_total"], int)
    assert w["draining"] is False and w["model"] == MODEL


async def test_table_shows_full_ids_off_a_terminal(fresh):
    long_id = "decode-a-very-long-worker-id-that-an-operator-must-copy-whole-" + "x" * 40
    rc, _, err = await ctl(fresh, "add", "http://127.0.0.1:9", "--id", long_id, "--force")
    assert rc == 0, err
    for columns in ("", "80", "120", "200"):       # "": off a terminal, no $COLUMNS
        rc, out, err = await ctl(fresh, "workers", env={"COLUMNS": columns})
        assert rc == 0, err
        assert any(long_id in line for line in out.splitlines()), (columns, out)
        assert "http://127.0.0.1:9" in out and "…" not in out, (columns, out)
        for w in (await fresh.workers()).values():     # every id and URL whole on some line
            assert any(w.id in line.split() or f"id: {w.id}" in line for line in out.splitlines()), (w.id, out)
            assert w.url in out, (w.url, out)


async def test_add_refuses_to_overwrite_an_id_or_url_unless_replace(fresh):
    before = await fresh.workers()
    url_a = before["a"].url
    rc, _, err = await ctl(fresh, "add", "http://127.0.0.1:9", "--id", "a")
    assert rc == 4 and "ALREADY_EXISTS" in err and "--replace" in err
    rc, _, err = await ctl(fresh, "add", url_a, "--id", "another")
    assert rc == 4 and "ALREADY_EXISTS" in err
    after = await fresh.workers()
    assert after["a"].url == url_a and "another" not in after
    for bad in ("not a url", "ftp://host:1", "http://host:99999", "http://"):
        rc, _, err = await ctl(fresh, "add", bad)
        assert rc == 2 and "URL" in err, bad
    assert set(await fresh.workers()) == set(before)

    # --replace with the same URL keeps the operator's weight
    await ctl(fresh, "weight", "b", "3")
    rc, out, err = await ctl(fresh, "add", before["b"].url, "--id", "b", "--replace", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["weight"] == 3.0 and data["checked"] is True and data["check_error"] is None


async def test_add_reports_a_failed_first_check_and_routes_nothing_there(fresh, http):
    rc, out, err = await ctl(fresh, "add", "http://127.0.0.1:9", "--id", "dead", "--json", "--force")
    assert rc == 0, err
    data = json.loads(out)
    assert data["checked"] is True and data["check_error"] and data["status"] == "unhealthy"
    for _ in range(5):
        async with http.post(fresh.url + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                  "max_tokens": 1}) as r:
            assert r.status == 200
    assert (await fresh.workers())["dead"].placements_total == 0


async def test_drain_wait_lets_in_flight_finish_and_places_nothing_new(fresh, http):
    await ctl(fresh, "weight", "b", "0")                  # the slow request goes to a
    await fresh.sim_post("a", "/sim/faults", {"delay_s": 2.0, "count": 1})
    slow = asyncio.ensure_future(http.post(fresh.url + "/v1/completions",
                                           json={"model": MODEL, "prompt": "slow", "max_tokens": 2}))
    try:
        await wait_until(lambda: _inflight(fresh, "a", 1), what="the slow request on a")
        await ctl(fresh, "weight", "b", "1")
        drain = asyncio.ensure_future(ctl(fresh, "drain", "a", "--wait", "--poll", "0.1", "--wait-timeout", "30"))
        await wait_until(lambda: _draining(fresh, "a"), what="a draining")
        placed_a = (await fresh.workers())["a"].placements_total
        for i in range(8):
            async with http.post(fresh.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": f"new {i}", "max_tokens": 1}) as r:
                assert r.status == 200
        assert not drain.done(), "drain --wait returned while a request was in flight"
        resp = await slow
        assert resp.status == 200 and (await resp.json())["choices"]
        rc, out, err = await drain
        assert rc == 0 and "drained, idle" in out, (out, err)
        after = await fresh.workers()
        assert after["a"].placements_total == placed_a and after["a"].load.inflight_requests == 0
        assert after["b"].placements_total >= 8
    finally:
        if not slow.done():
            slow.cancel()


async def _inflight(cluster: Cluster, wid: str, n: int) -> bool:
    return (await cluster.workers())[wid].load.inflight_requests >= n


async def _draining(cluster: Cluster, wid: str) -> bool:
    return (await cluster.workers())[wid].draining


async def test_weight_zero_takes_effect_on_the_next_request(fresh, http):
    rc, _, err = await ctl(fresh, "weight", "a", "0")
    assert rc == 0, err
    before = (await fresh.workers())["a"].placements_total
    for i in range(10):   # no wait: placement happens in the control plane, at once
        async with http.post(fresh.url + "/v1/completions", json={"model": MODEL, "prompt": f"p{i}",
                                                                  "max_tokens": 1}) as r:
            assert r.status == 200
    assert (await fresh.workers())["a"].placements_total == before


async def test_explain_prompt_shows_match_depth(fresh, http, tok_dir):
    async with http.post(fresh.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                              "max_tokens": 1}) as r:
        assert r.status == 200
    ran_on = [n for n in fresh.sims if await fresh.sim_requests(n)][0]
    rc, out, err = await ctl(fresh, "explain", "--model", MODEL, "--prompt", PROMPT, "--tokenizer", str(tok_dir),
                             "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["chain_blocks"] >= 2 and data["prompt_tokens_source"] == "tokenized"
    cands = {c["worker_id"]: c for c in data["stages"][0]["candidates"]}
    assert cands[ran_on]["match_blocks"] == data["chain_blocks"]
    other = next(n for n in fresh.sims if n != ran_on)
    assert cands[other]["match_blocks"] == 0
    assert data["chosen"]["decode"] == ran_on
    rc, out, err = await ctl(fresh, "explain", "--model", MODEL, "--prompt", PROMPT, "--tokenizer", str(tok_dir))
    assert rc == 0 and f"{data['chain_blocks']}/{data['chain_blocks']}" in out, out


async def test_explain_messages_file(fresh, tok_dir, tmp_path):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": PROMPT}]))
    rc, out, err = await ctl(fresh, "explain", "--model", MODEL, "--messages", str(path), "--tokenizer",
                             str(tok_dir), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["prompt_tokens"] > 30 and data["chain_blocks"] >= 2
    assert all(isinstance(c["match_blocks"], int) for c in data["stages"][0]["candidates"])


async def test_stats_and_events(fresh, http):
    async with http.post(fresh.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200
    rc, out, err = await ctl(fresh, "stats", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["placements_total"] >= 1 and data["workers"] == 2 and data["sessions"]["opened"] >= 1
    assert data["kv_hash"]["enabled"] is True and data["queue_depth"] is None
    rc, out, err = await ctl(fresh, "stats")
    assert rc == 0 and "data-plane sessions" in out
    rc, out, err = await ctl(fresh, "events", "--interval", "0.1", "--json")
    assert rc == 0, err
    rows = {r["worker_id"]: r for r in json.loads(out)["workers"]}
    assert set(rows) == {"a", "b"} and rows["a"]["exact"] is False and rows["a"]["last_seq"] is None
    rc, out, err = await ctl(fresh, "events", "--interval", "0")
    assert rc == 0 and "approximate" in out


async def test_changes_reach_every_data_plane_at_once(fresh, http):
    """Two data-plane nodes: a weight and a drain set through omni-ctl hold for the very next
    request on each (placement happens in the control plane)."""
    dp2 = fresh.group.start("dataplane-2", ["dataplane", "--port", "0", "--controlplane", fresh.cp.address])
    try:
        for change, undo in ((("weight", "a", "0"), ("weight", "a", "1")), (("drain", "a"), ("undrain", "a"))):
            rc, _, err = await ctl(fresh, *change)
            assert rc == 0, err
            before = (await fresh.workers())["a"].placements_total
            for url in (fresh.url, dp2.url):
                for i in range(5):
                    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"q{i}",
                                                                        "max_tokens": 1}) as r:
                        assert r.status == 200
            assert (await fresh.workers())["a"].placements_total == before, change
            rc, _, err = await ctl(fresh, *undo)
            assert rc == 0, err
    finally:
        await asyncio.to_thread(fresh.group.stop, dp2)
