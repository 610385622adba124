"""PD-flow deciders: which flow a request takes, as a plugin chosen by name (``pd_flow``).

llm-d calls this a "PD profile handler": after the scheduler has chosen where a request's
first leg runs, something must say whether it runs there whole (aggregated) or split into a
prefill and a decode leg, and how the legs meet. Here that is one small decision per
deployment, kept apart from the placer so that a new flow (or a rule such as "split only
long prompts") is one class registered in ``PD_FLOWS``, not another branch in
``Placer.place``.

A decider answers two questions of an entry leg (a request's first placement):

* ``entry_roles``: which workers may take it. Aggregated workers always; prefill workers
  only while a decode worker is routable for the model (a prefill with no decode to follow
  would fail after its work was done);
* ``entry``: given the chosen worker, the request's ``FlowPlan``: its flow, what the chosen
  worker is charged for and sent, and whether a decode worker is chosen now as well.

The flows that exist (the data plane runs them: ``dataplane/flows/``):

* ``sequential`` (default; vLLM NixlConnector, "pull"): P now, D once P has answered
  (a later decode leg, placed by ``later_leg``), so D is chosen on its load at that moment;
* ``parallel`` (SGLang, Mooncake bootstrap): P and D chosen together, both sent at once;
* ``layerwise`` (vLLM-Ascend, "push", D first): D chosen now; P is not sent from here, the
  metaserver chooses it when D asks for its prefill, so the prefill worker chosen at entry
  is only the proof that one can take it and is not charged.

A chosen aggregated worker makes every flow ``FLOW_AGGREGATED``. Later legs (a prefill
retried elsewhere, sequential's decode) keep the flow recorded at entry (``later_leg``),
whatever the deployment's decider says now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

from controlplane.workers import Role, WorkerView
from protos import omni_proxy_pb2 as pb

PD_ENTRY_ROLES = (Role.BOTH, Role.PREFILL)
AGGREGATED_ONLY = (Role.BOTH,)


@dataclass(frozen=True, slots=True)
class FlowPlan:
    """What one placement does with its chosen worker."""

    flow: pb.Flow                   # the flow the request takes
    # What the chosen worker is charged for and sent: "aggregated" and "decode" as the decode
    # endpoint, "prefill" as the prefill endpoint; "" for neither (layerwise: P comes later).
    chosen_leg: str
    with_decode: bool = False       # choose a decode worker now too (sent as the decode endpoint)
    via_metaserver: bool = False    # D asks the metaserver for its prefill (the placement names it)


AGGREGATED = FlowPlan(pb.FLOW_AGGREGATED, "aggregated")


class PDFlow(Protocol):
    """A PD-flow decider (see the module's docstring)."""

    name: str
    flow: pb.Flow   # the flow of this deployment's split requests (told to data planes)

    def entry_roles(self, decode_routable: bool) -> tuple[Role, ...]: ...

    def entry(self, chosen: WorkerView) -> FlowPlan: ...


class _SplitFlow:
    """The shared part of the built-in deciders: every prompt is split when a prefill worker
    is chosen, and an aggregated worker runs its request whole."""

    name = ""
    flow: pb.Flow = pb.FLOW_UNSPECIFIED
    split: FlowPlan = AGGREGATED

    def entry_roles(self, decode_routable: bool) -> tuple[Role, ...]:
        return PD_ENTRY_ROLES if decode_routable else AGGREGATED_ONLY

    def entry(self, chosen: WorkerView) -> FlowPlan:
        return AGGREGATED if chosen.spec.role is Role.BOTH else self.split


class SequentialFlow(_SplitFlow):
    """P now; D placed by the decode leg once P has answered."""

    name = "sequential"
    flow = pb.FLOW_SEQUENTIAL
    split = FlowPlan(pb.FLOW_SEQUENTIAL, "prefill")


class ParallelFlow(_SplitFlow):
    """P and D now, sent at once."""

    name = "parallel"
    flow = pb.FLOW_PARALLEL
    split = FlowPlan(pb.FLOW_PARALLEL, "prefill", with_decode=True)


class LayerwiseFlow(_SplitFlow):
    """D now; the metaserver chooses P when D asks for its prefill."""

    name = "layerwise"
    flow = pb.FLOW_LAYERWISE
    split = FlowPlan(pb.FLOW_LAYERWISE, "", with_decode=True, via_metaserver=True)


PD_FLOWS: dict[str, type[_SplitFlow]] = {cls.name: cls for cls in (SequentialFlow, ParallelFlow, LayerwiseFlow)}


def build_pd_flow(name: str) -> PDFlow:
    """The decider ``pd_flow`` names."""
    cls = PD_FLOWS.get(name)
    if cls is None:
        raise ValueError(f"unknown pd flow {name!r}; expected one of {', '.join(PD_FLOWS)}")
    return cls()


def later_leg(role: Role, flow: int) -> FlowPlan:
    """A later leg's plan (a prefill leg, a decode leg): the chosen worker takes the leg its
    role runs, and the request keeps ``flow``, the one recorded at its entry (as its number)."""
    if role is Role.BOTH:
        return AGGREGATED
    return FlowPlan(cast(pb.Flow, flow), "prefill" if role is Role.PREFILL else "decode")
