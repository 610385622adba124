"""The PD-flow deciders alone (controlplane.scheduling.pd_flow): the names config accepts, which
workers may take an entry, each flow's plan for the worker chosen, later legs, and the
placement message and charges the placer builds from a plan. In process, no engines.
(Whole flows: tests/test_placement.py and the e2e PD tests.)"""

from __future__ import annotations

import argparse

import pytest

from controlplane import cli, config
from controlplane.fleet import Fleet
from controlplane.placement import Placer
from controlplane.scheduling import build_profile
from controlplane.scheduling.pd_flow import (AGGREGATED, PD_FLOWS, FlowPlan, LayerwiseFlow, ParallelFlow,
                                             SequentialFlow, build_pd_flow, later_leg)
from controlplane.state import MemoryStore
from controlplane.workers import Health, HealthState, Role, WorkerSpec, WorkerView
from protos import omni_proxy_pb2 as pb


def view(wid: str, role: Role, dp_size: int = 1) -> WorkerView:
    return WorkerView(WorkerSpec(id=wid, url=f"http://{wid}", role=role, model="m", bootstrap_port=8998,
                                 dp_size=dp_size))


BOTH, P, D = view("a", Role.BOTH), view("p", Role.PREFILL), view("d", Role.DECODE)


def test_every_existing_pd_flow_name_builds_its_decider():
    assert list(PD_FLOWS) == ["sequential", "parallel", "layerwise"]
    for name, cls, flow in (("sequential", SequentialFlow, pb.FLOW_SEQUENTIAL),
                            ("parallel", ParallelFlow, pb.FLOW_PARALLEL),
                            ("layerwise", LayerwiseFlow, pb.FLOW_LAYERWISE)):
        decider = build_pd_flow(name)
        assert isinstance(decider, cls) and decider.name == name and decider.flow == flow
    expected = "unknown pd flow 'pipelined'; expected one of sequential, parallel, layerwise"
    with pytest.raises(ValueError, match=expected):
        build_pd_flow("pipelined")


def test_config_and_flags_accept_exactly_the_registered_deciders():
    assert config.PD_FLOWS == tuple(PD_FLOWS)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flag = next(a for a in parser._actions if "--pd-flow" in a.option_strings)
    assert list(flag.choices) == list(PD_FLOWS)


def test_prefill_workers_take_an_entry_only_while_a_decode_worker_is_routable():
    for name in PD_FLOWS:
        decider = build_pd_flow(name)
        assert decider.entry_roles(True) == (Role.BOTH, Role.PREFILL)
        assert decider.entry_roles(False) == (Role.BOTH,)


def test_an_aggregated_worker_runs_the_request_whole_in_every_flow():
    for name in PD_FLOWS:
        assert build_pd_flow(name).entry(BOTH) == AGGREGATED == FlowPlan(pb.FLOW_AGGREGATED, "aggregated")


def test_each_flow_plans_a_chosen_prefill_worker_its_own_way():
    # Sequential: P now, D later (its own leg).
    assert build_pd_flow("sequential").entry(P) == FlowPlan(pb.FLOW_SEQUENTIAL, "prefill")
    # Parallel: P and D now.
    assert build_pd_flow("parallel").entry(P) == FlowPlan(pb.FLOW_PARALLEL, "prefill", with_decode=True)
    # Layerwise: D now; P is the metaserver's choice later, so the chosen P has no leg here.
    assert build_pd_flow("layerwise").entry(P) == FlowPlan(pb.FLOW_LAYERWISE, "", with_decode=True,
                                                           via_metaserver=True)


def test_later_legs_keep_the_recorded_flow_and_take_their_roles_leg():
    assert later_leg(Role.DECODE, pb.FLOW_SEQUENTIAL) == FlowPlan(pb.FLOW_SEQUENTIAL, "decode")
    assert later_leg(Role.PREFILL, pb.FLOW_PARALLEL) == FlowPlan(pb.FLOW_PARALLEL, "prefill")
    assert later_leg(Role.BOTH, pb.FLOW_SEQUENTIAL) == AGGREGATED


@pytest.mark.parametrize("name", list(PD_FLOWS))
def test_the_placer_tells_data_planes_its_deciders_flow(name):
    placer = Placer(MemoryStore(), Fleet(), build_profile("least_load"), pd_flow=name)
    assert placer.pd_flow == PD_FLOWS[name].flow and placer.flows.name == name


def test_a_plan_becomes_endpoints_and_charges_in_charge_order():
    placer = Placer(MemoryStore(), Fleet(), build_profile("least_load"), pd_flow="layerwise")
    placer.metaserver_url = "http://cp/v1/metaserver"
    req = pb.PlaceRequest(seq=7, request_id="r1", model="m", leg=pb.LEG_ENTRY)

    out, charges = placer._placement(req, AGGREGATED, BOTH, None)
    assert (out.seq, out.request_id, out.flow) == (7, "r1", pb.FLOW_AGGREGATED)
    assert out.decode.worker_id == "a" and not out.HasField("prefill") and not out.metaserver_url
    assert charges == [(BOTH, "aggregated")]

    out, charges = placer._placement(req, ParallelFlow.split, P, D)
    assert (out.flow, out.prefill.worker_id, out.decode.worker_id) == (pb.FLOW_PARALLEL, "p", "d")
    assert out.prefill.bootstrap_port == 8998 and out.prefill.role == pb.ROLE_PREFILL
    assert charges == [(P, "prefill"), (D, "decode")]

    out, charges = placer._placement(req, LayerwiseFlow.split, P, D)
    assert (out.flow, out.decode.worker_id, out.metaserver_url) == (pb.FLOW_LAYERWISE, "d", "http://cp/v1/metaserver")
    assert not out.HasField("prefill") and charges == [(D, "decode")]

    out, charges = placer._placement(req, later_leg(Role.DECODE, pb.FLOW_SEQUENTIAL), D, None)
    assert (out.flow, out.decode.worker_id) == (pb.FLOW_SEQUENTIAL, "d") and charges == [(D, "decode")]


async def placer_with(flow: str, *specs: WorkerSpec) -> tuple[Placer, MemoryStore]:
    store, fleet = MemoryStore(), Fleet()
    for s in specs:
        await store.put_spec(s)
        fleet.put(s)
        fleet.set_state(s.id, HealthState(health=Health.HEALTHY))
    placer = Placer(store, fleet, build_profile("least_load"), pd_flow=flow)
    placer.metaserver_url = "http://cp/v1/metaserver"
    return placer, store


def entry(rid: str, **kw) -> pb.PlaceRequest:
    return pb.PlaceRequest(request_id=rid, model="m", leg=pb.LEG_ENTRY, prompt_tokens=64, max_tokens=8, **kw)


async def test_a_decode_worker_chosen_with_the_entry_is_explained_charged_or_refused():
    placer, store = await placer_with("parallel", P.spec, D.spec)
    out = await placer.place(entry("x"), dry_run=True)
    assert (out.flow, out.prefill.worker_id, out.decode.worker_id) == (pb.FLOW_PARALLEL, "p", "d")
    assert " | decode: policy=least_load; *d " in out.explanation
    assert await store.get("x") is None                       # an explanation reserves nothing
    await placer.place(entry("r1"))
    assert [(c.worker_id, c.leg) for c in (await store.get("r1")).charges] == [("p", "prefill"), ("d", "decode")]
    # D routable but not a candidate for this request: refused for want of a decode worker.
    refused = await placer.place(entry("r2", exclude_workers=["d"]))
    assert refused.error == pb.NO_HEALTHY_WORKER
    assert refused.error_message == "no available decode worker for model 'm' (1 excluded, 1 role)"
    assert await store.get("r2") is None


async def test_layerwise_charges_only_the_decode_worker_and_tells_the_metaserver():
    placer, store = await placer_with("layerwise", P.spec, D.spec)
    seen: list[tuple[str, str]] = []
    placer.layerwise_placed.subscribe(lambda req, out: seen.append((req.request_id, out.decode.worker_id)))
    out = await placer.place(entry("r1"))
    assert (out.flow, out.decode.worker_id, out.metaserver_url) == (pb.FLOW_LAYERWISE, "d", "http://cp/v1/metaserver")
    assert not out.HasField("prefill")
    assert [(c.worker_id, c.leg) for c in (await store.get("r1")).charges] == [("d", "decode")]
    assert seen == [("r1", "d")]
