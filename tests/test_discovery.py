"""The watched discovery file: workers of source "file" follow it; others are never touched.
Also: placement shares follow weights (in process, with the Placer)."""

from __future__ import annotations

import logging
import os
from collections import Counter

import pytest

from controlplane.health import Health
from tests.conftest import wait_until


def _write(path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)   # a rewrite within the same clock tick must still look changed
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000 * (1 + _write.n)))
    _write.n += 1


_write.n = 0


@pytest.fixture
async def cp_with_file(sim_both, tmp_path):
    from controlplane.config import ControlPlaneConfig, DiscoveryConfig, WorkerSpec
    from controlplane.server import ControlPlane
    from controlplane.workers import Role

    path = tmp_path / "workers.toml"
    _write(path, f'[[workers]]\nurl = "{sim_both.url}"\nrole = "prefill"\nid = "f1"\nweight = 2\n')
    config = ControlPlaneConfig(
        http_port=0, listen="127.0.0.1:0", workers=[WorkerSpec(url=sim_both.url, role=Role.BOTH, id="w")],
        discovery=DiscoveryConfig(file=str(path), interval_s=0.1))
    config.health.interval_s = 0.2
    plane = ControlPlane(config)
    await plane.start()
    try:
        yield plane, path, sim_both.url
    finally:
        await plane.stop()


async def test_file_workers_are_added_at_start_and_checked(cp_with_file):
    plane, _, _ = cp_with_file
    spec = plane.fleet.get("f1")
    assert spec is not None and spec.source == "file" and spec.weight == 2.0

    async def healthy() -> bool:
        return plane.fleet.state("f1").health is Health.HEALTHY

    await wait_until(healthy, what="f1 healthy")


async def test_changes_are_followed_bad_entries_skipped_others_untouched(cp_with_file, caplog):
    plane, path, url = cp_with_file
    caplog.set_level(logging.INFO, logger="controlplane.discovery")
    config_worker = plane.fleet.get("w")
    _write(path, f'''
[[workers]]
url = "{url}"
role = "prefill"
id = "f1"
weight = 5

[[workers]]
url = "not a url"
id = "bad"

[[workers]]
url = "http://127.0.0.1:9"
role = "decode"
id = "f2"

[[workers]]
url = "http://127.0.0.1:10"
id = "w"
''')

    async def applied() -> bool:
        return plane.fleet.get("f2") is not None and plane.fleet.get("f1").weight == 5.0

    await wait_until(applied, what="the file's changes applied")
    assert plane.fleet.get("bad") is None
    assert plane.fleet.get("w") == config_worker            # a config worker's id: skipped
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("workers[1]" in e for e in errors) == 1 and any("belongs to a config worker" in e for e in errors)

    _write(path, f'[[workers]]\nurl = "{url}"\nrole = "prefill"\nid = "f1"\nweight = 5\n')

    async def removed() -> bool:
        return plane.fleet.get("f2") is None

    await wait_until(removed, what="f2 removed")
    assert plane.fleet.get("f1") is not None and plane.fleet.get("w") == config_worker

    _write(path, "this is = not [toml")        # unparsable: workers stay as they are
    loads = plane.discovery.loads
    await wait_until(lambda: _async(plane.discovery._stamp is not None), what="stat")
    await plane.discovery.sync(force=True)
    assert plane.discovery.loads == loads and plane.fleet.get("f1") is not None


async def _async(v):
    return v


async def test_operator_changes_to_a_file_worker_hold_until_its_entry_changes(cp_with_file):
    plane, path, url = cp_with_file
    await plane.registry.update("f1", draining=True, weight=7.0)
    _write(path, f'[[workers]]\nurl = "{url}"\nrole = "prefill"\nid = "f1"\nweight = 2\n\n'
                 f'[[workers]]\nurl = "http://127.0.0.1:9"\nid = "f3"\n')

    async def seen() -> bool:
        return plane.fleet.get("f3") is not None

    await wait_until(seen, what="f3 added")
    assert plane.fleet.get("f1").weight == 7.0 and plane.fleet.get("f1").draining


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("policy", ["round_robin", "random"])
async def test_placement_shares_follow_weights(policy):
    from controlplane.fleet import Fleet
    from controlplane.placement import Placer
    from controlplane.scheduling import build_profile
    from controlplane.state import make_store
    from controlplane.config import ControlPlaneConfig
    from controlplane.workers import HealthState, Role, WorkerSpec
    from protos import omni_proxy_pb2 as pb

    fleet = Fleet()
    store = make_store(ControlPlaneConfig())
    weights = {"w1": 1.0, "w2": 2.0, "w3": 5.0}
    for wid, weight in weights.items():
        spec = WorkerSpec(id=wid, url=f"http://{wid}:8000", role=Role.BOTH, model="m", weight=weight)
        await store.put_spec(spec)
        fleet.put(spec)
        fleet.set_state(wid, HealthState(health=Health.HEALTHY))
    placer = Placer(store, fleet, build_profile(policy, {}))
    counts: Counter[str] = Counter()
    n = 8000
    for i in range(n):
        p = await placer.place(pb.PlaceRequest(request_id=f"r{i}", model="m", leg=pb.LEG_ENTRY, prompt_tokens=10,
                                               max_tokens=1))
        counts[p.decode.worker_id] += 1
        await placer.store.end(f"r{i}")
    total = sum(weights.values())
    for wid, weight in weights.items():
        assert abs(counts[wid] / n - weight / total) < 0.03, (policy, counts)
