"""A bounded closed-loop load generator for OpenAI endpoints (demo and benchmarks).

Bounded in both request count and wall time, so it always stops by itself.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass
class Result:
    status: int
    ttft_s: float          # time to first body byte
    latency_s: float
    events: int = 0        # SSE events (streams) or 1
    completion_tokens: int = 0
    error: str = ""


@dataclass
class Summary:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200 and not r.error]

    def pct(self, attr: str, q: float) -> float:
        values = sorted(getattr(r, attr) for r in self.ok)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    def median(self, attr: str) -> float:
        values = [getattr(r, attr) for r in self.ok]
        return statistics.median(values) if values else float("nan")


def count_stream_tokens(raw: bytes) -> int:
    """Token-bearing SSE events: a chat stream's role-only first chunk and a usage-only
    chunk carry no token, so counting events would overstate the output."""
    tokens = 0
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        for choice in orjson.loads(event[6:]).get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                tokens += 1
    return tokens


async def send(session: aiohttp.ClientSession, url: str, body: dict, *, headers: dict | None = None) -> Result:
    start = time.perf_counter()
    ttft = 0.0
    events = 0
    try:
        async with session.post(url, data=orjson.dumps(body), headers={
                "Content-Type": "application/json", **(headers or {})}) as resp:
            if body.get("stream"):
                buf = bytearray()
                async for chunk in resp.content.iter_any():
                    if not ttft:
                        ttft = time.perf_counter() - start
                    events += chunk.count(b"\n\n")
                    buf += chunk
                tokens = count_stream_tokens(bytes(buf))
                if resp.status == 200 and not buf.rstrip().endswith(b"data: [DONE]"):
                    return Result(resp.status, ttft, time.perf_counter() - start, events, tokens,
                                  error="stream did not end with [DONE]")
            else:
                data = await resp.read()
                ttft = time.perf_counter() - start
                events = 1
                tokens = 0
                if resp.status == 200:
                    tokens = int((orjson.loads(data).get("usage") or {}).get("completion_tokens") or 0)
            error = "" if resp.status == 200 else f"HTTP {resp.status}"
            return Result(resp.status, ttft, time.perf_counter() - start, events, tokens, error)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(0, ttft, time.perf_counter() - start, events, 0, error=f"{type(exc).__name__}: {exc}")


async def closed_loop(base_url: str, make_request: Callable[[int], tuple[str, dict]], *, total: int,
                      concurrency: int, max_seconds: float) -> Summary:
    """Send ``total`` requests with ``concurrency`` in flight, stopping at ``max_seconds``."""
    summary = Summary()
    counter = iter(range(total))
    deadline = time.monotonic() + max_seconds
    timeout = aiohttp.ClientTimeout(total=max_seconds)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker() -> None:
            for i in counter:
                if time.monotonic() > deadline:
                    return
                path, body = make_request(i)
                summary.results.append(await send(session, base_url + path, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        summary.wall_s = time.perf_counter() - start
    return summary
