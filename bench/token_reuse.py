"""Engine-side tokenization saved by the data plane's tokenizer reuse (issue: 冗余计算问题).

    python bench/token_reuse.py --requests 60

A sequential PD pair of simulators (which model API-server tokenization time per
character of text prompt, and none for token-id prompts), a control plane, and two data
planes side by side in the same run: one with ``--tokenizer`` (prompts go to P and D as
token ids), one without (both engines tokenize the text). The same text completions go
through each; the engines' own ``tokenize_busy_s`` counters give the saving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omni_proxy.launcher import ProcessGroup  # noqa: E402
from omni_proxy.loadgen import closed_loop  # noqa: E402
from tests.data.tokenizer.fixture_dirs import build  # noqa: E402


async def busy(session: aiohttp.ClientSession, urls: list[str]) -> dict:
    out = {"tokenize_busy_s": 0.0, "tokenized_chars": 0}
    for url in urls:
        async with session.get(url + "/sim/state") as r:
            st = await r.json()
        out["tokenize_busy_s"] += st["tokenize_busy_s"]
        out["tokenized_chars"] += st["tokenized_chars"]
    return out


async def measure(dp_url: str, sims: list[str], requests: int, chars: int) -> dict:
    text = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]

    def make(i: int):
        return "/v1/completions", {"model": "sim-model", "prompt": f"{i} {text}", "max_tokens": 4}

    async with aiohttp.ClientSession() as s:
        before = await busy(s, sims)
    summary = await closed_loop(dp_url, make, total=requests, concurrency=4, max_seconds=120)
    async with aiohttp.ClientSession() as s:
        after = await busy(s, sims)
    return {"ok": len(summary.ok), "engine_tokenize_s": round(after["tokenize_busy_s"] - before["tokenize_busy_s"], 3),
            "engine_tokenized_chars": after["tokenized_chars"] - before["tokenized_chars"],
            "latency_p50_ms": round(summary.median("latency_s") * 1000, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--chars", type=int, default=8000, help="prompt length in characters")
    args = p.parse_args()
    with ProcessGroup() as group, tempfile.TemporaryDirectory() as tmp:
        tok = build("tiny_llama", Path(tmp) / "tok")
        psim = group.start("p", ["sim", "--role", "prefill", "--port", "0"])
        dsim = group.start("d", ["sim", "--role", "decode", "--port", "0"])
        cp = group.start("cp", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--prefill", psim.url,
                                "--decode", dsim.url, "--log-level", "WARNING"])
        with_reuse = group.start("dp-reuse", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                              "--tokenizer", str(tok), "--log-level", "WARNING"])
        without = group.start("dp-text", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                          "--log-level", "WARNING"])
        sims = [psim.url, dsim.url]
        result = {"text_prompts": asyncio.run(measure(without.url, sims, args.requests, args.chars)),
                  "token_reuse": asyncio.run(measure(with_reuse.url, sims, args.requests, args.chars))}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
