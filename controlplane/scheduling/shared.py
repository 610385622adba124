"""The part of a prefix-cache match that tells the candidates apart.

Following the cache pays when an engine holds what the others would have to compute: a
conversation's earlier turns, a document asked about again. It starves an engine when the
match is one that any engine could hold, above all the system prompt that every request of
a deployment starts with: an engine that missed the first requests never holds it, every
later prompt matches it elsewhere, so that engine never wins a cache-following choice again
(issue 17: one engine of four got 0 of 978 requests, and in PD one decode engine of two got
every decode). Two parts of a match therefore do not count as a reason to prefer a worker:

* the depth every candidate holds (the minimum over them): it prefers no one;
* a *shared* prefix: one that different prompts have already continued differently (a
  branch point of the request stream, learned here from the chains placed). A new
  conversation on the common system prompt matches exactly that far and no further, and an
  engine lacking the prefix computes it once and holds it from then on, so its cost is an
  investment, not a loss. A follow-up turn matches past the branch point, into its own
  conversation, and that part still counts in full.

The common depth is the deeper of the two (``common_depth``); what a worker holds beyond it
is its differentiating match. Policies also let the cache decide only when the deepest
match covers more than a fraction of the prompt (0.3, as SGLang and vllm-router do).

Branch points are learned per placement in O(1): at the depth ``d`` of the deepest match,
the block ``k = min(lookahead, blocks left)`` further is remembered under the match's last
block; a later prompt that shares ``chain[:d]`` and reaches ``d + k`` with a different block
there (block hashes commit to their whole prefix) continued it differently; ``branches``
such continuations mark the prefix shared. A shorter prompt is no evidence (it may be a truncation of the same one): it
only moves the comparison to its own end. The lookahead spans the approximate index's
recording stride (16 blocks by default: its depths can fall up to 15 blocks short of where
prompts part). Memory is bounded (oldest entries dropped first). Not persisted: a restarted
control plane relearns a shared prefix from the next prompts that continue it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_SHARED = object()   # the value of a key whose prefix several prompts continued differently
MIN_MATCH = 0.3      # the deepest match must cover more of the prompt than this to count at all


@dataclass
class SharedPrefixes:
    lookahead: int = 64
    max_entries: int = 65536
    # Different continuations, besides the first, before a prefix counts as shared (three
    # prompts in all). With one, a document asked two different questions, or a context an
    # agent branched, stopped counting for the one engine that held it: on the Mooncake
    # trace's window H at 2x, predicted_latency's hits fell from 64 to 45 % and its SLO
    # attainment from 90 to 81 % (51 % and 85 % with two; one repeat each). A system prompt
    # is continued by every new conversation and crosses this at once; more (three) starved
    # an engine in tests/test_e2e_fair_share.py.
    branches: int = 2
    _seen: dict = field(default_factory=dict, repr=False)

    def note(self, chain: Sequence[int], depth: int) -> None:
        """A prompt with ``chain`` was matched ``depth`` blocks deep: learn whether other
        prompts continued that prefix differently."""
        n = len(chain)
        if depth <= 0 or depth >= n:
            return
        key = chain[depth - 1]
        k = min(self.lookahead, n - depth)
        seen = self._seen
        got = seen.get(key)
        if got is None:
            if len(seen) >= self.max_entries:
                del seen[next(iter(seen))]
            seen[key] = (k, chain[depth + k - 1], 0, None)
        elif got is not _SHARED:
            if k >= got[0]:
                block = chain[depth + got[0] - 1]
                # (the same prompt noted again, for its worker and then for its DP rank, or
                # a retry, is one continuation: compared with the first and the last one)
                if block != got[1] and block != got[3]:
                    seen[key] = _SHARED if got[2] + 1 >= self.branches else (got[0], got[1], got[2] + 1, block)
            else:
                seen[key] = (k, chain[depth + k - 1], got[2], got[3])

    def shared(self, chain: Sequence[int], depth: int) -> bool:
        """Whether ``chain[:depth]`` is a prefix that different prompts continued differently."""
        return 0 < depth <= len(chain) and self._seen.get(chain[depth - 1]) is _SHARED

    def common_depth(self, chain: Sequence[int], depths: Iterable[int]) -> int:
        """The depth of ``chain`` that tells none of the candidates apart: the deepest of the
        candidates' minimum match and any candidate's match that is a shared prefix. Notes the
        placement first (at the deepest match), so the prompt that reveals a branch point
        already benefits from it."""
        ds = sorted(set(depths))
        if not ds:
            return 0
        self.note(chain, ds[-1])
        common = ds[0]
        for d in reversed(ds):
            if d <= common:
                break
            if self.shared(chain, d):
                return d
        return common


def differentiating(depths: Sequence[int], common: int) -> list[int]:
    """Each candidate's match beyond the common depth (``SharedPrefixes.common_depth``)."""
    return [d - common if d > common else 0 for d in depths]


def telling_apart(shared: SharedPrefixes, chain: Sequence[int], depths: Sequence[int],
                  min_match: float = MIN_MATCH) -> list[int]:
    """The part of each candidate's match that tells it apart: beyond the common depth, and
    none at all when the deepest match covers no more than ``min_match`` of the chain."""
    if max(depths, default=0) <= min_match * len(chain):
        return [0] * len(depths)
    return differentiating(depths, shared.common_depth(chain, depths))


@dataclass
class RecentShares:
    """Who received the recent placements of each kind of leg, to tell which candidates are
    starved: below ``fraction`` of their weighted fair share of the last ``per_candidate``
    placements per candidate.

    A shared prefix is what any engine *could* hold; whether treating it as held pays
    depends on how often it comes back. A system prompt that every conversation starts
    with does, a document asked three or seven questions (the Mooncake trace's window H:
    prefixes of 18-66k tokens continued by 3-7 prompts) does not: treated as common for
    everyone, its questions went wherever load said and each engine computed the document
    again (predicted_latency at 2x: SLO 90 -> 85 %, prefix hits 65 -> 54 %, follow-ups on
    their engine 0.88 -> 0.65). So ``predicted_latency`` treats a shared prefix as held only
    for the candidates this says are starved: they win the next new conversations, compute
    the prefix once and hold it; everyone else is judged by what it really holds. The
    guard costs one prefix's prefill per starved engine, only when an engine starves.
    Memory and time are O(window), O(candidates) per query.
    """

    per_candidate: int = 16
    fraction: float = 0.5
    max_window: int = 4096
    _recent: dict = field(default_factory=dict, repr=False)    # kind -> deque of worker ids
    _counts: dict = field(default_factory=dict, repr=False)    # kind -> Counter

    def record(self, decode: bool, worker_id: str, candidates: int) -> None:
        """A placement of this kind (decode leg or not) went to ``worker_id``, chosen among
        ``candidates`` workers."""
        recent = self._recent.get(decode)
        if recent is None:
            recent = self._recent[decode] = deque()
            self._counts[decode] = Counter()
        counts = self._counts[decode]
        recent.append(worker_id)
        counts[worker_id] += 1
        limit = min(self.per_candidate * max(candidates, 1), self.max_window)
        while len(recent) > limit:
            old = recent.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]

    def starved(self, decode: bool, ids: Sequence[str], weights: Sequence[float],
                work: Sequence[int] = ()) -> frozenset[str]:
        """The workers among ``ids`` (with their ``weights``) below ``fraction`` of their
        fair share of the recent placements of this kind and, given each one's ``work``
        ahead (prefill tokens placed and not yet computed), with none of it: an engine still
        computing prompts is busy, not starved; it gets the next ones once it is idle.
        Allowed up to the candidates' mean work, an engine that got fewer requests because
        its requests are longer (the questions on the long documents it holds), or one still
        computing the first document it was sent, took another document to compute under
        load (``longdoc`` at 4x, 8x: a document's third question went to such an engine,
        behind its own document, and waited 5.3 s; 80.8 / 71.7 % SLO against 88.3 / 82.5 %
        with idle engines only, as vllm-router's ``cache_aware``)."""
        recent = self._recent.get(decode)
        if not recent:
            return frozenset()
        total = sum(weights)
        if total <= 0:
            return frozenset()
        counts, share = self._counts[decode], self.fraction * len(recent) / total
        return frozenset(wid for i, (wid, w) in enumerate(zip(ids, weights, strict=False))
                         if counts.get(wid, 0) < share * w and (not work or work[i] <= 0))
