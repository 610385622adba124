"""The commit step alone (controlplane.commit): the ledger's charges and notes of a decided
placement, and what committing changes after the ledger (fleet order, prefix bookkeeping,
counters), or does not when the ledger fails. In process: a MemoryStore, a Fleet and a
recording prefix index; no placer, no decision. (Whole placements: tests/test_placement.py.)"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from controlplane.commit import PlacementCommit, ledger_charges
from controlplane.fleet import Fleet
from controlplane.placement_stats import PlacementStats
from controlplane.scheduling import PlacementContext
from controlplane.state import Charge, MemoryStore, RequestRecord
from controlplane.workers import IDLE, Load, Role, WorkerSpec, WorkerView
from protos import omni_proxy_pb2 as pb

NOW = 1000.0


def view(wid: str, role: Role = Role.BOTH, load: Load = IDLE, dp_size: int = 1) -> WorkerView:
    return WorkerView(WorkerSpec(id=wid, url=f"http://{wid}", role=role, model="m", dp_size=dp_size), load)


def ctx(leg: str = "entry", **kw) -> PlacementContext:
    return PlacementContext(request_id="r1", model="m", leg=leg, prompt_tokens=100, max_tokens=20, block_size=16,
                            **kw)


def charged(charges, c: PlacementContext | None = None, *, flow=pb.FLOW_AGGREGATED, ranks=None, record=None):
    """ledger_charges of ``charges`` at NOW."""
    return ledger_charges(c or ctx(), charges, flow=flow, ranks=ranks or {}, record=record, now=NOW)


async def commit_of(commit: PlacementCommit, charges, c: PlacementContext | None = None, *,
                    flow=pb.FLOW_AGGREGATED, ranks=None, kv=None) -> None:
    await commit.write(c or ctx(), charges, flow=flow, ranks=ranks or {}, record=None, session="s1", kv=kv)


class Prefixes:
    """Records what the commit step told the prefix index."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], int, int]] = []

    def placed(self, worker, chain: Sequence[int], predicted_depth: int, dp_rank: int = 0) -> None:
        self.calls.append((worker.id, list(chain), predicted_depth, dp_rank))


def test_aggregated_charge_holds_the_whole_request_and_its_uncached_prompt():
    a = view("a", load=Load(requests=2, tokens=50, prefill_tokens=30))
    c = ctx(match_blocks={"a": 2}, predicted={"a": (0.25, 0.01)})
    charges, notes = charged([(a, "aggregated")], c)
    assert charges == [Charge(worker_id="a", leg="aggregated", tokens=120, prefill_tokens=100 - 32)]
    assert notes == {"work_ahead_tokens": 30 + 68, "predicted_ttft_s": 0.25, "decode_batch": 3}


def test_parallel_pd_charges_prefill_with_the_prompt_and_decode_with_the_request():
    p, d = view("p", Role.PREFILL), view("d", Role.DECODE, Load(requests=4))
    charges, notes = charged([(p, "prefill"), (d, "decode")], flow=pb.FLOW_PARALLEL)
    assert charges == [Charge("p", "prefill", 100, 100), Charge("d", "decode", 120, 0)]
    assert notes == {"work_ahead_tokens": 100, "predicted_ttft_s": 0.0, "decode_batch": 5}


def test_a_dp_rank_is_charged_beside_its_worker():
    a = view("a", dp_size=4)
    charges, _ = charged([(a, "aggregated")], ranks={"a": 3})
    assert [c.worker_id for c in charges] == ["a", "a#3"]
    assert charges[0].tokens == charges[1].tokens == 120


def test_sequential_decode_leg_notes_when_the_pull_started_and_its_size():
    d = view("d", Role.DECODE)
    c = ctx("decode", match_blocks={"d": 5})
    record = RequestRecord(request_id="r1", model="m", prompt_tokens=100, max_tokens=20, flow=pb.FLOW_SEQUENTIAL)
    _, notes = charged([(d, "decode")], c, flow=pb.FLOW_SEQUENTIAL, record=record)
    assert notes == {"decode_batch": 1, "decode_placed_at": NOW, "pull_tokens": 100 - 80}
    # Another flow's decode leg pulls nothing placement times.
    _, notes = charged([(d, "decode")], c, flow=pb.FLOW_PARALLEL, record=record)
    assert notes == {"decode_batch": 1}


def test_a_prefill_tried_again_is_timed_from_its_new_placement():
    p = view("p", Role.PREFILL)
    record = RequestRecord(request_id="r1", model="m", prompt_tokens=100, max_tokens=20, flow=pb.FLOW_SEQUENTIAL)
    _, notes = charged([(p, "prefill")], ctx("prefill"), flow=pb.FLOW_SEQUENTIAL, record=record)
    assert notes["placed_at"] == NOW
    _, first = charged([(p, "prefill")], flow=pb.FLOW_SEQUENTIAL)
    assert "placed_at" not in first            # a new record is created with placed_at itself


def fleet_of(*views: WorkerView) -> Fleet:
    fleet = Fleet()
    for v in views:
        fleet.put(v.spec)
    return fleet


async def test_commit_reserves_then_counts_and_the_computing_worker_holds_the_prompt():
    p, d = view("p", Role.PREFILL, dp_size=2), view("d", Role.DECODE)
    store, fleet, stats, kv = MemoryStore(), fleet_of(p, d), PlacementStats.new(), Prefixes()
    commit = PlacementCommit(store, fleet, stats, store_notes_loads=False)
    chain = [1, 2, 3, 4]
    await commit_of(commit, [(p, "prefill"), (d, "decode")], ctx(match_blocks={"p": 3}, chain=chain),
                    flow=pb.FLOW_PARALLEL, ranks={"p": 1}, kv=kv)
    record = await store.get("r1")
    assert record is not None and record.session == "s1" and record.flow == pb.FLOW_PARALLEL
    assert [c.worker_id for c in record.charges] == ["p", "p#1", "d"]
    loads = await store.loads(["p", "p#1", "d"])
    assert (loads["p"].requests, loads["p#1"].requests, loads["d"].tokens) == (1, 1, 120)
    assert kv.calls == [("p", chain, 3, 1)]             # D decodes: its cache is not what P computed
    assert stats.placed == {("p", "prefill"): 1, ("d", "decode"): 1}
    assert stats.predicted_hit_blocks == {"p": 3} and stats.query_blocks == {"p": 4}
    assert fleet.placements == {"p": 1, "d": 1}


@pytest.mark.parametrize("leg, flow, roles", [
    ("entry", pb.FLOW_PARALLEL, [(Role.PREFILL, "prefill"), (Role.DECODE, "decode")]),
    ("decode", pb.FLOW_SEQUENTIAL, [(Role.DECODE, "decode")]),   # every note a new record can hold
])
async def test_a_new_request_is_recorded_once_with_its_charges_and_notes(leg, flow, roles):
    """The commit step builds a new request's record itself, positionally and holding its
    charges (the store keeps it as it is): every field in its place, as the keyword build
    of the same values, and its charges in the loads once."""
    views = [(view(f"w{i}", role, Load(requests=2, prefill_tokens=7)), charge_leg)
             for i, (role, charge_leg) in enumerate(roles)]
    store = MemoryStore()
    commit = PlacementCommit(store, fleet_of(*(v for v, _ in views)), PlacementStats.new(), store_notes_loads=True)
    c = ctx(leg, match_blocks={"w0": 1}, predicted={"w0": (0.5, 0.02)})
    await commit.write(c, views, flow=flow, ranks={}, record=None, session="s1", kv=None)
    got = await store.get("r1")
    assert got is not None
    charges, notes = ledger_charges(c, views, flow=flow, ranks={}, record=None, now=got.created_at)
    assert got == RequestRecord(request_id="r1", model="m", prompt_tokens=100, max_tokens=20, session="s1",
                                flow=flow, charges=tuple(charges), created_at=got.created_at,
                                placed_at=got.created_at, **notes)
    assert all(getattr(got, k) for k in notes), notes          # (no note left at its default)
    loads = await store.loads([v.id for v, _ in views])
    assert [loads[v.id].requests for v, _ in views] == [1] * len(views)


async def test_the_fleet_order_is_told_only_when_the_store_does_not_tell_it():
    a = view("a", load=Load(requests=1, tokens=10))
    for store_notes_loads, expected in ((False, [("a", Load(requests=2, tokens=130))]), (True, [])):
        fleet = fleet_of(a)
        told: list[tuple[str, Load]] = []
        fleet.note_load = lambda wid, load, told=told: told.append((wid, load))   # type: ignore[method-assign]
        commit = PlacementCommit(MemoryStore(), fleet, PlacementStats.new(), store_notes_loads=store_notes_loads)
        await commit_of(commit, [(a, "aggregated")])
        assert told == expected


async def test_no_chain_no_prefix_bookkeeping():
    a = view("a")
    stats, kv = PlacementStats.new(), Prefixes()
    await commit_of(PlacementCommit(MemoryStore(), fleet_of(a), stats, store_notes_loads=True), [(a, "aggregated")],
                    kv=kv)
    assert kv.calls == [] and not stats.query_blocks and stats.placed == {("a", "aggregated"): 1}


async def test_a_failing_ledger_leaves_every_count_untouched():
    class Down(MemoryStore):
        async def reserve(self, record, charges, **notes):
            raise ConnectionError("ledger away")

    a = view("a")
    fleet, stats, kv = fleet_of(a), PlacementStats.new(), Prefixes()
    with pytest.raises(ConnectionError):
        await commit_of(PlacementCommit(Down(), fleet, stats, store_notes_loads=False), [(a, "aggregated")],
                        ctx(chain=[1, 2]), kv=kv)
    assert not stats.placed and not fleet.placements and kv.calls == []
