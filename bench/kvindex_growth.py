"""Benchmark: the longest single apply step while the prefix index grows and churns, lookups/s, RSS.

Why: a Python dict holding the whole index is resized in one go when it grows or has churned
(insert + delete leave slots that only a rebuild reclaims): one apply() that happens to trigger it
holds the control plane's event loop, and every placement behind it, for the whole rebuild (about
200 ms at 1,000,000 blocks). This feeds the index the way the KV event subscriber does (one
decoded batch per apply() call) and times every call with perf_counter:

- grow: BlockStored runs of ``--run`` blocks spread over ``--workers`` workers up to ``--blocks``;
- churn: as many blocks again stored while the oldest runs are removed (BlockRemoved), the size
  held near ``--blocks``;
- evict: stores past ``--max-blocks`` (when below the blocks stored) so the cap's eviction runs.

Then the chain walk (match_depths over a ``--chain``-block prompt that the workers hold to
staggered depths) as lookups per second, and the process's RSS. Bounded: seconds per million
blocks. Usage (PYTHONPATH picks the tree measured):
    python bench/kvindex_growth.py [--blocks 1000000] [--max-blocks 2000000] [--workers 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import time
from array import array
from collections import deque

from controlplane.kvcache.events import BlockRemoved, BlockStored
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig


def rss_mib() -> float:
    """Current resident set size (Linux /proc; the peak from getrusage elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            import os
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Steps:
    """Durations of apply() calls of one phase: count, longest, p99, total. Wall time (what the
    loop is held for) and the thread's CPU time (the same without the preemptions of a shared
    machine: the work one step does)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def run(self, idx: PrefixIndex, worker: str, events: list) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        idx.apply(worker, 0, events)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.wall.append(t1 - t0)
        self.cpu.append(c1 - c0)

    def summary(self) -> dict:
        w, c = sorted(self.wall), sorted(self.cpu)
        if not w:
            return {}
        return {"steps": len(w), "max_ms": round(w[-1] * 1e3, 2), "p99_ms": round(w[int(len(w) * 0.99)] * 1e3, 3),
                "over_5ms": sum(x > 5e-3 for x in w), "cpu_max_ms": round(c[-1] * 1e3, 2),
                "cpu_over_5ms": sum(x > 5e-3 for x in c), "total_s": round(sum(w), 2), "cpu_s": round(sum(c), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1_000_000, help="grow to this many blocks, then churn as many")
    ap.add_argument("--max-blocks", type=int, default=2_000_000, help="the index's cap (below --blocks: evicts)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--run", type=int, default=64, help="blocks per BlockStored (one apply per run)")
    ap.add_argument("--chain", type=int, default=1000, help="blocks of the prompt walked for lookups/s")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rss0 = rss_mib()
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=a.max_blocks, keep_parents=False))
    workers = [f"w{i}" for i in range(a.workers)]
    live: deque[tuple[str, array]] = deque()         # runs still held, oldest first

    def store(steps: Steps) -> None:
        w = workers[rng.randrange(len(workers))]
        hs = [rng.getrandbits(64) for _ in range(a.run)]
        steps.run(idx, w, [BlockStored(block_hashes=tuple(hs), parent_block_hash=None, token_ids=(), block_size=16)])
        live.append((w, array("Q", hs)))     # not lists: no garbage collector work of the bench's own

    grow, churn = Steps(), Steps()
    while len(live) * a.run < a.blocks:
        store(grow)
    rss_grown = rss_mib()
    for _ in range(len(live)):                       # churn: as many blocks again, size held
        store(churn)
        w, hs = live.popleft()
        churn.run(idx, w, [BlockRemoved(block_hashes=(h,)) for h in hs])

    # The walk: worker i holds the prompt's first i/(n-1) blocks (the last holds it all).
    chain = [rng.getrandbits(64) for _ in range(a.chain)]
    for i, w in enumerate(workers):
        depth = a.chain * i // max(1, len(workers) - 1)
        for lo in range(0, depth, a.run):
            idx.apply(w, 0, [BlockStored(block_hashes=tuple(chain[lo:min(lo + a.run, depth)]),
                                         parent_block_hash=chain[lo - 1] if lo else None, token_ids=(), block_size=16)])
    assert idx.match_depths(chain)[(workers[-1], 0)] == a.chain
    half = chain[:a.chain // 2] + [rng.getrandbits(64) for _ in range(a.chain - a.chain // 2)]
    walks = {}
    for name, c in (("full", chain), ("half", half), ("miss", [rng.getrandbits(64)] + chain[1:])):
        best = float("inf")            # the thread's CPU time: a shared machine's preemptions left out
        for _ in range(5):
            t0 = time.thread_time()
            for _ in range(a.lookups // 5):
                idx.match_depths(c)
            best = min(best, (time.thread_time() - t0) / (a.lookups // 5))
        walks[name] = {"us": round(best * 1e6, 1), "per_s": round(1 / best)}
    gc.collect()
    out = {"blocks": a.blocks, "max_blocks": a.max_blocks, "workers": a.workers,
           "shards": len(getattr(idx, "_shards", [None])), "grow": grow.summary(), "churn": churn.summary(),
           "walk": walks, "rss_mib": {"start": round(rss0), "grown": round(rss_grown), "end": round(rss_mib())},
           "evicted": idx.stats().evicted, "size": idx.size()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
