"""Pending prefixes: a prompt placed on a worker with KV events counts there before its events.

Without them a follow-up turn placed while its predecessor is still queued or prefilling sees
no match and goes elsewhere (docs/benchmarks/slo_replay_notes.md).
"""

from __future__ import annotations

import asyncio
import random

from controlplane.kvcache.events import BlockRemoved, BlockStored
from controlplane.kvcache.manager import KVCache, KVCacheConfig
from tests.test_dp_ranks import entry, placer_of, spec

CHAIN = [101, 102, 103, 104, 105, 106]


def evented(wid, **kw):
    return spec(wid, kv_events=f"tcp://{wid}:5557", **kw)


def test_a_placed_prompt_counts_on_its_worker_until_its_events():
    kv = KVCache(KVCacheConfig())
    a, b = evented("a"), evented("b")
    kv.placed(a, CHAIN, 0)
    assert kv.match(CHAIN + [107], [a, b]) == {"a": 6}
    # A prompt sharing only part of it: counted at the last multiple of routed_stride (16) blocks
    # of the shared part, here none (kvcache/routed.py); with every block marked, exactly.
    assert kv.match(CHAIN[:3] + [999], [a, b]) == {}
    dense = KVCache(KVCacheConfig(routed_stride=1))
    dense.placed(a, CHAIN, 0)
    assert dense.match(CHAIN[:3] + [999], [a, b]) == {"a": 3}
    group = kv.group_match(CHAIN, ("a", "b"), 2, random.Random(0))
    assert group.top == {"a": 6} and group.depths(["a", "b"]) == {"a": 6}
    # The events, once they come, are deeper or equal: the deeper of the two counts.
    kv.exact.apply("b", 0, [BlockStored(block_hashes=tuple(CHAIN), parent_block_hash=None,
                                        token_ids=(), block_size=16)])
    assert kv.match(CHAIN, [a, b]) == {"a": 6, "b": 6}


def test_pending_prefixes_expire_after_pending_ttl_s(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("controlplane.kvcache.routed.time.monotonic", lambda: now[0])
    kv = KVCache(KVCacheConfig(pending_ttl_s=10.0))
    a = evented("a")
    kv.placed(a, CHAIN, 0)
    now[0] += 9.0
    assert kv.match(CHAIN, [a]) == {"a": 6}
    now[0] += 2.0
    assert kv.match(CHAIN, [a]) == {}
    assert kv.pending.index.size() == 0


def test_pending_ttl_zero_turns_it_off():
    kv = KVCache(KVCacheConfig(pending_ttl_s=0))
    a = evented("a")
    kv.placed(a, CHAIN, 0)
    assert kv.pending is None and kv.match(CHAIN, [a]) == {}
    assert kv.group_match(CHAIN, ("a",), 1, random.Random(0)).top == {}


def test_workers_without_events_are_remembered_by_routing_not_as_pending():
    kv = KVCache(KVCacheConfig())
    plain = spec("p")
    kv.placed(plain, CHAIN, 0)
    assert kv.match(CHAIN, [plain]) == {"p": 6}
    assert kv.approx.size() == 1 and kv.pending.index.size() == 0     # one mark: the chain's end


def test_an_untracked_worker_ignores_its_pending_prefixes():
    kv = KVCache(KVCacheConfig())
    a = evented("a")
    kv.placed(a, CHAIN, 0)
    kv._untrack("a", "test")      # its events cannot be trusted any more: routing counts instead
    assert kv.match(CHAIN, [a]) == {}
    assert kv.group_match(CHAIN, ("a",), 1, random.Random(0)).top == {}


def test_unwatch_forgets_a_workers_pending_prefixes():
    kv = KVCache(KVCacheConfig())
    kv.placed(evented("a"), CHAIN, 0)
    asyncio.run(kv.unwatch("a"))
    assert kv.pending.index.size() == 0


async def test_a_follow_up_goes_where_its_predecessor_was_placed_before_any_event():
    workers = [evented(w) for w in "abcd"]
    placer, store, _ = await placer_of(*workers, policy="cache_aware")
    first = (await placer.place(entry("t1", CHAIN, tokens=96))).decode.worker_id
    # Other new prompts arrive in between and spread over the other workers by load.
    for i in range(3):
        await placer.place(entry(f"n{i}", [900 + 10 * i, 901 + 10 * i], tokens=32))
    follow = await placer.place(entry("t2", CHAIN + [107, 108], tokens=128, explain=True))
    assert follow.decode.worker_id == first, follow.explanation


def test_blocks_the_engine_removes_leave_its_pending_prefixes():
    kv = KVCache(KVCacheConfig(routed_stride=1))     # every block a mark: any removed block counts
    a = evented("a")
    kv.placed(a, CHAIN, 0)
    kv._on_events("a", None, [BlockRemoved(block_hashes=(CHAIN[0],))])
    assert kv.match(CHAIN, [a]) == {}


def test_removed_marks_leave_pending_prefixes_at_the_default_stride():
    """At routed_stride 16 a removal counts where the removed block is a mark (every 16th and the
    chain's last, which an engine freeing a request's blocks last first evicts among the first)."""
    kv = KVCache(KVCacheConfig())
    a = evented("a")
    chain = list(range(1000, 1040))                  # marks at depths 16, 32 and 40
    kv.placed(a, chain, 0)
    assert kv.match(chain, [a]) == {"a": 40}
    kv._on_events("a", None, [BlockRemoved(block_hashes=tuple(chain[36:]))])
    assert kv.match(chain, [a]) == {"a": 32}         # at most stride - 1 blocks more than left
    kv._on_events("a", None, [BlockRemoved(block_hashes=tuple(chain[:32]))])
    assert kv.match(chain, [a]) == {}
