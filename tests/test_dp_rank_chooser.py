"""The DP-rank chooser alone (controlplane.dp_rank): the order of its preferences, the turn it
keeps, and what a dry run leaves. In process, no placer: a dict for the ledger and a dict of
depths for the prefix index. (tests/test_dp_ranks.py covers ranks through whole placements.)"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from controlplane.dp_rank import RankChooser, choose_rank, choose_rank_aligned, rank_key
from controlplane.scheduling import build_profile
from controlplane.scheduling.shared import SharedPrefixes
from controlplane.workers import Load, Role, WorkerSpec, WorkerView


class Ledger:
    """Loads per ledger key; a key never charged is idle (as the stores answer)."""

    def __init__(self, loads: dict[str, Load] | None = None) -> None:
        self.by_key = loads or {}
        self.reads: list[list[str]] = []

    async def loads(self, worker_ids: Iterable[str]) -> dict[str, Load]:
        ids = list(worker_ids)
        self.reads.append(ids)
        return {k: self.by_key.get(k, Load()) for k in ids}


class Depths:
    """A prefix index whose answer is fixed: rank -> blocks of the chain it holds."""

    def __init__(self, depths: dict[int, int]) -> None:
        self.depths = depths

    def rank_depths(self, chain: Sequence[int], worker: WorkerView) -> dict[int, int]:
        return dict(self.depths)


def worker(wid: str = "a", size: int = 4) -> WorkerView:
    return WorkerView(WorkerSpec(id=wid, url=f"http://{wid}", role=Role.BOTH, model="m", dp_size=size))


def test_rank_key_names_the_worker_and_the_rank():
    assert rank_key("w1", 3) == "w1#3"


def test_the_pure_decision_prefers_match_then_requests_then_tokens_then_turn():
    idle = [Load()] * 4
    assert choose_rank([0, 2, 5, 0], idle, start=0) == 2                        # deepest match
    busy = [Load(requests=3), Load(requests=1), Load(requests=2), Load(requests=1)]
    assert choose_rank([0, 0, 0, 0], busy, start=0) == 1                        # fewest requests
    assert choose_rank([1, 0, 0, 0], busy, start=0) == 0                        # match beats load
    toks = [Load(requests=1, tokens=50), Load(requests=1, tokens=10), Load(requests=1, tokens=10), Load(2, 1)]
    assert choose_rank([0, 0, 0, 0], toks, start=0) == 1                        # then fewest tokens
    assert choose_rank([0, 0, 0, 0], toks, start=2) == 2                        # then the turn
    assert [choose_rank([0] * 4, idle, start=s) for s in range(4)] == [0, 1, 2, 3]


async def test_idle_ranks_are_taken_in_turn_and_a_dry_run_keeps_the_turn():
    ledger = Ledger()
    chooser = RankChooser(ledger, SharedPrefixes())
    w = worker(size=3)
    assert (await chooser.choose(w, [], None, advance=False)).rank == 0
    assert (await chooser.choose(w, [], None, advance=False)).rank == 0        # dry runs move nothing
    assert [(await chooser.choose(w, [], None)).rank for _ in range(4)] == [0, 1, 2, 0]
    # Each worker keeps its own turn.
    assert (await chooser.choose(worker("b", 3), [], None)).rank == 0
    assert ledger.reads[-1] == ["b#0", "b#1", "b#2"]                           # one read, every rank


async def test_least_loaded_rank_in_the_ledger_and_the_reason_says_why():
    ledger = Ledger({"a#0": Load(requests=2, tokens=100), "a#1": Load(requests=1, tokens=300),
                     "a#2": Load(requests=1, tokens=200), "a#3": Load(requests=4)})
    choice = await RankChooser(ledger, SharedPrefixes()).choose(worker(), [], None)
    assert choice.rank == 2
    assert choice.why == "prefix 0 blocks, 1 requests, 200 tokens"
    rank, why = choice             # unpacks like the (rank, reason) pair the placer reads
    assert (rank, why) == (2, choice.why)


async def test_a_match_that_tells_the_ranks_apart_wins_over_load():
    chain = list(range(10))
    ledger = Ledger({"a#1": Load(requests=5)})
    choice = await RankChooser(ledger, SharedPrefixes()).choose(worker(), chain, Depths({1: 8, 3: 2}))
    assert choice.rank == 1
    assert choice.why.startswith("prefix 8 blocks, 5 requests")


async def test_a_short_or_common_match_prefers_no_rank():
    chain = list(range(10))
    ledger = Ledger({"a#0": Load(requests=1)})
    chooser = RankChooser(ledger, SharedPrefixes())
    # 3 of 10 blocks is not more than 30 % of the prompt: the cache does not decide.
    assert (await chooser.choose(worker(), chain, Depths({0: 3}), advance=False)).rank == 1
    # Every rank holds the same 8 blocks: nothing tells them apart, load decides.
    assert (await chooser.choose(worker(), chain, Depths({r: 8 for r in range(4)}), advance=False)).rank == 1


async def test_no_index_or_no_chain_reads_no_depths():
    class Refusing:
        def rank_depths(self, chain, worker):
            raise AssertionError("looked up without a chain")

    chooser = RankChooser(Ledger(), SharedPrefixes())
    assert (await chooser.choose(worker(), [], Refusing())).rank == 0
    assert (await chooser.choose(worker(), [1, 2], None)).rank == 1


# ---- phase_aligned: a prompt to compute joins the prefill phase under way ----------------

def test_aligned_decision_joins_the_prefill_under_way_on_another_rank():
    # Rank 0 prefills 20k tokens; the others decode (rank 1 has the fewest requests).
    loads = [Load(requests=1, prefill_tokens=20_000), Load(requests=2), Load(requests=5), Load(requests=3)]
    new = [8_000] * 4
    # balance would queue the prompt behind rank 0's prefill (fewest requests) ...
    assert choose_rank([0] * 4, loads, start=0) == 0
    # ... phase_aligned runs it beside it: the phase stays 20k tokens; then the balance order.
    assert choose_rank_aligned(new, [0] * 4, loads, start=0) == 1
    # A prompt longer than the phase under way still avoids the rank already prefilling.
    assert choose_rank_aligned([30_000] * 4, [0] * 4, loads, start=0) == 1
    # No prefill anywhere: the uncached part decides (a cached prefix shortens the phase), then balance.
    idle = [Load(requests=2), Load(requests=1), Load(requests=1), Load(requests=3)]
    assert choose_rank_aligned([4_000, 4_000, 4_000, 1_000], [0] * 4, idle, start=0) == 3
    assert choose_rank_aligned([4_000] * 4, [0] * 4, idle, start=2) == 2


async def test_aligned_chooser_weighs_the_prefill_and_balances_decode_legs():
    ledger = Ledger({"a#0": Load(requests=1, tokens=20_000, prefill_tokens=20_000), "a#1": Load(requests=3),
                     "a#2": Load(requests=2), "a#3": Load(requests=4)})
    aligned = RankChooser(ledger, SharedPrefixes(), "phase_aligned")
    choice = await aligned.choose(worker(), [], None, prefill_tokens=8_000)
    assert choice.rank == 2 and choice.why.endswith("0 prefill tokens")
    # A decode leg computes no prompt: the balance order (fewest requests: rank 0).
    assert (await aligned.choose(worker(), [], None, prefill_tokens=0)).rank == 0
    # The balance rule ignores the prefill under way.
    assert (await RankChooser(ledger, SharedPrefixes()).choose(worker(), [], None, prefill_tokens=8_000)).rank == 0
    # Prefix depths shorten the work per rank: every rank but 0 is 19k tokens into a prefill, and
    # only rank 3, holding 100 of the prompt's 120 blocks, can take it within the 20k-token phase.
    for r in (1, 2, 3):
        ledger.by_key[f"a#{r}"] = Load(requests=r, prefill_tokens=19_000)
    deep = await aligned.choose(worker(), list(range(120)), Depths({3: 100}), prefill_tokens=1_920)
    assert deep.rank == 3


def test_profiles_take_a_validated_dp_rank_rule():
    assert build_profile("predicted_latency").dp_rank == "balance"
    custom = {"dp": {"scorers": [{"name": "least_load"}], "dp_rank": "phase_aligned"}}
    assert build_profile("dp", custom).dp_rank == "phase_aligned"
    with pytest.raises(ValueError, match="dp_rank must be one of balance, phase_aligned"):
        build_profile("bad", {"bad": {"dp_rank": "aligned"}})
    with pytest.raises(ValueError, match="dp_rank"):
        RankChooser(Ledger(), SharedPrefixes(), "aligned")
