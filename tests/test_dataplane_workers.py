"""``omni-proxy dataplane --workers N``: N serving processes on one port (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import os
import re

import aiohttp

from tests.conftest import child_pids, start_cluster, wait_until


async def test_several_processes_share_the_port_and_die_with_the_first(http):
    cluster = start_cluster({"agg": "both"}, dp_args=["--workers", "3", "--node-id", "dpx"])
    try:
        await wait_until(lambda: _sessions(cluster, http, 3), what="three control-plane sessions")
        log = cluster.cp.log_tail(200)
        assert all(f"dpx-w{i}" in log for i in range(3))

        async def one() -> int:   # a new connection per request: the kernel spreads them
            async with aiohttp.ClientSession() as s, s.post(cluster.url + "/v1/completions", json={
                    "model": "sim-model", "prompt": "hi", "max_tokens": 2}) as r:
                await r.read()
                return r.status
        assert await asyncio.gather(*(one() for _ in range(24))) == [200] * 24
        helpers = child_pids(cluster.dp.proc.pid)
        assert len(helpers) == 2
    finally:
        cluster.group.close()
    await wait_until(lambda: _all_gone(helpers), what="helper processes gone with the data plane")


async def _sessions(cluster, http, n: int) -> bool:
    async with http.get(f"http://127.0.0.1:{cluster.cp.info['http_port']}/metrics") as r:
        m = re.search(r'^omni_sessions_total\{event="opened"\} (\S+)$', await r.text(), re.M)
    return bool(m) and float(m.group(1)) >= n



async def _all_gone(pids: list[int]) -> bool:
    return not any(os.path.exists(f"/proc/{p}") and "zombie" not in _state(p) for p in pids)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"
