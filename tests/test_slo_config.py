"""The deployment's SLO targets (``[slo] ttft_ms`` / ``tpot_ms``, ``--slo-ttft-ms`` /
``--slo-tpot-ms``): a request without X-SLO-* headers is placed exactly as if it had sent
them; a header still wins, target by target.

The placements are observed through the opt-in ``slo`` filter (it keeps only the engines
predicted to meet the request's targets, and keeps everyone when the request has none), on
the components the control plane runs (``compose.build`` from a parsed config file).
"""

from __future__ import annotations

import itertools
import tomllib

import pytest

from controlplane.compose import Components, build
from controlplane.config import ControlPlaneConfig
from controlplane.workers import Health, HealthState, Role, WorkerSpec
from protos import omni_proxy_pb2 as pb

_ids = itertools.count()
PROFILE = """
policy = "slo_only"
[profiles.slo_only]
filters = [{name = "slo"}]
picker = "round_robin"
"""


async def plane(slo: str) -> Components:
    """The control plane's components for ``[slo]`` = ``slo`` (TOML lines), two healthy engines:
    ``a`` predicted 1.01 s to first token and 200 ms a token for a 1k-token prompt, ``b``
    0.11 s and 20 ms."""
    parts = build(ControlPlaneConfig.from_dict(tomllib.loads(PROFILE + "[slo]\n" + slo)))
    for wid in ("a", "b"):
        spec = WorkerSpec(id=wid, url=f"http://{wid}", role=Role.BOTH, model="m")
        await parts.store.put_spec(spec)
        parts.fleet.put(spec)
        parts.fleet.set_state(wid, HealthState(health=Health.HEALTHY))
    for wid, s_per_token, tpot in (("a", 1e-3, 0.2), ("b", 1e-4, 0.02)):
        model = parts.predictor.model(wid)
        for i in range(100):
            model.observe_ttft(500 + 100 * i, 0.01 + s_per_token * (500 + 100 * i))
            model.observe_tpot(1 + i % 30, tpot)
    return parts


async def engines(parts: Components, n: int = 6, **headers: float) -> set[str]:
    """Where ``n`` 1k-token requests go (each ended before the next), with these header targets."""
    seen = set()
    for _ in range(n):
        rid = f"r{next(_ids)}"
        p = await parts.placer.place(pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY,
                                                     prompt_tokens=1000, max_tokens=10, **headers), "s")
        assert p.error == pb.OK, p.error_message
        seen.add(p.decode.worker_id)
        await parts.store.end(rid)
    return seen


async def test_without_targets_every_engine_is_kept():
    parts = await plane("")
    assert (parts.placer.ttft_slo_s, parts.placer.tpot_slo_s) == (0.0, 0.0)
    assert await engines(parts) == {"a", "b"}
    assert await engines(parts, ttft_slo_ms=500) == {"b"}      # the header alone, as before


@pytest.mark.parametrize("slo, header, loose", [
    ("ttft_ms = 500", "ttft_slo_ms", 5000.0),     # a misses 0.5 s to first token, b meets it
    ("tpot_ms = 50", "tpot_slo_ms", 1000.0),      # a misses 50 ms a token, b meets it
])
async def test_a_configured_target_acts_as_the_header_and_a_header_wins(slo, header, loose):
    parts = await plane(slo)
    # Without headers: every request placed as if it had named the deployment's target ...
    assert await engines(parts) == {"b"}
    # ... which is where the same target sent as a header puts it.
    target = float(slo.split("=")[1])
    assert await engines(parts, **{header: target}) == {"b"}
    # The request's own, looser target wins over the deployment's: both engines meet it.
    assert await engines(parts, **{header: loose}) == {"a", "b"}


async def test_a_header_replaces_only_the_target_it_names():
    parts = await plane("ttft_ms = 500\ntpot_ms = 50")
    assert (parts.placer.ttft_slo_s, parts.placer.tpot_slo_s) == (0.5, 0.05)
    # A loose TTFT of its own: the deployment's TPOT still applies, which only b meets.
    assert await engines(parts, ttft_slo_ms=5000) == {"b"}
    assert await engines(parts, ttft_slo_ms=5000, tpot_slo_ms=1000) == {"a", "b"}


def test_flags_set_the_targets_over_the_file(tmp_path):
    from omni_proxy.cli import build_parser

    path = tmp_path / "cp.toml"
    path.write_text("[slo]\nttft_ms = 2000\ntpot_ms = 100\n")
    args = build_parser().parse_args(["controlplane", "--config", str(path), "--slo-ttft-ms", "750"])
    from controlplane.cli import config_from_args

    cfg = config_from_args(args)
    assert (cfg.slo.ttft_ms, cfg.slo.tpot_ms) == (750.0, 100.0)
    assert {"slo.ttft_ms", "slo.tpot_ms"} <= cfg.explicit
