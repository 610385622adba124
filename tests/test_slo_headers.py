"""Clients' latency targets (X-SLO-TTFT-Ms / X-SLO-TPOT-Ms) reach placement, checked."""

from __future__ import annotations

import pytest

from dataplane.errors import APIError
from dataplane.placing import place
from dataplane.requests import parse_request, slo_header
from protos import omni_proxy_pb2 as pb
from tests.conftest import start_cluster


class CapturingClient:
    info = pb.SessionInfo()

    def __init__(self) -> None:
        self.sent: list[pb.PlaceRequest] = []

    async def place(self, msg: pb.PlaceRequest | pb.DataPlaneMessage) -> pb.Placement:
        if isinstance(msg, pb.DataPlaneMessage):   # as placing.place sends it: the session message
            msg = msg.place
        self.sent.append(msg)
        return pb.Placement(request_id=msg.request_id, flow=pb.FLOW_AGGREGATED)

    def place_here(self, msg: pb.DataPlaneMessage) -> None:
        return None     # (the control plane did not offer local placement)


async def test_targets_ride_the_placement_request():
    req = parse_request("/v1/completions", b'{"prompt": "x"}', None)
    req.ttft_slo_ms = slo_header({"X-SLO-TTFT-Ms": "1500"}, "X-SLO-TTFT-Ms")
    req.tpot_slo_ms = slo_header({}, "X-SLO-TPOT-Ms")
    client = CapturingClient()
    await place(client, req, pb.LEG_ENTRY)
    assert client.sent[0].ttft_slo_ms == 1500 and client.sent[0].tpot_slo_ms == 0


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon", "1e99"])
def test_bad_targets_are_refused(value):
    with pytest.raises(APIError) as err:
        slo_header({"X-SLO-TPOT-Ms": value}, "X-SLO-TPOT-Ms")
    assert err.value.status == 400 and "X-SLO-TPOT-Ms" in err.value.message


async def test_a_bad_target_is_a_400_through_the_data_plane(http):
    cluster = start_cluster({"agg": "both"}, policy="predicted_latency")
    try:
        body = {"model": "sim-model", "prompt": "x", "max_tokens": 2}
        async with http.post(cluster.url + "/v1/completions", json=body, headers={"X-SLO-TTFT-Ms": "fast"}) as r:
            assert r.status == 400 and "X-SLO-TTFT-Ms" in (await r.json())["error"]["message"]
        async with http.post(cluster.url + "/v1/completions", json=body,
                             headers={"X-SLO-TTFT-Ms": "2000", "X-SLO-TPOT-Ms": "100"}) as r:
            assert r.status == 200
        assert await cluster.sim_requests("agg")       # the good one reached the engine
    finally:
        cluster.group.close()
