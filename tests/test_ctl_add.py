"""AddWorker's first check, in process: the model must be listed, an SGLang engine's PD role
must match, and replace starts a different engine from a fresh health state."""

from __future__ import annotations

import grpc
import pytest
from aiohttp import web

from controlplane.workers import Health
from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc


@pytest.fixture
async def sglang_like():
    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        return web.json_response({"data": [{"id": "m"}]})

    async def info(_):
        return web.json_response({"disaggregation_mode": "decode"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def admin(inproc_cp):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{inproc_cp.grpc_port}") as channel:
        yield pb_grpc.AdminStub(channel)


async def test_first_check_reports_role_and_model_mismatches(admin, sglang_like):
    resp = await admin.AddWorker(pb.RegisterRequest(url=sglang_like, role=pb.ROLE_DECODE, model="m"), timeout=10)
    assert resp.checked and resp.check_error == "" and resp.worker.status == pb.STATUS_HEALTHY
    resp = await admin.AddWorker(pb.RegisterRequest(url=sglang_like, role=pb.ROLE_PREFILL, model="m",
                                                    replace=True), timeout=10)
    assert resp.checked and "runs as decode" in resp.check_error
    resp = await admin.AddWorker(pb.RegisterRequest(url=sglang_like, role=pb.ROLE_DECODE, model="other",
                                                    replace=True), timeout=10)
    assert "does not list model 'other'" in resp.check_error


async def test_replace_with_another_engine_starts_unchecked(admin, inproc_cp):
    assert inproc_cp.fleet.state("w").health is Health.HEALTHY
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.AddWorker(pb.RegisterRequest(url="http://127.0.0.1:9", role=pb.ROLE_BOTH, worker_id="w"),
                              timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert inproc_cp.fleet.state("w").health is Health.HEALTHY and inproc_cp.fleet.get("w").url != "http://127.0.0.1:9"
    resp = await admin.AddWorker(pb.RegisterRequest(url="http://127.0.0.1:9", role=pb.ROLE_BOTH, worker_id="w",
                                                    replace=True), timeout=10)
    assert resp.checked and resp.check_error and resp.worker.status == pb.STATUS_UNHEALTHY
    assert inproc_cp.fleet.get("w").url == "http://127.0.0.1:9"
