"""What the default Redis store's per-request ledger work costs redis-server and the replica, in
process: write-behind reserve + end pairs (as every placement of a non-streamed request makes),
``--batch`` placements a loop turn, with the load copy on.

    python bench/redis_ledger_cost.py [--pairs 20000] [--batch 4]

Prints the replica's thread CPU per pair, redis-server's own CPU per pair (``/proc``: with the
reading of the commands' arguments and the socket work that ``INFO commandstats`` leaves out) and
its ``INFO commandstats`` (time per pair in ``EVALSHA``, the calls made from Lua per pair by
command), against a redis-server it
starts on loopback TCP (``tests/redis_fixtures``) and stops. To compare two trees, run it from
each (``cd <tree> && PYTHONPATH=$PWD python bench/redis_ledger_cost.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis as syncredis  # noqa: E402

from bench.overhead import cpu_seconds, process_tree  # noqa: E402
from controlplane.state import Charge, RequestRecord  # noqa: E402
from controlplane.state.redis import RedisStore  # noqa: E402
from tests.redis_fixtures import RedisServer  # noqa: E402


async def measure(url: str, pairs: int, batch: int, server_pid: int) -> None:
    s = RedisStore(url, key_prefix="bench:", write_behind=True, loads_max_age_s=0.05)
    workers = [f"w{i:02d}" for i in range(16)]
    admin = syncredis.Redis.from_url(url)

    async def turn(first: int, n: int, tag: str) -> None:
        for j in range(first, first + n):
            ch = (Charge(workers[j % 16], "aggregated", 640),)
            rec = RequestRecord(request_id=f"{tag}{j}", model="m", prompt_tokens=512, max_tokens=128, session="s1",
                                created_at=time.monotonic(), charges=ch)
            await s.reserve(rec, ch, charged=True)
        await s.loads(workers)
        await asyncio.sleep(0)
        for j in range(first, first + n):
            await s.end(f"{tag}{j}")
        await asyncio.sleep(0)

    try:
        await s.loads(workers)
        for i in range(0, 400, batch):          # scripts loaded, connection warm
            await turn(i, batch, "warm")
        while s._behind:
            await asyncio.sleep(0.001)
        admin.config_resetstat()
        server = process_tree(server_pid)   # (its guard and redis-server)
        s0 = cpu_seconds(server)
        t0 = time.thread_time()
        for i in range(0, pairs, batch):
            await turn(i, batch, "r")
        while s._behind:
            await asyncio.sleep(0.001)
        cpu = time.thread_time() - t0
        server_cpu = cpu_seconds(server) - s0
        stats = admin.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {})
        print(f"replica thread CPU per reserve + end: {cpu / pairs * 1e6:.1f} us")
        print(f"redis-server CPU per reserve + end: {server_cpu / pairs * 1e6:.1f} us (/proc)")
        print(f"redis-server EVALSHA per reserve + end: {evalsha.get('usec', 0) / pairs:.1f} us "
              f"({evalsha.get('calls', 0) / pairs:.2f} calls)")
        inner = {k.removeprefix("cmdstat_"): v["calls"] / pairs for k, v in sorted(stats.items())
                 if k not in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_config|resetstat", "cmdstat_hmget_refresh")}
        print(f"calls from Lua (and reads) per pair: {sum(inner.values()):.1f}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in inner.items()))
    finally:
        await s.close()
        admin.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=4, help="placements (and then their ends) a loop turn")
    args = ap.parse_args()
    server = RedisServer(tcp=True)
    server.start()
    assert server.proc is not None
    try:
        asyncio.run(measure(server.url, args.pairs, args.batch, server.proc.pid))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
