"""The metaserver behind its port (metaserver/ports.py): driven here by a stand-in control
plane, with prefill engines on loopback, it places each prefill leg through the port,
reports how the leg went, and retries on another prefill worker by the shared retry policy
(omni_runtime.retry): after an engine's 5xx, never after a 4xx (the request's own fault)."""

from __future__ import annotations

import dataclasses

import aiohttp
import orjson
import pytest
from aiohttp import web

from metaserver.ports import ControlPlanePort
from metaserver.server import Metaserver
from omni_runtime import start_http_site
from protos import omni_proxy_pb2 as pb
from tests.conftest import wait_until


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Engines:
    """Prefill engines on loopback, each answering with its own status."""

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.got: dict[str, list[dict]] = {}
        self.urls: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []

    async def add(self, worker_id: str, status: int) -> None:
        self.statuses[worker_id] = status
        self.got[worker_id] = []

        async def completions(request: web.Request) -> web.Response:
            self.got[worker_id].append(orjson.loads(await request.read()))
            status = self.statuses[worker_id]
            return web.json_response({"error": {"message": f"{worker_id} says {status}"}} if status != 200 else {},
                                     status=status)

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner, port = await start_http_site(app, "127.0.0.1", 0)
        self._runners.append(runner)
        self.urls[worker_id] = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


class StandInControlPlane:
    """What the metaserver sees of the control plane: placements in worker order, minus the
    excluded; every request and report kept."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.placed: list[pb.PlaceRequest] = []
        self.reports: list[tuple[int, str, int]] = []

    async def place(self, req: pb.PlaceRequest) -> pb.Placement:
        self.placed.append(req)
        free = [w for w in self.engines.urls if w not in req.exclude_workers]
        if not free:
            return pb.Placement(request_id=req.request_id, error=pb.NO_HEALTHY_WORKER,
                                error_message="no available prefill worker")
        wid = free[0]
        return pb.Placement(request_id=req.request_id, flow=pb.FLOW_LAYERWISE,
                            prefill=pb.Endpoint(worker_id=wid, url=self.engines.urls[wid], role=pb.ROLE_PREFILL))

    async def report(self, event: pb.LifecycleEvent) -> None:
        self.reports.append((event.kind, event.worker_id, event.upstream_status))


@pytest.fixture
async def setup():
    engines = Engines()
    plane = StandInControlPlane(engines)
    port: ControlPlanePort = plane      # (what the type checker holds the stand-in to)
    meta = Metaserver(port, prefill_retries=2)
    meta.retry = dataclasses.replace(meta.retry, base_s=0.0)    # no pause between attempts here
    app = web.Application()
    meta.add_routes(app)
    await meta.start()
    runner, http_port = await start_http_site(app, "127.0.0.1", 0)
    yield engines, plane, meta, f"http://127.0.0.1:{http_port}/v1/metaserver"
    await runner.cleanup()
    await meta.stop()
    await engines.close()


async def _layerwise_request(meta: Metaserver, url: str, rid: str) -> str:
    """Register a placed layerwise request as the placer's hook would; the decode engine's
    metaserver URL (with its token)."""
    req = pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=3, max_tokens=4,
                          path="/v1/completions", engine_request_id=rid, num_prompts=1,
                          body=orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}),
                          trace_headers={"traceparent": TRACEPARENT})
    placement = pb.Placement(request_id=rid, flow=pb.FLOW_LAYERWISE, metaserver_url=url,
                             decode=pb.Endpoint(worker_id="d", url="http://127.0.0.1:9", role=pb.ROLE_DECODE))
    assert meta.register(req, placement)
    return placement.metaserver_url


async def _decode_calls(url: str, rid: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"request_id": f"cmpl-{rid}-0", "remote_host": "127.0.0.1"}) as r:
            return r.status, await r.json()


async def test_a_failed_prefill_is_placed_again_through_the_port_and_sent_elsewhere(setup):
    engines, plane, meta, url = setup
    await engines.add("p1", 500)
    await engines.add("p2", 200)
    status, answer = await _decode_calls(await _layerwise_request(meta, url, "r1"), "r1")
    assert (status, answer) == (200, {"status": "ok"})
    assert [list(r.exclude_workers) for r in plane.placed] == [[], ["p1"]]
    assert all(r.leg == pb.LEG_PREFILL and r.request_id == "r1" for r in plane.placed)
    assert all(dict(r.trace_headers) == {"traceparent": TRACEPARENT} for r in plane.placed)   # one trace
    assert plane.reports == [(pb.EVENT_LEG_FAILED, "p1", 500), (pb.EVENT_PREFILL_DONE, "", 0)]
    (sent,) = engines.got["p2"]
    assert sent["prompt"] == "hello" and sent["max_tokens"] == 1 and sent["kv_transfer_params"]["remote_host"] == \
        "127.0.0.1"


async def test_a_prefill_4xx_is_not_tried_on_another_prefill_worker(setup):
    engines, plane, meta, url = setup
    await engines.add("p1", 400)
    await engines.add("p2", 200)
    status, answer = await _decode_calls(await _layerwise_request(meta, url, "r2"), "r2")
    assert status == 502 and "p1 says 400" in answer["error"]["message"]
    assert len(plane.placed) == 1 and engines.got["p2"] == []
    assert plane.reports == [(pb.EVENT_LEG_FAILED, "p1", 400)]


async def test_prefill_retries_stop_at_the_configured_count(setup):
    engines, plane, meta, url = setup
    for wid in ("p1", "p2", "p3", "p4"):
        await engines.add(wid, 503)
    status, _ = await _decode_calls(await _layerwise_request(meta, url, "r3"), "r3")
    assert status == 502
    assert [r[1] for r in plane.reports] == ["p1", "p2", "p3"]     # the first, then prefill_retries=2 more
    assert engines.got["p4"] == []


# ---------------------------------------------------------------------------- the hand-over


async def test_the_request_is_handed_over_apart_from_the_placement(setup):
    """No body on the placement session: the metaserver holds D's call until the data plane
    has handed the request over (with the request's token), then sends P that request."""
    import asyncio

    from engine_api.metaserver import body_url

    engines, plane, meta, url = setup
    await engines.add("p1", 200)
    req = pb.PlaceRequest(request_id="r4", model="m", leg=pb.LEG_ENTRY, prompt_tokens=3, max_tokens=4,
                          path="/v1/completions", engine_request_id="r4-a", num_prompts=1)
    placement = pb.Placement(request_id="r4", flow=pb.FLOW_LAYERWISE, metaserver_url=url,
                             decode=pb.Endpoint(worker_id="d", url="http://127.0.0.1:9", role=pb.ROLE_DECODE))
    assert meta.register(req, placement)
    decode_call = asyncio.create_task(_decode_calls(placement.metaserver_url, "r4-a"))
    target = body_url(placement.metaserver_url, "r4")
    assert target.startswith(url + "/body/r4?token=")
    body = orjson.dumps({"model": "m", "prompt": "handed over", "max_tokens": 4})
    async with aiohttp.ClientSession() as http:
        async with http.post(body_url(url + "?token=guess", "r4"), data=body) as r:
            assert r.status == 403
        async with http.post(body_url(placement.metaserver_url, "nobody"), data=body) as r:
            assert r.status == 404
        entry = meta.table.get("r4")
        await wait_until(lambda: entry is not None and "cmpl-r4-a-0" in entry.params, what="D's call")
        assert not decode_call.done() and engines.got["p1"] == []   # D waits for the request
        async with http.post(target, data=body) as r:
            assert r.status == 200, await r.text()
        assert await decode_call == (200, {"status": "ok"})
        async with http.post(target, data=body) as r:
            assert r.status == 409       # once: it cannot be replaced
    (sent,) = engines.got["p1"]
    assert sent["prompt"] == "handed over" and sent["max_tokens"] == 1


async def test_the_data_plane_places_a_layerwise_request_with_ids_only():
    from dataplane.placing import place
    from dataplane.requests import ClientRequest

    class Placements:
        info = pb.SessionInfo(pd_flow=pb.FLOW_LAYERWISE)
        sent: list[pb.PlaceRequest] = []

        async def place(self, msg: pb.PlaceRequest | pb.DataPlaneMessage) -> pb.Placement:
            if isinstance(msg, pb.DataPlaneMessage):    # (the session message it rides in)
                msg = msg.place
            self.sent.append(msg)
            return pb.Placement(request_id=msg.request_id, flow=pb.FLOW_LAYERWISE)

        def place_here(self, msg: pb.DataPlaneMessage) -> None:
            return None     # (the control plane did not offer local placement)

    placements = Placements()
    raw = orjson.dumps({"model": "m", "prompt": "x" * 10_000})
    req = ClientRequest(path="/v1/completions", raw=raw, body=orjson.loads(raw), model="m", stream=False,
                        max_tokens=4, prompt_tokens=10_000, request_id="r-1", placement_id="p-1", num_prompts=2)
    await place(placements, req, pb.LEG_ENTRY)
    (msg,) = placements.sent
    assert msg.body == b"" and msg.ByteSize() < 200
    assert (msg.request_id, msg.engine_request_id, msg.num_prompts, msg.path) == ("p-1", "r-1", 2, "/v1/completions")
