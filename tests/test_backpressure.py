"""Backpressure end to end: a client that reads a long stream very slowly must not make the
data plane buffer the engine's answer. The relay's ``StreamResponse.write`` waits for the
client socket to drain, so the data plane stops reading from the engine and TCP throttles
the engine's writes: the data plane's memory stays flat while the engine generates far more
than the client has read. A client that goes away ends the engine's request too."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.conftest import start_cluster, wait_until

MAX_TOKENS = 200_000


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"agg": "both"}, sim_args={"agg": ["--decode-ms-per-step", "0.02",
                                                          "--max-model-len", str(MAX_TOKENS + 1000)]})
    try:
        yield c
    finally:
        c.group.close()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _generated(cluster) -> int:
    return (await cluster.sim_get("agg", "/sim/state"))["generation_tokens_total"]


async def test_slow_reader_does_not_make_the_data_plane_buffer(cluster):
    await cluster.fresh()
    before_tokens = await _generated(cluster)
    rss_before = rss_mib(cluster.dp.proc.pid)
    body = json.dumps({"model": "sim-model", "prompt": "tell me everything", "max_tokens": MAX_TOKENS,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.dp.port, limit=4096)
    sock = writer.get_extra_info("socket")
    import socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    received = 0
    peak = rss_before
    deadline = time.monotonic() + 6.0
    try:
        while time.monotonic() < deadline:          # ~4 KB per 50 ms: about 80 KB/s
            chunk = await asyncio.wait_for(reader.read(4096), 5)
            assert chunk, "the data plane ended the stream"
            received += len(chunk)
            peak = max(peak, rss_mib(cluster.dp.proc.pid))
            await asyncio.sleep(0.05)
        generated = await _generated(cluster) - before_tokens
        # Each streamed token is an SSE event of 100+ bytes: what the engine generated is far
        # more than what the client read, yet the data plane holds none of the difference.
        assert generated * 100 > 10 * received, (generated, received)
        print(f"generated {generated} tokens, client read {received} B, data-plane RSS +{peak - rss_before:.1f} MiB")
        assert received < 2_000_000
        assert peak - rss_before < 15, f"data plane RSS grew {peak - rss_before:.1f} MiB (read {received} B)"
    finally:
        writer.close()
    # The client left: the data plane aborts the engine's request and frees everything.
    await wait_until(lambda: cluster.engine_idle("agg"), timeout=20, what="engine request aborted")
    await wait_until(cluster.all_idle, timeout=20, what="load released")


async def test_stalled_engine_holds_no_growing_state(cluster, http):
    """Requests stuck on an engine that sends nothing hold a fixed amount each and end with
    a clean error at --read-timeout's end (the default is long; here the client gives up)."""
    await cluster.fresh()
    await cluster.sim_post("agg", "/sim/faults", {"delay_s": 30, "count": -1})
    try:
        rss_before = rss_mib(cluster.dp.proc.pid)

        async def one():
            try:
                async with http.post(cluster.url + "/v1/completions", timeout=__import__("aiohttp").ClientTimeout(
                        total=1.5), json={"model": "sim-model", "prompt": "x", "max_tokens": 4, "stream": True}) as r:
                    await r.read()
            except TimeoutError:
                pass

        await asyncio.gather(*(one() for _ in range(200)))
        assert rss_mib(cluster.dp.proc.pid) - rss_before < 20
    finally:
        await cluster.sim_post("agg", "/sim/faults", {"clear": True})
    await wait_until(cluster.all_idle, timeout=20, what="load released after the clients left")
