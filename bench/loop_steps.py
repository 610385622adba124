"""The longest step on the control plane's loop of three index chores, in thread CPU (issue 19
item 2): expiring routed prefixes when many are due at once, writing a KV-index snapshot, and
orphaning a data-plane session while the replica keeps many write-behind records.

    python bench/loop_steps.py [--marks 250000] [--blocks 1000000] [--kept 131072]

Thread CPU (``time.thread_time``), not wall time: on a shared host a wall-clock gap between
two loop turns is mostly other processes holding the core. To compare two trees, run it from
each (``cd <tree> && PYTHONPATH=$PWD python bench/loop_steps.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.kvcache import persist  # noqa: E402
from controlplane.kvcache.events import BlockStored  # noqa: E402
from controlplane.kvcache.manager import KVCache, KVCacheConfig  # noqa: E402
from controlplane.kvcache.routed import RoutingMemory  # noqa: E402
from controlplane.state import RequestRecord  # noqa: E402


def routed_expiry(marks: int, rng: random.Random) -> str:
    """Every bucket due at once (a pause in placements longer than ``ttl_s``)."""
    mem = RoutingMemory(ttl_s=120.0, max_blocks=2_000_000, stride=16)
    routed = 0
    while mem.index.size() < marks:
        mem.route(("w", routed % 8), [rng.getrandbits(64) for _ in range(1600)], now=routed * 0.001)
        routed += 1
    calls, longest, total = 0, 0.0, 0.0
    while mem.expiry and mem.expiry[0][1] <= 1000.0 - 120.0:
        t0 = time.thread_time()
        mem.expire(now=1000.0)
        dt = time.thread_time() - t0
        calls, longest, total = calls + 1, max(longest, dt), total + dt
    return (f"routed expiry, {marks} marks due: {calls} calls, longest {longest * 1e3:.1f} ms, "
            f"all {total * 1e3:.0f} ms")


async def snapshot(blocks: int, rng: random.Random) -> str:
    """The longest stretch of the dump between two turns of a task that only yields."""
    kv = KVCache(KVCacheConfig(block_size=16, max_blocks=max(2_000_000, blocks)))
    for i in range(blocks // 100):
        chain = tuple(rng.getrandbits(64) for _ in range(100))
        kv.exact.apply("e", i % 4, [BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=(),
                                                block_size=16)])
    steps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.thread_time()
        while not stop:
            await asyncio.sleep(0)
            now = time.thread_time()
            steps.append(now - last)
            last = now
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    t0 = time.thread_time()
    blob = await persist.dump(kv)
    total = time.thread_time() - t0
    stop = True
    await task
    return (f"snapshot of {kv.exact.size()} blocks ({len(blob) >> 20} MiB): longest step "
            f"{max(steps) * 1e3:.1f} ms, all {total * 1e3:.0f} ms")


def orphan(kept: int) -> str:
    """What RedisStore.orphan does with the replica's own records, without Redis: the scan of
    every kept record it made before controlplane/state/owned.py, and the index by session."""
    records = [RequestRecord(request_id=f"r{i}", model="m", prompt_tokens=1, max_tokens=1, session=f"s{i % 64}")
               for i in range(kept)]
    plain = {r.request_id: r for r in records}
    t0 = time.thread_time()
    for rid in [rid for rid, r in plain.items() if r.session == "s7"]:
        del plain[rid]
    scan = time.thread_time() - t0
    try:
        from controlplane.state.owned import OwnedRecords
    except ImportError:
        return f"orphan of a session among {kept} kept records: scan {scan * 1e3:.2f} ms (no owned.py here)"
    owned = OwnedRecords(kept)
    for r in records:
        owned.put(r)
    t0 = time.thread_time()
    n = len(owned.pop_session("s7"))
    return (f"orphan of a session with {n} of {kept} kept records: scan {scan * 1e3:.2f} ms, "
            f"index {(time.thread_time() - t0) * 1e3:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--marks", type=int, default=250_000)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--kept", type=int, default=131_072)
    args = ap.parse_args()
    rng = random.Random(1)
    print(routed_expiry(args.marks, rng))
    print(asyncio.run(snapshot(args.blocks, rng)))
    print(orphan(args.kept))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
