"""Benchmark: PrefixIndex lookup cost for a long chain across many workers, and memory per entry.

Bounded: fixed iteration counts, a few seconds in all. Usage:
    python bench/kvindex_lookup.py [--workers 16] [--chain 1000] [--filler 200000] [--iters 2000]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from controlplane.kvcache.events import BlockStored
from controlplane.kvcache.index import PrefixIndex, PrefixIndexConfig


def stored(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--chain", type=int, default=1000)
    ap.add_argument("--filler", type=int, default=200_000, help="unrelated blocks spread over workers")
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    rng = random.Random(0)
    chain = [rng.getrandbits(64) for _ in range(a.chain)]

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(PrefixIndexConfig(max_blocks=10_000_000))
    for w in range(a.workers):   # worker w holds a prefix of w/(n-1) of the chain; last one holds it all
        depth = a.chain * w // max(1, a.workers - 1)
        for i in range(0, depth, 64):   # BlockStored batches of up to 64 blocks
            idx.apply(f"w{w}", 0, [stored(chain[i:min(i + 64, depth)], chain[i - 1] if i else None)])
    per = a.filler // a.workers
    for w in range(a.workers):
        hs = [rng.getrandbits(64) for _ in range(per)]
        for i in range(0, per, 64):
            idx.apply(f"w{w}", 0, [stored(hs[i:i + 64], hs[i - 1] if i else None)])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = idx.stats()
    print(f"index: {st.blocks} blocks, {st.block_refs} (block, worker) refs, {st.workers} workers")
    print(f"memory: {used / 2**20:.1f} MiB = {used / st.blocks:.0f} B/block, {used / st.block_refs:.0f} B/ref")

    def bench(name: str, fn, iters: int) -> None:
        fn()
        best = float("inf")
        total = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters // 5):
                fn()
            dt = (time.perf_counter() - t0) / (iters // 5)
            best, total = min(best, dt), total + dt
        print(f"{name}: best {best * 1e6:.1f} us, mean {total / 5 * 1e6:.1f} us per lookup")

    d = idx.match_depths(chain)
    assert d[(f"w{a.workers - 1}", 0)] == a.chain, d
    bench(f"full {a.chain}-block chain, {a.workers} workers (deepest holds all)",
          lambda: idx.match_depths(chain), a.iters)
    miss = [rng.getrandbits(64)] + chain[1:]
    bench("first block missing (early exit)", lambda: idx.match_depths(miss), a.iters)
    half = chain[: a.chain // 2] + [rng.getrandbits(64) for _ in range(a.chain // 2)]
    bench("match ends half-way", lambda: idx.match_depths(half), a.iters)
    cands = [(f"w{w}", 0) for w in range(0, a.workers, 2)]
    bench("full chain, half the workers as candidates", lambda: idx.match_depths(chain, cands), a.iters)
    bench("full chain with touch=True", lambda: idx.match_depths(chain, touch=True), a.iters // 4)


if __name__ == "__main__":
    main()
