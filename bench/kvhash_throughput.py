"""Benchmark: BlockHasher throughput (blocks/s) per algorithm and block size. Bounded, a few seconds.

    python bench/kvhash_throughput.py [--blocks 1000] [--reps 5]
"""

from __future__ import annotations

import argparse
import random
import time

from kvhash.hashing import HASH_ALGOS, BlockHashConfig, BlockHasher


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = random.Random(0)
    for bs in (16, 128):
        toks = [rng.randrange(150_000) for _ in range(bs * a.blocks)]
        for algo in HASH_ALGOS:
            h = BlockHasher(BlockHashConfig(block_size=bs, algo=algo, python_hash_seed="0"))
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                h.event_hashes(toks)
                best = min(best, time.perf_counter() - t0)
            print(f"bs={bs:4d} {algo:12s}: {a.blocks} blocks in {best * 1e3:6.2f} ms = "
                  f"{a.blocks / best:10,.0f} blocks/s ({len(toks) / best / 1e6:.1f} M tokens/s)")


if __name__ == "__main__":
    main()
