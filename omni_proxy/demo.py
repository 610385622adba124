"""``omni-proxy demo``: the whole request path on this machine, with simulated engines.

Starts 1 prefill + 1 decode + 2 aggregated engine simulators, a control plane and a
data plane as separate processes on loopback, sends real OpenAI traffic (streaming and
not, completions and chat) through the data plane, prints where each request ran and
how fast, and stops everything.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=40, help="how many requests to send")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--policy", default="predicted_latency")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-seconds", type=float, default=60.0, help="stop sending after this long")
    p.add_argument("--keep-running", action="store_true", help="leave the system up until Ctrl-C")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)


PROMPTS = [
    "Explain prefill/decode disaggregation in one paragraph.",
    "Write a haiku about KV caches.",
    "What does a request scheduler for LLM inference do, and why does placement matter for "
    "time to first token when prompts are long and caches are warm?",
    "List three reasons to tokenize a prompt only once.",
]


def _make_request(max_tokens: int):
    def make(i: int) -> tuple[str, dict]:
        prompt = PROMPTS[i % len(PROMPTS)] + (" Add detail." * (i % 7) * 8)
        stream = i % 2 == 0
        if i % 4 < 2:
            return "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens,
                                       "stream": stream}
        return "/v1/chat/completions", {"model": "sim-model", "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "stream": stream}
    return make


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import time

    import grpc
    from rich.console import Console
    from rich.table import Table

    from omni_proxy.launcher import LaunchError, ProcessGroup
    from omni_proxy.loadgen import closed_loop
    from protos import omni_proxy_pb2 as pb
    from protos import omni_proxy_pb2_grpc as pb_grpc

    console = Console()
    with ProcessGroup() as group:
        try:
            console.print("[bold]starting engine simulators[/bold] (1 prefill, 1 decode, 2 aggregated)")
            sims = {
                "prefill": group.start("sim-prefill", ["sim", "--role", "prefill", "--port", "0"]),
                "decode": group.start("sim-decode", ["sim", "--role", "decode", "--port", "0"]),
                "agg-1": group.start("sim-agg-1", ["sim", "--role", "both", "--port", "0"]),
                "agg-2": group.start("sim-agg-2", ["sim", "--role", "both", "--port", "0"]),
            }
            cp = group.start("controlplane", [
                "controlplane", "--listen", "127.0.0.1:0", "--http-port", "0", "--policy", args.policy,
                "--health-interval", "0.5",
                "--prefill", f"{sims['prefill'].url},id=prefill-0", "--decode", f"{sims['decode'].url},id=decode-0",
                "--worker", f"{sims['agg-1'].url},id=agg-1", "--worker", f"{sims['agg-2'].url},id=agg-2"])
            dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address])
        except LaunchError as exc:
            console.print(f"[red]could not start the demo:[/red] {exc}")
            return 1
        console.print(f"control plane gRPC {cp.address}; data plane {dp.url} (OpenAI API)")

        t0 = time.perf_counter()
        summary = asyncio.run(closed_loop(dp.url, _make_request(args.max_tokens), total=args.requests,
                                          concurrency=args.concurrency, max_seconds=args.max_seconds))
        elapsed = time.perf_counter() - t0

        with grpc.insecure_channel(cp.address) as channel:
            workers = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers

        table = Table(title="where requests ran (control-plane placements)")
        for col in ("worker", "role", "health", "placements", "in flight now"):
            table.add_column(col)
        for w in workers:
            table.add_row(w.id, pb.Role.Name(w.role).removeprefix("ROLE_").lower(),
                          pb.WorkerStatus.Name(w.status).removeprefix("STATUS_").lower(),
                          str(w.placements_total), str(w.load.inflight_requests))
        console.print(table)

        ok = summary.ok
        failed = [r for r in summary.results if r not in ok]
        tokens = sum(r.completion_tokens for r in ok)
        stats = Table(title="traffic through the data plane")
        stats.add_column("metric")
        stats.add_column("value", justify="right")
        stats.add_row("requests ok / sent", f"{len(ok)} / {len(summary.results)}")
        streamed = sorted(r.ttft_s * 1000 for r in ok if r.events > 1)
        if streamed:
            stats.add_row("streamed TTFT p50 / p90 (ms)",
                          f"{streamed[len(streamed) // 2]:.1f} / {streamed[int(len(streamed) * 0.9)]:.1f}")
        stats.add_row("latency p50 (ms)", f"{summary.median('latency_s') * 1000:.1f}")
        stats.add_row("completion tokens", str(tokens))
        stats.add_row("tokens/s", f"{tokens / max(elapsed, 1e-9):.0f}")
        console.print(stats)
        for r in failed[:5]:
            console.print(f"[red]failed:[/red] {r.error}")

        pd = sum(w.placements_total for w in workers if w.role == pb.ROLE_DECODE)
        agg = sum(w.placements_total for w in workers if w.role == pb.ROLE_BOTH)
        console.print(f"flows: {pd} prefill/decode (sequential), {agg} aggregated")
        if args.ready_file:
            from omni_runtime import write_ready_file

            write_ready_file(args.ready_file, port=dp.port, ok=len(ok), sent=len(summary.results),
                             pd=pd, aggregated=agg)
        if args.keep_running:
            console.print(f"system left running; OpenAI API at {dp.url}/v1 - press Ctrl-C to stop")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        console.print("stopping")
        healthy = len(ok) == len(summary.results) and pd > 0 and agg > 0
        print(json.dumps({"ok": len(ok), "sent": len(summary.results), "pd": pd, "aggregated": agg}))
        return 0 if healthy else 1
