"""Seeded workload generator: the traffic shapes production has and the Mooncake trace lacks.

    python bench/workloads.py --shape system_prompt --requests 300 --seed 0 --out /tmp/w.jsonl

Every shape is written as rows of the Mooncake trace's format (``timestamp`` in ms,
``input_length``, ``output_length``, ``hash_ids``: one id per 512-token block, equal ids
meaning equal content), so ``bench/slo_replay.py --workload SHAPE`` replays it exactly as it
replays the trace, against the same simulated engines and the same peers. The same
``(shape, requests, seed)`` always gives the same rows.

The shapes (the figures are real tokens; ``--token-scale`` shrinks them for the simulator):

* ``system_prompt``: every request begins with the same 1,024-token system prompt;
  multi-turn conversations on top (2-8 turns, each adding the previous answer and a new
  user message; 2-20 s of thinking between turns). A policy that follows any prefix match
  sends everything to whichever engine served the first request.
* ``agent``: agent loops. A 2,048-token tool manifest shared by all agents, a task, then
  one tool result (512-2,048 tokens) per turn; outputs of 30-120 tokens (tool calls);
  turns back to back (0.2-1.5 s of tool time), 6-20 turns per task.
* ``longdoc``: long-document QA. Six documents of 30-100k tokens, questions drawn by a
  Zipf-like popularity; each prompt is the whole document plus a short question.
* ``mixed``: interactive chat (a shared system prompt, short turns, outputs of 100-300)
  beside batch summarisation (8-30k-token unique documents, outputs of 400-1,000 tokens),
  one batch request in four.

Sessions start as a Poisson process at ``rate`` per second; a session's next turn comes
after its own gap (thinking or tool time). The default rates are chosen so that, sent
round robin to four simulated engines of bench/slo_replay.py's default cost model (20k
prefill tokens/s each), the prompt tokens at 1x are roughly half to three quarters of the
fleet's prefill capacity: a cache-following policy has headroom, round robin does not for
long. The benchmark sweeps multiples of these rates up to saturation.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 512                 # tokens per hash id, as in the Mooncake trace


@dataclass
class _Ids:
    """Fresh block ids (equal ids mean equal content)."""

    next_id: int = 1_000_000

    def take(self, blocks: int) -> list[int]:
        start = self.next_id
        self.next_id += blocks
        return list(range(start, start + blocks))


@dataclass(order=True)
class _Turn:
    at_s: float
    seq: int
    session: _Session = field(compare=False)


@dataclass
class _Session:
    context: list[int]                  # hash ids of everything said so far
    turns_left: int
    kind: str = "chat"


def _blocks(tokens: int) -> int:
    return max(1, -(-tokens // BLOCK))


def _row(at_s: float, ids: list[int], output: int, rng: random.Random) -> dict:
    # The last block is usually partly filled: a next turn shares every full block.
    length = len(ids) * BLOCK - rng.randrange(0, BLOCK // 2)
    return {"timestamp": int(at_s * 1000), "input_length": max(1, length), "output_length": output,
            "hash_ids": list(ids)}


def _sessions(rng: random.Random, requests: int, rate: float, start: Callable[[float], _Session],
              turn: Callable[[_Session], tuple[list[int], int, float]]) -> list[dict]:
    """Poisson session starts at ``rate``/s; each session's turns follow its own gaps.

    ``start(t)`` makes a session; ``turn(s)`` gives the prompt ids, the output length and
    the gap (s) until the session's next turn, and advances the session's context.
    """
    rows: list[dict] = []
    pending: list[_Turn] = []
    seq = 0
    next_start = rng.expovariate(rate)
    while len(rows) < requests:
        if pending and pending[0].at_s <= next_start:
            item = heapq.heappop(pending)
            now, sess = item.at_s, item.session
        else:
            now, sess = next_start, start(next_start)
            next_start += rng.expovariate(rate)
        ids, output, gap = turn(sess)
        rows.append(_row(now, ids, output, rng))
        sess.turns_left -= 1
        if sess.turns_left > 0:
            seq += 1
            heapq.heappush(pending, _Turn(now + gap, seq, sess))
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def system_prompt(requests: int, seed: int, rate: float = 4.0) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    system = ids.take(_blocks(1024))

    def start(_t: float) -> _Session:
        return _Session(context=list(system) + ids.take(rng.randint(1, 6)), turns_left=rng.randint(2, 8))

    def turn(s: _Session) -> tuple[list[int], int, float]:
        prompt = list(s.context)
        output = rng.randint(80, 400)
        s.context += ids.take(_blocks(output) + rng.randint(1, 3))     # the answer, then the next question
        return prompt, output, rng.uniform(2.0, 20.0)

    return _sessions(rng, requests, rate, start, turn)


def agent(requests: int, seed: int, rate: float = 0.4) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    manifest = ids.take(_blocks(2048))

    def start(_t: float) -> _Session:
        return _Session(context=list(manifest) + ids.take(rng.randint(1, 3)), turns_left=rng.randint(6, 20))

    def turn(s: _Session) -> tuple[list[int], int, float]:
        prompt = list(s.context)
        s.context += ids.take(rng.randint(1, 4))                         # the tool call's result
        return prompt, rng.randint(30, 120), rng.uniform(0.2, 1.5)

    return _sessions(rng, requests, rate, start, turn)


def longdoc(requests: int, seed: int, rate: float = 1.0) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    docs = [ids.take(_blocks(rng.randint(30_000, 100_000))) for _ in range(6)]
    weights = [1.0 / (k + 1) for k in range(len(docs))]                   # Zipf-like popularity

    def start(_t: float) -> _Session:
        return _Session(context=list(rng.choices(docs, weights)[0]), turns_left=1)

    def turn(s: _Session) -> tuple[list[int], int, float]:
        return s.context + ids.take(1), rng.randint(50, 300), 0.0

    return _sessions(rng, requests, rate, start, turn)


def mixed(requests: int, seed: int, rate: float = 3.0) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    system = ids.take(_blocks(768))

    def start(_t: float) -> _Session:
        if rng.random() < 0.25:
            return _Session(context=ids.take(_blocks(rng.randint(8_000, 30_000))), turns_left=1, kind="batch")
        return _Session(context=list(system) + ids.take(rng.randint(1, 3)), turns_left=rng.randint(1, 5))

    def turn(s: _Session) -> tuple[list[int], int, float]:
        prompt = list(s.context)
        if s.kind == "batch":
            return prompt, rng.randint(400, 1000), 0.0
        output = rng.randint(100, 300)
        s.context += ids.take(_blocks(output) + 1)
        return prompt, output, rng.uniform(3.0, 20.0)

    return _sessions(rng, requests, rate, start, turn)


SHAPES: dict[str, Callable[..., list[dict]]] = {
    "system_prompt": system_prompt,
    "agent": agent,
    "longdoc": longdoc,
    "mixed": mixed,
}


def generate(shape: str, requests: int, seed: int = 0, rate: float | None = None) -> list[dict]:
    """``requests`` rows of ``shape``; ``rate``: new sessions per second (default: the shape's)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown workload {shape!r}; known: {', '.join(SHAPES)}")
    if requests < 1:
        raise ValueError("requests must be >= 1")
    kwargs = {} if rate is None else {"rate": rate}
    return SHAPES[shape](requests, seed, **kwargs)


def iter_jsonl(rows: list[dict]) -> Iterator[str]:
    for row in rows:
        yield json.dumps(row, separators=(",", ":")) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=None, help="new sessions per second (default: the shape's)")
    p.add_argument("--out", type=Path, default=None, help="JSONL file (default: standard output)")
    args = p.parse_args(argv)
    try:
        rows = generate(args.shape, args.requests, args.seed, args.rate)
    except ValueError as exc:
        p.error(str(exc))
    if args.out is None:
        sys.stdout.writelines(iter_jsonl(rows))
    else:
        with args.out.open("w") as f:
            f.writelines(iter_jsonl(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
