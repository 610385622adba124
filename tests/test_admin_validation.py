"""Admin, registration and placement values are checked where they enter the control plane.

Regression tests for the reliability issue: ``omni-ctl weight ID inf`` made the random
picker raise inside every placement; NaN silently took a worker out of rotation; huge
token counts overflowed the ledger's int64 fields so that ListWorkers failed.
"""

from __future__ import annotations

import math

import grpc
import pytest

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc


@pytest.fixture
async def admin(inproc_cp):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{inproc_cp.grpc_port}") as channel:
        yield pb_grpc.AdminStub(channel), pb_grpc.RegistryStub(channel), pb_grpc.SchedulerStub(channel)


@pytest.mark.parametrize("weight", [math.inf, -math.inf, math.nan, -1.0, 1e300])
async def test_set_weight_refuses_values_that_are_not_finite_and_in_range(admin, inproc_cp, weight):
    stub, _, _ = admin
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SetWeight(pb.SetWeightRequest(worker_id="w", weight=weight), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "weight" in err.value.details()
    assert inproc_cp.fleet.get("w").weight == 1.0


async def test_set_weight_accepts_zero_and_normal_values(admin, inproc_cp):
    stub, _, _ = admin
    for weight in (0.0, 2.5):
        resp = await stub.SetWeight(pb.SetWeightRequest(worker_id="w", weight=weight), timeout=5)
        assert resp.worker.weight == weight


@pytest.mark.parametrize("field,value", [
    ("url", "not a url"), ("url", "ftp://host:1"), ("url", ""), ("worker_id", "x" * 100_000),
    ("weight", math.nan), ("kv_events", "tcp://host"), ("heartbeat_ttl_s", -1.0),
    ("heartbeat_ttl_s", math.nan), ("bootstrap_port", 70000),
])
async def test_register_and_add_refuse_bad_values(admin, inproc_cp, field, value):
    stub, registry, _ = admin
    req = pb.RegisterRequest(url="http://127.0.0.1:9", role=pb.ROLE_BOTH, model="m")
    setattr(req, field, value)
    before = {s.id for s in inproc_cp.fleet.specs()}
    for call in (registry.Register, stub.AddWorker):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(err.value.details()) < 400     # never echoes a huge value back
    assert {s.id for s in inproc_cp.fleet.specs()} == before


async def test_huge_token_counts_are_refused_and_listing_keeps_working(admin):
    stub, _, scheduler = admin
    for prompt, max_tokens in ((2**62, 1), (1, 2**62), (-5, 1)):
        placement = await scheduler.Place(pb.PlaceRequest(request_id="big", leg=pb.LEG_ENTRY,
                                                          prompt_tokens=prompt, max_tokens=max_tokens), timeout=5)
        assert placement.error == pb.INVALID_REQUEST
    listing = await stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert [w.load.inflight_requests for w in listing.workers] == [0]


def test_one_role_mapping_both_ways():
    """The Role <-> pb.Role mapping is defined once (controlplane.workers) and is what the
    admin API and placement use: every wire role but UNSPECIFIED maps to a Role and back."""
    from controlplane import placement, services, workers
    assert placement.ROLE_TO_PB is workers.ROLE_TO_PB and services.ROLE_TO_PB is workers.ROLE_TO_PB
    assert services.PB_TO_ROLE is workers.PB_TO_ROLE
    wire = {v for n, v in pb.Role.items() if n != "ROLE_UNSPECIFIED"}
    assert set(workers.PB_TO_ROLE) == wire and set(workers.ROLE_TO_PB) == set(workers.Role)
    assert all(workers.PB_TO_ROLE[workers.ROLE_TO_PB[r]] is r for r in workers.Role)
