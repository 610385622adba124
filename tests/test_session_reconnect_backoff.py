"""The placement session client's reconnect pauses follow omni_runtime.retry (RECONNECT).

A real control plane in this process (or a port that refuses connections); the policy's
random draw is pinned to the top of its window and its sleep only records the pause, so the
windows can be read exactly and nothing really waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest

from dataplane import placement_client
from dataplane.placement_client import PlacementClient
from tests.conftest import wait_until
from tests.ports import refused_port

WINDOWS = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]    # 50 ms doubling to 1 s


class TopOfWindow:
    def uniform(self, low: float, high: float) -> float:
        return high


@pytest.fixture
def pauses(monkeypatch):
    """The pauses the client takes, recorded instead of slept (a yield to the loop each)."""
    taken: list[float] = []

    async def record(seconds: float) -> None:
        taken.append(seconds)
        await asyncio.sleep(0)
    # the clock stands still: every session seems to end as it starts, however loaded the machine
    policy = dataclasses.replace(placement_client.RECONNECT, rng=TopOfWindow(), sleep=record, clock=lambda: 0.0)
    monkeypatch.setattr(placement_client, "RECONNECT", policy)
    return taken


@pytest.fixture
async def closed_scheduler():
    """A control plane whose sessions need a data-plane token (the client below has none)."""
    from controlplane.auth import AuthConfig
    from controlplane.config import ControlPlaneConfig
    from controlplane.server import ControlPlane

    plane = ControlPlane(ControlPlaneConfig(http_port=0, listen="127.0.0.1:0",
                                            auth=AuthConfig(dataplane_tokens={"dp": "dp-tok"})))
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


async def _until_paused(client: PlacementClient, pauses: list[float], n: int) -> list[float]:
    await client.start()
    try:
        await wait_until(lambda: len(pauses) >= n, what=f"{n} reconnect pauses")
    finally:
        await client.close()
    return pauses[:n]


async def test_refused_sessions_back_off_longer_each_time(closed_scheduler, pauses):
    """Each session ends at once (refused): the pause grows (was a fixed 50 ms, 20 tries a second)."""
    client = PlacementClient(f"127.0.0.1:{closed_scheduler.grpc_port}", "dp-no-token", timeout_s=5.0)
    assert await _until_paused(client, pauses, len(WINDOWS)) == WINDOWS


async def test_a_session_that_lasted_starts_the_pauses_over(closed_scheduler, pauses, monkeypatch):
    """A session that lasted at least RECONNECT.max_s was a working one: the next pause is the first window."""
    now = [0.0]

    def clock() -> float:
        now[0] += 2.0          # every session seems to have lasted 2 s
        return now[0]
    monkeypatch.setattr(placement_client, "RECONNECT", dataclasses.replace(placement_client.RECONNECT, clock=clock))
    client = PlacementClient(f"127.0.0.1:{closed_scheduler.grpc_port}", "dp-no-token", timeout_s=5.0)
    assert await _until_paused(client, pauses, 4) == [0.05] * 4


async def test_no_replica_answering_backs_off_after_each_round(pauses):
    """Connects that time out: every replica is tried at once, then the pause grows each round
    (was linear, 50 ms more per round)."""
    with refused_port() as a, refused_port() as b:
        client = PlacementClient(f"127.0.0.1:{a},127.0.0.1:{b}", "dp-alone", timeout_s=5.0,
                                 connect_timeout_s=0.05)
        assert await _until_paused(client, pauses, 4) == WINDOWS[:4]


def test_reconnects_are_never_capped():
    assert placement_client.RECONNECT.attempts == sys.maxsize
