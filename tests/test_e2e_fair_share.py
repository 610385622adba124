"""No engine starved by a shared system prompt, through real processes (issue 17).

Simulated engines that publish their KV events (so the control plane tracks prefill,
aggregated and decode engines' caches exactly), a control plane with each policy that
follows the prefix cache, and a data plane. Every prompt starts with the same system
prompt; conversations of several turns run on top of it. One conversation's first turn
runs alone first, as traffic ramps up, so its engine holds the system prompt before any
other request arrives: with any match followed, every later request went to that engine
(and in PD every decode to one decode engine). Each equal, healthy engine must get at
least half its fair share on every leg, and a conversation's follow-ups still land where
its earlier turns ran.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict

import aiohttp
import pytest

from omni_proxy.launcher import ProcessGroup
from tests.conftest import wait_until

MODEL = "sim-model"
SYSTEM_TOKENS = 512          # 32 blocks, in every prompt
TURN_TOKENS = 256            # each turn adds a user message and an answer
CONVERSATIONS = 16
TURNS = 3
CONCURRENCY = 6


class FleetUnderTest:
    def __init__(self, group: ProcessGroup, sims: dict, cp, dp) -> None:
        self.group, self.sims, self.cp, self.dp = group, sims, cp, dp

    async def metrics(self, http: aiohttp.ClientSession) -> str:
        async with http.get(f"http://127.0.0.1:{self.cp.info['http_port']}/metrics") as r:
            assert r.status == 200
            return await r.text()


def start(tmp_path, roles: dict[str, str], policy: str) -> FleetUnderTest:
    group = ProcessGroup(str(tmp_path), ready_timeout=60)
    try:
        sims = {}
        for name, role in roles.items():
            sims[name] = group.start(name, ["sim", "--role", role, "--port", "0",
                                            "--kv-events-endpoint", f"ipc://{tmp_path}/{name}.sock"])
        config = tmp_path / "cp.toml"
        config.write_text(f'policy = "{policy}"\n' + "".join(
            f'[[workers]]\nid = "{name}"\nurl = "{sim.url}"\nrole = "{roles[name]}"\n'
            f'kv_events = "ipc://{tmp_path}/{name}.sock"\n' for name, sim in sims.items()))
        cp = group.start("controlplane", ["controlplane", "--config", str(config), "--listen", "127.0.0.1:0",
                                          "--http-port", "0", "--health-interval", "0.2",
                                          "--metrics-interval", "0.2"])
        dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address])
        return FleetUnderTest(group, sims, cp, dp)
    except BaseException:
        group.close()
        raise


async def subscribed(fleet: FleetUnderTest, http: aiohttp.ClientSession) -> None:
    """Every engine's KV events reach the control plane (a ZMQ subscriber misses what is
    published before it has joined): fresh prompts straight to each engine until they do.
    Then the engines' request logs are cleared."""
    n = 0

    async def all_received() -> bool:
        nonlocal n
        n += 1
        for _name, sim in fleet.sims.items():
            # Aggregated and prefill engines compute these; a decode engine computes a prompt
            # sent to it directly like any engine. Distinct per engine and per try.
            prompt = [50_000 + n * 100 + i for i in range(32)]
            async with http.post(sim.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
                assert r.status == 200
        text = await fleet.metrics(http)
        return all(any(line.startswith("omni_kv_events_total") and f'worker="{name}"' in line
                       and 'kind="received"' in line and not line.endswith(" 0") and not line.endswith(" 0.0")
                       for line in text.splitlines()) for name in fleet.sims)

    await wait_until(all_received, timeout=30, what="KV events from every engine", interval=0.1)
    async with aiohttp.ClientSession() as s:
        for sim in fleet.sims.values():
            async with s.delete(sim.url + "/sim/requests") as r:
                assert r.status in (200, 204)


async def replay(fleet: FleetUnderTest, http: aiohttp.ClientSession, seed: int = 17) -> None:
    """The conversations through the data plane: conversation 0's first turn alone, then
    every conversation's turns in order, ``CONCURRENCY`` conversations at a time."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 30000) for _ in range(SYSTEM_TOKENS)]
    convs = {c: list(system) for c in range(CONVERSATIONS)}

    async def turn(c: int, t: int) -> None:
        convs[c] += [rng.randrange(1, 30000) for _ in range(TURN_TOKENS)]
        async with http.post(fleet.dp.url + "/v1/completions", headers={"X-Request-Id": f"c{c}-t{t}"},
                             json={"model": MODEL, "prompt": convs[c], "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()

    await turn(0, 0)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def conversation(c: int) -> None:
        async with gate:
            for t in range(1 if c == 0 else 0, TURNS):
                await turn(c, t)

    await asyncio.gather(*(conversation(c) for c in range(CONVERSATIONS)))


async def where(fleet: FleetUnderTest, http: aiohttp.ClientSession) -> dict[str, dict[str, str]]:
    """Per engine name, the request label (c<conversation>-t<turn>) of every request it ran."""
    out: dict[str, dict[str, str]] = {}
    for name, sim in fleet.sims.items():
        async with http.get(sim.url + "/sim/requests") as r:
            reqs = (await r.json())["requests"]
        out[name] = {req["request_id"].rsplit("-", 1)[0]: name for req in reqs}
    return out


CASES = {
    "aggregated": {"a0": "both", "a1": "both", "a2": "both", "a3": "both"},
    "pd": {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"},
}


@pytest.mark.parametrize("policy", ["cache_aware", "apc_first", "predicted_latency"])
@pytest.mark.parametrize("mode", list(CASES))
async def test_every_engine_gets_its_share_on_a_shared_system_prompt(tmp_path, http, policy, mode):
    roles = CASES[mode]
    fleet = start(tmp_path, roles, policy)
    try:
        await subscribed(fleet, http)
        await replay(fleet, http)
        ran = await where(fleet, http)
    finally:
        fleet.group.close()
    total = CONVERSATIONS * TURNS
    legs: dict[str, list[str]] = defaultdict(list)
    for name, role in roles.items():
        legs[role].append(name)
    got = {name: len(ran[name]) for name in roles}
    for role, names in legs.items():
        assert sum(got[n] for n in names) == total, got
        fair = total / len(names)
        assert all(got[n] >= fair / 2 for n in names), f"{policy} {mode}: {role} engines below half their " \
                                                       f"fair share of {fair:.0f}: {got}"
    # Follow-ups land where their conversation's previous turn ran (the part of the match
    # past the system prompt is the conversation's own): every one for the cache rules,
    # most for predicted_latency, which may trade a warm cache for a shorter queue.
    computing = legs.get("both") or legs["prefill"]
    engine_of = {label: name for name in computing for label in ran[name]}
    moves = Counter(engine_of[f"c{c}-t{t}"] == engine_of[f"c{c}-t{t - 1}"]
                    for c in range(CONVERSATIONS) for t in range(1, TURNS))
    share = 0.6 if policy == "predicted_latency" else 0.9
    assert moves[True] >= share * sum(moves.values()), f"{policy} {mode}: follow-ups stayed {moves}"
