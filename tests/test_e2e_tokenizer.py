"""The data plane tokenizes once: exact counts and hashes for placement, ids to the engines."""

from __future__ import annotations

import pytest

from dataplane.tokenizer import Tokenizer
from tests.conftest import Cluster, start_cluster, wait_until
from tests.data.tokenizer.fixture_dirs import build

MODEL = "sim-model"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build("tiny_llama", tmp_path_factory.mktemp("tok") / "tiny_llama")


@pytest.fixture(scope="module")
def cluster(tok_dir):
    c = start_cluster({"a": "both", "b": "both"}, policy="cache_aware", dp_args=["--tokenizer", str(tok_dir)])
    yield c
    c.group.close()


async def test_completions_prompt_reaches_the_engine_as_the_engines_token_ids(cluster, tok_dir, http):
    await wait_until(cluster.all_idle, what="idle")
    await cluster.clear_sim_requests()
    text = "The data plane tokenizes this prompt exactly once."
    expected = Tokenizer.from_dir(tok_dir).encode_prompt(text)
    async with http.post(cluster.url + "/v1/completions",
                         json={"model": MODEL, "prompt": text, "max_tokens": 2}) as r:
        assert r.status == 200
        usage = (await r.json())["usage"]
    seen = [x for n in cluster.sims for x in await cluster.sim_requests(n)]
    assert len(seen) == 1 and seen[0]["body"]["prompt"] == expected
    assert usage["prompt_tokens"] == len(expected)


async def test_long_and_short_prompts_of_a_burst_reach_the_engines_as_their_ids(cluster, tok_dir, http):
    """Long prompts go to the tokenizing threads, short ones stay inline: both give the engines
    the ids inline tokenization gives, however the burst interleaves them."""
    import asyncio

    await wait_until(cluster.all_idle, what="idle")
    await cluster.clear_sim_requests()
    tok = Tokenizer.from_dir(tok_dir)
    texts = [f"Request {i} of a burst. " + f"long context paragraph {i}. " * (400 if i % 2 else 1)
             for i in range(6)]
    assert {len(t) >= tok.async_threshold_chars for t in texts} == {True, False}

    async def send(text: str) -> None:
        async with http.post(cluster.url + "/v1/completions",
                             json={"model": MODEL, "prompt": text, "max_tokens": 2}) as r:
            assert r.status == 200

    await asyncio.gather(*(send(t) for t in texts))
    seen = sorted([x["body"]["prompt"] for n in cluster.sims for x in await cluster.sim_requests(n)])
    assert seen == sorted(tok.backend.encode(t).ids for t in texts)   # a whole encode each


async def _dp_metric(cluster: Cluster, http, name: str) -> float:
    async with http.get(cluster.url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_a_follow_up_turn_reuses_its_prefix_ids_and_the_engine_gets_the_whole_encode(cluster, tok_dir, http):
    """The second turn's ids come mostly from the data plane's prefix-id cache (/metrics says
    how many), and the engine receives exactly the ids a whole encode gives."""
    await wait_until(cluster.all_idle, what="idle")
    await cluster.clear_sim_requests()
    tok = Tokenizer.from_dir(tok_dir, prefix_cache_ids=0)
    whole = tok.backend.encode      # one whole encode: not the prefix cache, not pieces
    first = "".join(f"User: question {i} about the data plane?\nAssistant: answer {i}, briefly.\n"
                    for i in range(60))
    turns = [first, first + "User: and one more question?\nAssistant:"]
    reused_before = await _dp_metric(cluster, http, "omni_dp_tokenizer_prefix_ids_reused_total")
    for text in turns:
        async with http.post(cluster.url + "/v1/completions",
                             json={"model": MODEL, "prompt": text, "max_tokens": 2}) as r:
            assert r.status == 200
    seen = [x["body"]["prompt"] for n in cluster.sims for x in await cluster.sim_requests(n)]
    assert sorted(seen) == sorted(whole(t).ids for t in turns)
    reused = await _dp_metric(cluster, http, "omni_dp_tokenizer_prefix_ids_reused_total") - reused_before
    assert reused > 0.8 * len(whole(first).ids)
    assert await _dp_metric(cluster, http, "omni_dp_tokenizer_prefix_ids_held") > 0


async def _predicted_hit_blocks(cluster: Cluster, http) -> float:
    async with http.get(f"http://127.0.0.1:{cluster.cp.info['http_port']}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("omni_kv_predicted_hit_blocks_total"))


async def test_chat_body_is_untouched_but_placement_uses_its_tokens(cluster: Cluster, http):
    await wait_until(cluster.all_idle, what="idle")
    await cluster.clear_sim_requests()
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello " * 60}], "max_tokens": 2}
    placed_on = set()
    hits_before = await _predicted_hit_blocks(cluster, http)
    for _ in range(3):
        async with http.post(cluster.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
    # The placements knew the prompt's blocks (from the data plane's tokens): the 2nd and 3rd
    # were predicted to hit what the 1st left. Without tokens nothing can be predicted, and
    # three idle-time placements on one worker alone would prove nothing (ties go to one worker).
    assert await _predicted_hit_blocks(cluster, http) > hits_before
    for n in cluster.sims:
        reqs = await cluster.sim_requests(n)
        if reqs:
            placed_on.add(n)
            assert all(x["body"]["messages"] == body["messages"] for x in reqs)
    assert len(placed_on) == 1, "the same chat prompt should follow its cached blocks"

