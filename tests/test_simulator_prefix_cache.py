"""Simulator prefix cache, KV events and tokenization cost.

The block-pool and scheduler tests step ``Engine`` in-process (no real time); the wire tests
talk to real ``omni-proxy sim`` processes and check what a router sees: OpenAI usage, vLLM's
/metrics counters, and the ZMQ KV-event stream decoded with the control plane's own subscriber
and hashed with its own ``BlockHasher``.
"""

from __future__ import annotations

import json
import socket
import re

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from controlplane.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvhash.hashing import BlockHashConfig, BlockHasher
from controlplane.kvcache.subscriber import KVEventSource, KVEventSubscriber
from omni_proxy.launcher import Child, ProcessGroup
from simulator.block_pool import BlockPool, Cleared, Removed, Stored
from simulator.config import SimConfig
from simulator.engine import Engine, SimRequest
from simulator.kv_events import END_SEQ, KvEventPublisher, encode_batch, encode_events, is_bind_endpoint
from simulator.tokens import text_token_ids
from tests.conftest import wait_until

SEED = "7"           # the sims' PYTHONHASHSEED
EV_BLOCK = 4         # block size of the events sim (small, so prompts stay short)


# ---- in-process: block pool and scheduler ----------------------------------------------

def _engine(**kw) -> Engine:
    base = dict(block_size=4, num_gpu_blocks=16, max_model_len=64, python_hash_seed=SEED)
    return Engine(SimConfig(**{**base, **kw}))


def _req(rid: str, ids: list[int], max_tokens: int = 1, **kw) -> SimRequest:
    return SimRequest(request_id=rid, prompt_tokens=len(ids), max_tokens=max_tokens, rng=1, arrival=0.0,
                      token_ids=list(ids), **kw)


def _run(engine: Engine, *reqs: SimRequest) -> list[list[tuple[str, int]]]:
    """Submit and step until all finish; returns each step's prefill chunks."""
    for r in reqs:
        engine.submit(r)
    return _drain(engine, *reqs)


def _drain(engine: Engine, *reqs: SimRequest) -> list[list[tuple[str, int]]]:
    chunks = []
    for _ in range(200):
        if all(r.done for r in reqs):
            return chunks
        plan = engine.plan_step()
        chunks.append([(r.request_id, n) for r, n in plan.prefill])
        engine.complete_step(plan, 0.0)
    raise AssertionError("requests did not finish")


def test_hit_charges_only_uncached_tokens_and_never_the_last_token():
    engine = _engine()
    ids = list(range(1, 14))                      # 13 tokens: 3 full blocks + 1
    a = _req("a", ids)
    assert _run(engine, a) == [[("a", 13)]]
    assert a.cached_tokens == 0 and engine.pool.num_cached == 3 and engine.used_blocks == 0
    b = _req("b", ids)
    assert _run(engine, b) == [[("b", 1)]]      # 12 tokens reused, 1 computed
    assert b.cached_tokens == 12
    # A prompt that is exactly 3 blocks still recomputes its last token, so its last block too.
    c = _req("c", ids[:12])
    assert _run(engine, c) == [[("c", 4)]] and c.cached_tokens == 8
    t = engine.totals
    assert (t.prefix_cache_queries, t.prefix_cache_hits) == (13 + 13 + 12, 12 + 8)
    assert (t.prompt_tokens_local, t.prompt_tokens_cached) == (13 + 1 + 4, 20)


def test_cache_salt_separates_prefixes_and_generated_tokens_are_cached():
    engine = _engine()
    ids = list(range(1, 14))
    _run(engine, _req("a", ids))
    salted = _req("s", ids, cache_salt="tenant-1")
    assert _run(engine, salted) == [[("s", 13)]]  # a different chain: no hit
    hasher = BlockHasher(BlockHashConfig(block_size=4, python_hash_seed=SEED))
    assert salted.block_hashes == hasher.block_hashes(ids, cache_salt="tenant-1")
    # Output tokens extend the chain: 13 prompt + 3 computed outputs fill block 4.
    long = _req("l", list(range(100, 113)), max_tokens=5)
    _run(engine, long)
    all_ids = long.token_ids + long.output
    assert long.block_hashes == hasher.block_hashes(all_ids)
    assert engine.pool.get_cached(long.block_hashes[3]) is not None


def test_lru_evicts_tail_blocks_first_and_emits_events():
    engine = _engine(num_gpu_blocks=8, max_model_len=32)
    got: list = []
    engine.set_event_sink(got.extend)
    a = _req("a", list(range(1, 14)))            # 4 blocks (3 full, cached)
    _run(engine, a)
    assert [type(e) for e in got] == [Stored] and got[0].block_hashes == tuple(a.block_hashes)
    assert got[0].parent_block_hash is None and got[0].token_ids == tuple(range(1, 13))
    got.clear()
    b = _req("b", list(range(100, 125)))         # 25 tokens: 7 blocks -> evicts 3 of a's... tail first
    _run(engine, b)
    removed = [e.block_hash for e in got if isinstance(e, Removed)]
    assert removed == [a.block_hashes[2], a.block_hashes[1]]
    assert engine.pool.counters.evicted_blocks == 2
    assert engine.pool.get_cached(a.block_hashes[0]) is not None   # the head survives
    c = _req("c", list(range(1, 14)))
    _run(engine, c)
    assert c.cached_tokens == 4


def test_preempted_request_reuses_its_cached_prefix():
    engine = _engine(num_gpu_blocks=4, max_model_len=16)
    a, b = _req("a", list(range(1, 7)), 6), _req("b", list(range(50, 56)), 6)
    _run(engine, a, b)
    assert engine.totals.preemptions >= 1
    # Only first admissions count in vLLM's prefix-cache stats.
    assert engine.totals.prefix_cache_queries == 12


def test_transferred_kv_is_cached_and_local_hits_shrink_the_transfer():
    engine = _engine()
    ids = list(range(1, 18))                      # 17 tokens: 4 full blocks
    d = _req("d", ids, 2, external_tokens=17)     # KV received from a prefill node
    chunks = _run(engine, d)
    assert chunks[0] == []                        # no prefill: the first step decodes
    assert d.cached_tokens == 17 and engine.pool.num_cached == 4
    assert (engine.totals.prompt_tokens_external, engine.totals.prompt_tokens_local) == (17, 0)
    again = _req("d2", ids, 2, external_tokens=17)
    assert engine.cached_prefix_tokens(again) == 16
    _run(engine, again)
    assert (engine.totals.prompt_tokens_external, engine.totals.prompt_tokens_cached) == (17 + 1, 16)


def test_held_kv_stays_cached_after_release():
    engine = _engine()
    holds = []
    p = _req("p", list(range(1, 14)), hold_kv=lambda req, held: holds.append(held))
    _run(engine, p)
    (held,) = holds
    assert len(held.blocks) == 4 and engine.used_blocks == 4 and engine.held_blocks == 4
    assert not engine.reset_prefix_cache()        # refused while blocks are held (as vLLM)
    engine.release_held(held)
    engine.release_held(held)                     # idempotent
    assert engine.used_blocks == 0 and engine.pool.num_cached == 3
    assert engine.reset_prefix_cache() and engine.pool.num_cached == 0


def test_reset_running_requests_and_disabled_caching():
    engine = _engine()
    got: list = []
    engine.set_event_sink(got.extend)
    r = _req("r", list(range(1, 14)), 10)
    engine.submit(r)
    engine.complete_step(engine.plan_step(), 0.0)
    assert not engine.reset_prefix_cache()
    assert engine.reset_prefix_cache(reset_running_requests=True)
    assert isinstance(got[-1], Cleared) and engine.totals.preemptions == 1
    _drain(engine, r)
    assert len(r.output) == 10
    off = _engine(enable_prefix_caching=False)
    off.set_event_sink(got.extend)
    got.clear()
    ids = list(range(1, 14))
    _run(off, _req("a", ids))
    b = _req("b", ids)
    assert _run(off, b) == [[("b", 13)]] and b.cached_tokens == 0 and got == []
    assert off.totals.prefix_cache_queries == 0  # vLLM does not count lookups it does not make


def test_pool_keeps_duplicate_blocks_like_vllm():
    pool = BlockPool(4, record_events=True)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    h = b"x" * 32
    pool.cache_full_blocks(a, [h], 0, 1, [1, 2], 2)
    pool.cache_full_blocks(b, [h], 0, 1, [1, 2], 2)
    assert pool.num_cached == 2 and pool.get_cached(h) is not None
    pool.free_blocks(a + b)
    pool.get_new_blocks(4)                        # evicts both copies: one BlockRemoved each
    assert [type(e) for e in pool.take_events()] == [Stored, Stored, Removed, Removed]
    assert pool.get_cached(h) is None and pool.num_cached == 0


# ---- in-process: wire encoding and replay framing --------------------------------------

def test_encoding_round_trips_through_the_control_plane_decoder():
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    events = [Stored((h1, h2), None, tuple(range(8)), 4, (("salt",), None)), Removed(h1), Cleared()]
    for fmt in ("map", "array"):
        batch = decode_batch(encode_batch(encode_events(events, fmt=fmt), ts=1.5))
        stored, removed, cleared = batch.events
        assert batch.ts == 1.5 and batch.data_parallel_rank == 0
        assert stored.block_hashes == (int.from_bytes(h1[-8:], "big"), int.from_bytes(h2[-8:], "big"))
        assert stored.parent_block_hash is None and stored.token_ids == tuple(range(8))
        assert stored.block_size == 4 and stored.medium == "GPU" and stored.group_idx == 0
        assert stored.extra_keys == (["salt"], None) and stored.kv_cache_spec_kind == "full_attention"
        assert removed == BlockRemoved(block_hashes=stored.block_hashes[:1], medium="GPU", group_idx=0)
        assert cleared == AllBlocksCleared()
    # The exact shapes: vLLM >= v0.26 maps (None-default fields omitted), older positional arrays.
    raw = msgpack.unpackb(encode_batch(encode_events(events, fmt="map"), ts=1.5))
    assert raw[0] == 1.5 and raw[2] == 0 and list(raw[1][0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [int.from_bytes(h1[-8:], "big")],
                         "medium": "GPU", "group_idx": 0}
    raw = msgpack.unpackb(encode_batch(encode_events(events, fmt="array"), ts=1.5))
    assert raw[1][0][0] == "BlockStored" and len(raw[1][0]) == 12 and raw[1][2] == ["AllBlocksCleared"]
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests.
    raw = msgpack.unpackb(encode_batch(encode_events(events[1:2], int_hashes=False)))
    assert raw[1][0]["block_hashes"] == [h1]


# vllm 0.32.0's own encoder (msgspec) on the same events, built from vllm.distributed.kv_events'
# KVEventBatch/BlockStored/BlockRemoved/AllBlocksCleared (extra_keys via to_event_extra_keys):
#   BlockStored([2**64-1, 5], None, range(8), 4, extra [("salt",), None]), BlockStored([7], 5, [1..4], 4,
#   extra [None]), BlockRemoved([5]), AllBlocksCleared(); ts=1.5, data_parallel_rank=0.
VLLM_032_BATCH = bytes.fromhex(
    "93cb3ff8000000000000948ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfffffffffffffffff"
    "05b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980001020304050607aa626c6f636b5f73697a6504a7"
    "6c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a473616c74c0a96772"
    "6f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c6f"
    "636b53746f726564ac626c6f636b5f6861736865739107b1706172656e745f626c6f636b5f6861736805a9746f6b656e5f696473"
    "9401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa657874"
    "72615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e7469"
    "6f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da3475055a967726f75"
    "705f6964780081a474797065b0416c6c426c6f636b73436c656172656400")


def test_map_payload_is_byte_identical_to_vllm_032():
    def h(v: int) -> bytes:  # a digest whose 64-bit event form is v
        return v.to_bytes(32, "big")

    events = [Stored((h(2**64 - 1), h(5)), None, tuple(range(8)), 4, (("salt",), None)),
              Stored((h(7),), h(5), (1, 2, 3, 4), 4, (None,)), Removed(h(5)), Cleared()]
    assert encode_batch(encode_events(events), ts=1.5) == VLLM_032_BATCH


def test_bind_or_connect_heuristic():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("inproc://x")
    assert not is_bind_endpoint("tcp://0.0.0.0:5557") and not is_bind_endpoint("tcp://router:5557")
    # port 0 can only mean "bind a free port": nobody can be connected to on it
    assert is_bind_endpoint("tcp://127.0.0.1:0") and is_bind_endpoint("tcp://127.0.0.1:*")


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*"])
async def test_loopback_free_port_endpoints_bind_and_report_the_port(endpoint):
    """What a launcher uses instead of picking a port for the sim and hoping it stays free."""
    pub = KvEventPublisher(SimConfig(kv_events_endpoint=endpoint, kv_events_replay_endpoint=endpoint))
    pub.start()
    try:
        assert pub.port and pub.replay_port and pub.port != pub.replay_port
        assert pub.endpoint == f"tcp://127.0.0.1:{pub.port}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{pub.replay_port}"
        with socket.socket() as s:                 # really bound: the port is taken
            with pytest.raises(OSError):
                s.bind(("127.0.0.1", pub.port))
    finally:
        await pub.close()


@pytest.mark.parametrize("fmt", ["map", "array"])
async def test_replay_frames(fmt):
    cfg = SimConfig(kv_events_endpoint="tcp://*:0", kv_events_replay_endpoint="tcp://*:0", kv_events_topic="kv@t",
                    kv_events_format=fmt,
                    kv_events_buffer_steps=3)
    pub = KvEventPublisher(cfg)
    pub.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(5):                        # the buffer keeps the last 3: seqs 2, 3, 4
            pub.publish([Removed(bytes([i]) * 32)])
        dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
        await dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = []
        while True:
            assert await dealer.poll(5000), "no replay answer"
            frames = await dealer.recv_multipart()
            replies.append(frames)
            if frames[-2] == END_SEQ:
                break
        body, end = replies[:-1], replies[-1]
        topic = [b"kv@t"] if fmt == "map" else []
        assert [f[:-1] for f in body] == [[b"", *topic, s.to_bytes(8, "big")] for s in (3, 4)]
        assert end == ([b"", b"", END_SEQ, b""] if fmt == "map" else [b"", END_SEQ, b""])
        removed = decode_batch(body[0][-1]).events[0]
        assert removed.block_hashes == (int.from_bytes(bytes([3]) * 8, "big"),)
    finally:
        dealer.close(0)
        ctx.term()
        await pub.close()


# ---- real sim processes ------------------------------------------------------------------

@pytest.fixture(scope="module")
def sims():
    """``ev``: tiny KV pool, block size 4, KV events on free ports; ``b``: defaults."""
    with ProcessGroup() as group:
        env = {"PYTHONHASHSEED": SEED}
        yield {
            "ev": group.start("sim-ev", ["sim", "--port", "0", "--block-size", str(EV_BLOCK), "--num-gpu-blocks", "16",
                                         "--max-model-len", "64", "--kv-events-endpoint", "tcp://*:0",
                                         "--kv-events-replay-endpoint", "tcp://*:0", "--kv-events-topic", "kv@ev"],
                              env=env),
            "b": group.start("sim-b", ["sim", "--port", "0"], env=env),
        }


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def _state(http: aiohttp.ClientSession, child: Child) -> dict:
    async with http.get(child.url + "/sim/state") as resp:
        assert resp.status == 200
        return await resp.json()


async def _post(http: aiohttp.ClientSession, child: Child, path: str, body: dict) -> dict:
    async with http.post(child.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _metric(http: aiohttp.ClientSession, child: Child, name: str) -> float:
    async with http.get(child.url + "/metrics") as resp:
        text = await resp.text()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


_probes = iter(range(100_000, 10**9, 1000))


class _Collector:
    """A KVEventSubscriber on one sim, collecting every decoded event in order."""

    def __init__(self, child: Child | None, source: KVEventSource | None = None) -> None:
        self.events: list = []
        self.resets = 0
        if source is None:
            assert child is not None
            info = child.info
            source = KVEventSource(engine_key=child.name, endpoint=f"tcp://127.0.0.1:{info['kv_events_port']}",
                                   replay_endpoint=f"tcp://127.0.0.1:{info['kv_replay_port']}", topic=b"kv@ev")
        self.sub = KVEventSubscriber(source, self._on_events, self._on_reset, replay_timeout_s=20.0)

    def _on_events(self, engine: str, dp_rank: int | None, events: tuple) -> None:
        self.events.extend(events)

    def _on_reset(self, engine: str) -> None:
        self.resets += 1

    async def start(self, http: aiohttp.ClientSession, child: Child) -> None:
        """Subscribe, then send fresh prompts until one batch arrived live (ZMQ's slow joiner)."""
        await self.sub.start()
        await self.probe(http, child)

    async def probe(self, http: aiohttp.ClientSession, child: Child) -> None:
        probe = next(_probes)
        for _ in range(100):
            if self.sub.counters.received:
                return
            probe += 50
            await _post(http, child, "/v1/completions", {"prompt": list(range(probe, probe + 20)), "max_tokens": 1})
            try:
                await wait_until(self._received, timeout=0.5, interval=0.02, what="a live batch")
            except AssertionError:
                continue
        assert self.sub.counters.received, "no KV event batch arrived for 100 fresh prompts"

    async def _received(self) -> bool:
        return self.sub.counters.received > 0

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


async def test_repeated_prompt_reports_cached_tokens_and_moves_hit_counters(sims, http):
    b = sims["b"]
    text = " ".join(f"w{i}" for i in range(40))   # 40 toy tokens: 2 full blocks of 16 reusable
    q0 = await _metric(http, b, "vllm:prefix_cache_queries_total")
    h0 = await _metric(http, b, "vllm:prefix_cache_hits_total")
    s0 = await _state(http, b)
    first = await _post(http, b, "/v1/completions", {"prompt": text, "max_tokens": 2})
    second = await _post(http, b, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert first["usage"]["prompt_tokens"] == 40 and first["usage"]["prompt_tokens_details"] is None
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert await _metric(http, b, "vllm:prefix_cache_queries_total") - q0 == 80
    assert await _metric(http, b, "vllm:prefix_cache_hits_total") - h0 == 32
    s1 = await _state(http, b)
    assert s1["prefix_cache_hits_tokens"] - s0["prefix_cache_hits_tokens"] == 32
    assert s1["prefix_cache_queries_tokens"] - s0["prefix_cache_queries_tokens"] == 80
    assert s1["prompt_tokens_cached"] - s0["prompt_tokens_cached"] == 32
    assert s1["cached_blocks"] >= 2 and s1["used_blocks"] == 0

    # Chat: the toy-rendered conversation is hashed too; a follow-up turn that repeats the first
    # turn and the answer (the answer's words are the ids the engine generated) reuses both.
    messages = [{"role": "user", "content": text}]
    c1 = await _post(http, b, "/v1/chat/completions", {"messages": messages, "max_tokens": 20})
    answer = c1["choices"][0]["message"]["content"]
    follow = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    c2 = await _post(http, b, "/v1/chat/completions", {"messages": follow, "max_tokens": 2})
    assert c1["usage"]["prompt_tokens_details"] is None
    # c1 cached 4 blocks: 47 prompt tokens (3 template + 40 + 1 + the 3-token generation prompt,
    # which renders like the next assistant turn's header) and 17 of the 19 computed outputs.
    assert c2["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


async def test_tokenization_cost_applies_to_text_prompts_only(sims, http):
    b = sims["b"]
    s0 = await _state(http, b)
    await _post(http, b, "/v1/completions", {"prompt": list(range(500, 700)), "max_tokens": 1})
    s1 = await _state(http, b)
    assert s1["tokenize_busy_s"] == s0["tokenize_busy_s"] and s1["tokenized_chars"] == s0["tokenized_chars"]
    text = "tokenize me " * 50
    await _post(http, b, "/v1/completions", {"prompt": text, "max_tokens": 1})
    s2 = await _state(http, b)
    assert s2["tokenized_chars"] - s1["tokenized_chars"] == len(text)
    assert s2["tokenize_busy_s"] - s1["tokenize_busy_s"] == pytest.approx(len(text) * 0.4e-6, rel=1e-3)
    assert s2["config"]["tokenize_us_per_char"] == 0.4


async def test_block_stored_hashes_are_the_routers_hashes(sims, http):
    ev = sims["ev"]
    assert ev.info["kv_events_port"] and ev.info["kv_replay_port"]
    col = _Collector(ev)
    await col.start(http, ev)
    try:
        hasher = BlockHasher(BlockHashConfig(block_size=EV_BLOCK, algo="sha256", python_hash_seed=SEED))
        ids = list(range(1, 14))                  # token ids, as the router sends them
        await _post(http, ev, "/v1/completions", {"prompt": ids, "max_tokens": 1})
        salted = list(range(20, 29))
        await _post(http, ev, "/v1/completions", {"prompt": salted, "max_tokens": 1, "cache_salt": "t1"})
        # The subscriber passes on hashes, never token ids (it skips them): wait for the two
        # prompts' blocks there, then read the events whole from the replay service.
        want = (hasher.event_hashes(ids)[-1], hasher.event_hashes(salted, cache_salt="t1")[-1])
        await wait_until(lambda: _stored(col, *want), timeout=45,
                         what="the two prompts' BlockStored events")
        _, payloads = await _replay(ev, 0)
        full = [e for p in payloads for e in decode_batch(p).events if isinstance(e, BlockStored)]
        # Pick the events by their tokens: a late start-up probe's batch may arrive in between.
        plain = next(e for e in full if list(e.token_ids) == ids[:12])
        salt = next(e for e in full if list(e.token_ids) == salted[:8])
        assert list(plain.block_hashes) == hasher.event_hashes(ids)
        assert plain.parent_block_hash is None and list(plain.token_ids) == ids[:12]
        assert plain.block_size == EV_BLOCK and plain.extra_keys == (None, None, None)
        assert list(salt.block_hashes) == hasher.event_hashes(salted, cache_salt="t1")
        assert salt.extra_keys == (["t1"], None)
        # A text prompt hashes its toy-tokenized ids.
        await _post(http, ev, "/v1/completions", {"prompt": "alpha beta gamma delta epsilon", "max_tokens": 1})
        text_ids = text_token_ids("alpha beta gamma delta epsilon")
        want = hasher.event_hashes(text_ids)[0]
        await wait_until(lambda: _stored(col, want), timeout=45, what="the text prompt's block")
        assert col.resets == 0 and col.sub.counters.malformed == 0
    finally:
        await col.sub.stop()


async def _stored(col: _Collector, *hashes: int) -> bool:
    seen = {h for e in col.of(BlockStored) for h in e.block_hashes}
    return all(h in seen for h in hashes)


async def test_eviction_replay_and_reset(sims, http):
    ev = sims["ev"]
    col = _Collector(ev)
    await col.start(http, ev)
    try:
        s0 = await _state(http, ev)
        # 16 blocks of 4: 6 prompts of 13 tokens need 4 blocks each, so the oldest cached ones go.
        for i in range(6):
            await _post(http, ev, "/v1/completions", {"prompt": list(range(1000 + 100 * i, 1013 + 100 * i)),
                                                      "max_tokens": 1})
        s1 = await _state(http, ev)
        assert s1["evicted_blocks"] > s0["evicted_blocks"]
        evicted = s1["evicted_blocks"] - s0["evicted_blocks"]
        # (the subscriber merges a run of one-block removals into one event: count blocks)
        await wait_until(lambda: _removed(col, evicted), timeout=45, what="every evicted block's BlockRemoved")
        stored = {h for e in col.of(BlockStored) for h in e.block_hashes}
        assert all(h in stored for e in col.of(BlockRemoved) for h in e.block_hashes)

        # Replay from seq 0 returns every buffered batch, in order, ending with END_SEQ; decoded
        # whole, it shows the engine's own form: one BlockRemoved per evicted block.
        seqs, payloads = await _replay(ev, 0)
        assert seqs == list(range(len(seqs))) and len(seqs) == s1["kv_events_batches"]
        replayed = [e for p in payloads for e in decode_batch(p).events]
        removed = [e for e in replayed if isinstance(e, BlockRemoved)]
        assert all(len(e.block_hashes) == 1 for e in removed) and len(removed) >= evicted
        assert removed[-1].block_hashes[-1] == col.of(BlockRemoved)[-1].block_hashes[-1]

        # reset_prefix_cache: AllBlocksCleared, then the same prompt misses.
        ids = list(range(1500, 1513))
        await _post(http, ev, "/v1/completions", {"prompt": ids, "max_tokens": 1})
        assert await _post(http, ev, "/reset_prefix_cache", {}) == {"success": True}
        await wait_until(lambda: _cleared(col), timeout=45, what="AllBlocksCleared")
        s2 = await _state(http, ev)
        assert s2["cached_blocks"] == 0 and s2["prefix_cache_resets"] == s1["prefix_cache_resets"] + 1
        again = await _post(http, ev, "/v1/completions", {"prompt": ids, "max_tokens": 1})
        assert again["usage"]["prompt_tokens_details"] is None
        assert col.resets == 0
    finally:
        await col.sub.stop()


async def _removed(col: _Collector, count: int) -> bool:
    return sum(len(e.block_hashes) for e in col.of(BlockRemoved)) >= count


async def _cleared(col: _Collector) -> bool:
    return bool(col.of(AllBlocksCleared))


async def _replay(child: Child, start: int) -> tuple[list[int], list[bytes]]:
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{child.info['kv_replay_port']}")
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        seqs, payloads = [], []
        while True:
            assert await dealer.poll(5000), "replay did not answer"
            frames = await dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return seqs, payloads
            assert frames[:2] == [b"", b"kv@ev"]
            seqs.append(int.from_bytes(frames[2], "big"))
            payloads.append(frames[3])
    finally:
        dealer.close(0)
        ctx.term()


async def test_subscriber_backfills_a_gap_through_replay(sims, http):
    """Events published while nobody listened come back through replay when a subscriber joins."""
    ev = sims["ev"]
    before = (await _state(http, ev))["kv_events_batches"]
    await _post(http, ev, "/v1/completions", {"prompt": list(range(7000, 7013)), "max_tokens": 1})
    col = _Collector(ev)
    await col.start(http, ev)
    try:
        async def backfilled() -> bool:
            return col.sub.counters.replayed >= before + 1

        await wait_until(backfilled, timeout=45, what="the missed batches to come back through replay")
        hasher = BlockHasher(BlockHashConfig(block_size=EV_BLOCK, python_hash_seed=SEED))
        assert hasher.event_hashes(list(range(7000, 7013)))[0] in {h for e in col.of(BlockStored)
                                                                   for h in e.block_hashes}
    finally:
        await col.sub.stop()
    assert (await _state(http, ev))["kv_events_replays"] >= 1


async def test_connecting_publisher_from_vllm_kv_events_config(http):
    """No ``*`` in the endpoint: the sim connects to a subscriber that binds (llm-d style), and
    vLLM's ``--kv-events-config`` JSON works as a drop-in."""
    col = _Collector(None, KVEventSource(engine_key="kv@pod@m", endpoint="tcp://127.0.0.1:0", bind=True,
                                         key_by_topic=True))
    await col.sub.start()
    try:
        port = int(col.sub.endpoint.rsplit(":", 1)[1])
        conf = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                "topic": "kv@pod@m"}
        with ProcessGroup() as group:
            child = group.start("sim-connect", ["sim", "--port", "0", "--kv-events-format", "array",
                                                "--kv-events-config", json.dumps(conf)],
                                env={"PYTHONHASHSEED": SEED})
            assert child.info["kv_events_endpoint"] == f"tcp://127.0.0.1:{port}"
            assert child.info["kv_replay_port"] is None
            await col.probe(http, child)
            ids = list(range(3000, 3040))
            await _post(http, child, "/v1/completions", {"prompt": ids, "max_tokens": 1})
            want = BlockHasher(BlockHashConfig(block_size=16, python_hash_seed=SEED)).event_hashes(ids)
            await wait_until(lambda: _stored(col, want[0]), timeout=45, what="the prompt's BlockStored")
            (ev,) = [e for e in col.of(BlockStored) if want[0] in e.block_hashes]
            assert list(ev.block_hashes) == want and ev.medium == "GPU"  # decoded from the array form
    finally:
        await col.sub.stop()

