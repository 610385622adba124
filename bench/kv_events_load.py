"""KV events under load: placement latency and the control plane's longest event-loop stall
while engines publish KV events at a high rate (issue 19, item 2).

    python bench/kv_events_load.py [--rounds 3] [--seconds 4] [--engines 8] [--rate 50]
                                   [--blocks 64] [--big-blocks 4096] [--big-every-s 1.0]
                                   [--concurrency 4] [--out DIR --name NAME]
    python bench/kv_events_load.py --offline [--offline-seconds 15] [same stream options]

What runs, all on 127.0.0.1:

* a control plane **in this process** (``controlplane.server.ControlPlane``, the default
  policy, the memory store), so its event loop can be watched exactly: a 1 ms timer records how
  late it fires (the longest stall is the largest lateness);
* a publisher process with ``--engines`` real ZMQ PUB sockets, one per fake engine, each
  publishing vLLM-shaped msgpack ``KVEventBatch`` frames (``[topic, seq, payload]``, map events,
  int hashes, token ids: ``simulator/kv_events.py``'s encoding) ``--rate`` times a second: a
  ``BlockStored`` of ``--blocks`` new blocks continuing a shared document, and, once an engine holds
  its capacity, one ``BlockRemoved`` per evicted block as vLLM sends them. Every ``--big-every-s``
  each engine (staggered) stores a long prompt of ``--big-blocks`` blocks in one frame, whose
  eviction later comes as that many ``BlockRemoved`` events in one frame;
* a zero-latency engine (``bench/mock_engine.py``) behind the workers, so they are healthy;
* a client process holding a real data-plane session (``PlacementClient``) placing requests whose
  chains continue the same documents (so every placement walks the index), ``--concurrency`` in
  flight, each reported FINISHED once placed.

Each round measures two cells, in an order alternated per round: ``quiet`` (no events published)
and ``events`` (publishing). Reported per cell: placement p50/p99/max (the client's
``PlacementClient.place`` round trip), the control plane's longest event-loop stall and the
p99 of its 1 ms timer's lateness, the longest CPU hold of one loop callback, the garbage
collections (longest, full ones, total: they run inside whichever callback allocated), and the
KV frames and block events the control plane applied. Before/after comparisons run this file
against two trees (``PYTHONPATH=<tree>``: the other tree's modules, this file's measuring), interleaved.

``--offline`` starts nothing: the publisher's frames for ``--offline-seconds`` of its schedule go
straight into a ``KVCache``'s subscribers on this process's loop, as fast as they are applied.
Reported: the loop thread's CPU time for all of them (and per event), how late a 1 ms timer fired
meanwhile (p50, p99: what a placement's callback waits behind a backlog of event work), the longest
CPU hold of one callback, holds over 2 and 5 ms, and the collections. CPU clocks make it far steadier than the live
cells on a shared host; it measures the event path alone, not what placements see.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))   # after PYTHONPATH: a before/after run points it at the other tree

MODEL = "sim-model"
BLOCK = 16
DOCS = 64             # shared documents the engines and the client both continue
DOC_BLOCKS = 256      # blocks per document
TOKENS = list(range(1000, 1000 + BLOCK * 8192))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def doc_chain(seed: int, d: int) -> list[int]:
    rng = random.Random(seed * 100_003 + d)
    return [rng.getrandbits(63) for _ in range(DOC_BLOCKS)]


# ---------------------------------------------------------------------------- publisher process

def stored(hashes: list[int], parent: int | None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": TOKENS[:BLOCK * len(hashes)], "block_size": BLOCK, "medium": "GPU", "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


class Capture:
    """Stands in for an engine's PUB socket offline (``--offline``): keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append(frames)


class FakeEngine:
    """One engine's KV-event stream: new blocks continuing a document, evictions past capacity.
    ``ctx`` None: frames are kept in a ``Capture`` instead of published."""

    def __init__(self, ctx, idx: int, seed: int, capacity: int) -> None:
        self.capacity = capacity
        if ctx is None:
            self.sock: Capture | zmq.Socket = Capture()
            self.port = 0
        else:
            import zmq

            sock = ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.bind("tcp://127.0.0.1:0")
            self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            self.sock = sock
        self.rng = random.Random(seed * 7919 + idx)
        self.seq = 0
        self.held: deque[int] = deque()
        self.frames = 0
        self.events = 0

    def step(self, docs: list[list[int]], blocks: int) -> None:
        import msgpack

        doc = docs[self.rng.randrange(len(docs))]
        depth = self.rng.randrange(DOC_BLOCKS // 2, DOC_BLOCKS)
        new = [self.rng.getrandbits(63) for _ in range(blocks)]
        events: list = [stored(doc[:depth], None), stored(new, doc[depth - 1])]
        self.held.extend(new)
        evict = len(self.held) - self.capacity
        for _ in range(max(0, evict)):
            events.append({"type": "BlockRemoved", "block_hashes": [self.held.popleft()], "medium": "GPU",
                           "group_idx": 0})
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
        self.frames += 1
        self.events += len(events)


async def publisher_main(args: argparse.Namespace) -> None:
    """Bind the engines' PUB sockets, say their ports, publish while told to (JSON lines)."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    engines = [FakeEngine(ctx, i, args.seed, args.capacity) for i in range(args.engines)]
    docs = [doc_chain(args.seed, d) for d in range(DOCS)]
    publishing = asyncio.Event()

    async def run(i: int, eng: FakeEngine) -> None:
        period = 1.0 / args.rate
        big_period = args.big_every_s
        next_big = time.monotonic() + big_period * (i + 1) / len(engines)
        nxt = time.monotonic()
        while True:
            await publishing.wait()
            now = time.monotonic()
            if now < nxt:
                await asyncio.sleep(nxt - now)
            nxt = max(nxt + period, time.monotonic() - period)
            big = big_period > 0 and time.monotonic() >= next_big
            if big:
                next_big += big_period
            eng.step(docs, args.big_blocks if big else args.blocks)

    tasks = [asyncio.ensure_future(run(i, e)) for i, e in enumerate(engines)]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["publish"]:
                publishing.set()
            else:
                publishing.clear()
            writer.write(json.dumps({"frames": sum(e.frames for e in engines),
                                     "events": sum(e.events for e in engines)}).encode() + b"\n")
            await writer.drain()
        done.set()

    done = asyncio.Event()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    from omni_runtime import write_ready_file
    write_ready_file(args.ready_file, port=server.sockets[0].getsockname()[1], engines=[e.port for e in engines])
    await done.wait()
    for t in tasks:
        t.cancel()
    ctx.destroy(linger=0)


# ---------------------------------------------------------------------------- client process

async def client_main(args: argparse.Namespace) -> None:
    """A data plane's session: place requests continuing the documents, as told (JSON lines)."""
    from dataplane.placement_client import PlacementClient
    from protos import omni_proxy_pb2 as pb

    docs = [doc_chain(args.seed, d) for d in range(DOCS)]
    rng = random.Random(args.seed)
    client = PlacementClient(args.target, "bench-client", timeout_s=10.0)
    await client.start()
    if not await client.wait_connected(30):
        raise SystemExit("no session with the control plane")
    seq = [0]

    async def job(cmd: dict) -> dict:
        stop_at = time.monotonic() + cmd["seconds"]
        samples: list[float] = []
        errors: list[str] = []

        async def loop() -> None:
            while time.monotonic() < stop_at:
                seq[0] += 1
                rid = f"{cmd['tag']}-{seq[0]}"
                doc = docs[rng.randrange(DOCS)]
                chain = doc[:rng.randrange(DOC_BLOCKS // 4, DOC_BLOCKS)] + [rng.getrandbits(63) for _ in range(32)]
                req = pb.PlaceRequest(request_id=rid, model=MODEL, leg=pb.LEG_ENTRY, prompt_tokens=BLOCK * len(chain),
                                      max_tokens=128, block_hashes=chain)
                t0 = time.perf_counter()
                out = await client.place(req)
                dt = time.perf_counter() - t0
                if out.error:
                    if len(errors) < 5:
                        errors.append(f"{pb.ErrorCode.Name(out.error)}: {out.error_message}")
                    await asyncio.sleep(0.01)
                    continue
                samples.append(dt * 1000)
                client.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED,
                                                worker_id=out.decode.worker_id))

        await asyncio.gather(*(loop() for _ in range(cmd["concurrency"])))
        return {"samples_ms": samples, "errors": errors}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(json.dumps(await job(json.loads(line))).encode() + b"\n")
            await writer.drain()
        done.set()

    done = asyncio.Event()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    from omni_runtime import write_ready_file
    write_ready_file(args.ready_file, port=server.sockets[0].getsockname()[1])
    await done.wait()
    await client.close()


# ---------------------------------------------------------------------------- the control plane's loop

class StallWatch:
    """A 1 ms timer on the control plane's loop; how late each tick fires is how long the loop
    was held (by anything: decoding events, placements, gRPC)."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.lateness: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self.lateness = []
        self._loop = asyncio.get_running_loop()
        self._due = time.perf_counter() + self.interval_s    # uvloop's loop.time() is in whole ms
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def stop(self) -> list[float]:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        return self.lateness

    def _tick(self) -> None:
        now = time.perf_counter()
        self.lateness.append(max(0.0, now - self._due) * 1000)
        self._due = now + self.interval_s
        assert self._loop is not None   # started
        self._handle = self._loop.call_later(self.interval_s, self._tick)


class HoldWatch:
    """The CPU time of each callback the loop runs (asyncio's loop: ``Handle._run`` timed with the
    thread's CPU clock): the longest is the longest the loop was held by code, whatever the host's
    other processes did meanwhile (the 1 ms timer's lateness counts those too)."""

    def __init__(self) -> None:
        self.on = False
        self.holds: list[float] = []
        self.longest = ""

    def install(self) -> None:
        orig = asyncio.events.Handle._run
        watch = self

        def _run(handle):
            if not watch.on:
                return orig(handle)
            t = time.thread_time()
            try:
                return orig(handle)
            finally:
                d = time.thread_time() - t
                if d > 0.0005:
                    watch.holds.append(d * 1000)
                    if d * 1000 >= max(watch.holds):
                        cb = handle._callback
                        watch.longest = repr(getattr(cb, "__self__", None) or handle)[:300]

        asyncio.events.Handle._run = _run   # type: ignore[method-assign]  # instrumenting asyncio on purpose

    def start(self) -> None:
        self.holds = []
        self.longest = ""
        self.on = True

    def stop(self) -> list[float]:
        self.on = False
        return self.holds


class GCWatch:
    """How long each garbage collection held the loop's thread (``gc.callbacks``): collections run
    inside whatever callback allocated, so they show up in its hold."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []     # (generation, ms)
        self._t0 = 0.0
        self.on = False

    def install(self) -> None:
        import gc

        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        elif self.on:
            self.pauses.append((info["generation"], (time.thread_time() - self._t0) * 1000))

    def start(self) -> None:
        self.pauses = []
        self.on = True

    def stop(self) -> list[tuple[int, float]]:
        self.on = False
        return self.pauses


async def run(args: argparse.Namespace) -> dict:
    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.health import HealthConfig
    from controlplane.server import ControlPlane
    from controlplane.workers import Role
    from omni_proxy.launcher import ProcessGroup, port_in

    result: dict = {"rounds": []}
    with ProcessGroup(ready_timeout=90) as group:
        engine = group.start_program("engine", [sys.executable, str(ROOT / "bench" / "mock_engine.py"), "--port", "0",
                                                "--ready-file", str(group.workdir / "engine.ready")],
                                     port_in(group.workdir / "engine.ready"))
        pub_ready = group.workdir / "pub.ready"
        me = str(Path(__file__).resolve())
        common = ["--seed", str(args.seed)]
        pub = group.start_program("publisher", [sys.executable, me, "--publisher", "--ready-file", str(pub_ready),
                                                "--engines", str(args.engines), "--rate", str(args.rate),
                                                "--blocks", str(args.blocks), "--big-blocks", str(args.big_blocks),
                                                "--big-every-s", str(args.big_every_s),
                                                "--capacity", str(args.capacity), *common],
                                  port_in(pub_ready))
        ports = json.loads(pub_ready.read_text())["engines"]
        workers = [WorkerSpec(url=f"{engine.url}/w{i:02d}", role=Role.BOTH, id=f"w{i:02d}", model=MODEL,
                              kv_events=f"tcp://127.0.0.1:{port}") for i, port in enumerate(ports)]
        config = ControlPlaneConfig(http_port=0, listen="127.0.0.1:0", workers=workers,
                                    health=HealthConfig(interval_s=30.0, poll_metrics=False))
        plane = ControlPlane(config)
        await plane.start()
        import omni_runtime
        from controlplane import cli
        # what `omni-proxy controlplane` does once started (in controlplane.cli in older trees)
        settle = getattr(omni_runtime, "settle_heap", None) or getattr(cli, "settle_heap", None)
        if settle is not None:
            settle()
        try:
            target = f"127.0.0.1:{plane.grpc_port}"
            cli_ready = group.workdir / "client.ready"
            # in a thread: the client's session needs this loop (the control plane's) meanwhile
            client = await asyncio.to_thread(group.start_program, "client",
                                          [sys.executable, me, "--client", "--ready-file", str(cli_ready),
                                           "--target", target, *common], port_in(cli_ready))
            pr, pw = await asyncio.open_connection("127.0.0.1", pub.port)
            cr, cw = await asyncio.open_connection("127.0.0.1", client.port, limit=1 << 26)

            async def publish(on: bool) -> dict:
                pw.write(json.dumps({"publish": on}).encode() + b"\n")
                await pw.drain()
                return json.loads(await pr.readline())

            async def place(seconds: float, tag: str) -> dict:
                cw.write(json.dumps({"seconds": seconds, "concurrency": args.concurrency, "tag": tag}).encode()
                         + b"\n")
                await cw.drain()
                return json.loads(await cr.readline())

            def applied() -> tuple[int, int]:
                c = plane.kv.counters()
                return sum(v.get("received", 0) for v in c.values()), plane.kv.exact.size()

            await place(0.5, "warm")
            watch = StallWatch()
            holds = HoldWatch()
            gcs = GCWatch()
            gcs.install()
            if not args.uvloop:
                holds.install()
            for r in range(args.rounds):
                rnd = {}
                for cell in (("quiet", "events") if r % 2 == 0 else ("events", "quiet")):
                    on = cell == "events"
                    before = await publish(on)
                    if on:
                        await asyncio.sleep(args.warm)      # the stream at its steady rate first
                    frames0, _ = applied()
                    watch.start()
                    holds.start()
                    gcs.start()
                    out = await place(args.seconds, f"r{r}{cell}")
                    collected = gcs.stop()
                    held = holds.stop()
                    lateness = watch.stop()
                    frames1, blocks = applied()
                    after = await publish(False)
                    s = out["samples_ms"]
                    rnd[cell] = {
                        "n": len(s), "errors": out["errors"],
                        "p50_ms": round(pct(s, 0.5), 3), "p99_ms": round(pct(s, 0.99), 3),
                        "max_ms": round(max(s, default=0.0), 3),
                        "stall_max_ms": round(max(lateness, default=0.0), 2),
                        "stall_p99_ms": round(pct(lateness, 0.99), 2),
                        "hold_max_ms": round(max(held, default=0.0), 2),
                        "holds_over_5ms": sum(h > 5 for h in held),
                        "longest_hold": holds.longest,
                        "gc_max_ms": round(max((ms for _, ms in collected), default=0.0), 2),
                        "gc_total_ms": round(sum(ms for _, ms in collected), 1),
                        "gc_full": sum(g == 2 for g, _ in collected),
                        "frames_applied": frames1 - frames0,
                        "frames_published": after["frames"] - before["frames"],
                        "events_published": after["events"] - before["events"],
                        "indexed_blocks": blocks,
                    }
                    c = rnd[cell]
                    log(f"round {r + 1}/{args.rounds} {cell:6s}: placement p50 {c['p50_ms']:.2f} p99 "
                        f"{c['p99_ms']:.2f} max {c['max_ms']:.1f} ms (n={c['n']}); loop stall max "
                        f"{c['stall_max_ms']:.1f} p99 {c['stall_p99_ms']:.2f} ms; longest hold (CPU) "
                        f"{c['hold_max_ms']:.1f} ms, {c['holds_over_5ms']} over 5 ms; gc max {c['gc_max_ms']:.1f} ms "
                        f"({c['gc_full']} full, {c['gc_total_ms']:.0f} ms in all); frames applied "
                        f"{c['frames_applied']} of {c['frames_published']} published ({c['events_published']} events)"
                        + (f"; errors {c['errors'][:2]}" if c["errors"] else ""))
                    # drain what is still queued before the next cell
                    await asyncio.sleep(0.5)
                result["rounds"].append(rnd)
            pw.close()
            cw.close()
        finally:
            await plane.stop()
    return result


def offline_frames(args: argparse.Namespace) -> tuple[list[tuple[str, list[bytes]]], int]:
    """The publisher's frames for ``--offline-seconds`` of its schedule, in publishing order, and
    how many events they carry."""
    engines = [FakeEngine(None, i, args.seed, args.capacity) for i in range(args.engines)]
    docs = [doc_chain(args.seed, d) for d in range(DOCS)]
    period, big_period = 1.0 / args.rate, args.big_every_s
    next_big = [big_period * (i + 1) / len(engines) for i in range(len(engines))]
    out: list[tuple[str, list[bytes]]] = []
    for step in range(int(args.offline_seconds * args.rate)):
        now = step * period
        for i, eng in enumerate(engines):
            big = big_period > 0 and now >= next_big[i]
            if big:
                next_big[i] += big_period
            eng.step(docs, args.big_blocks if big else args.blocks)
            assert isinstance(eng.sock, Capture)
            out.append((f"w{i:02d}", eng.sock.sent.pop()))
    return out, sum(e.events for e in engines)


async def offline(args: argparse.Namespace) -> dict:
    """The same frames straight into ``KVCache``'s subscribers (no sockets, no placements): the
    CPU the control plane's loop spends on them and how long each callback holds it, measured
    with the thread's CPU clock, so a busy host disturbs it much less than the live cells."""
    import gc

    from controlplane.kvcache.manager import KVCache, KVCacheConfig
    from controlplane.kvcache.subscriber import KVEventSource, KVEventSubscriber

    frames, events = offline_frames(args)
    kv = KVCache(KVCacheConfig())
    subs = {f"w{i:02d}": KVEventSubscriber(KVEventSource(f"w{i:02d}", "tcp://127.0.0.1:1"), kv._on_events,
                                           kv._on_reset, budget=kv.budget) for i in range(args.engines)}
    per: dict[str, list[list[bytes]]] = {}
    for eng, f in frames:
        per.setdefault(eng, []).append(f)

    async def feed(eng: str) -> None:     # what KVEventSubscriber._run does with each message
        sub = subs[eng]
        for f in per[eng]:
            await sub._on_message(f)
            await sub.budget.spend()

    gc.collect()
    gc.freeze()                # as the control plane does once started (omni_runtime.settle_heap)
    holds, gcs = HoldWatch(), GCWatch()
    holds.install()
    gcs.install()
    watch = StallWatch()
    holds.start()
    gcs.start()
    watch.start()
    t0 = time.thread_time()
    await asyncio.gather(*(feed(e) for e in per))
    cpu = time.thread_time() - t0
    late = watch.stop()
    held, collected = holds.stop(), gcs.stop()
    counters = kv.counters()
    return {"frames": len(frames), "events": events, "cpu_ms": round(cpu * 1000),
            "cpu_us_per_event": round(cpu * 1e6 / max(events, 1), 2),
            "malformed": sum(c.get("malformed", 0) for c in counters.values()),
            "timer_late_p50_ms": round(pct(late, 0.5), 3), "timer_late_p99_ms": round(pct(late, 0.99), 2),
            "hold_max_ms": round(max(held, default=0.0), 2), "longest_hold": holds.longest,
            "holds_over_2ms": sum(h > 2 for h in held), "holds_over_5ms": sum(h > 5 for h in held),
            "gc_max_ms": round(max((ms for _, ms in collected), default=0.0), 2),
            "gc_full": sum(g == 2 for g, _ in collected),
            "gc_total_ms": round(sum(ms for _, ms in collected), 1), "indexed_blocks": kv.exact.size()}


def summarize(result: dict) -> dict:
    out = {}
    for cell in ("quiet", "events"):
        rows = [r[cell] for r in result["rounds"] if cell in r]
        out[cell] = {k: {"median": statistics.median(x[k] for x in rows), "min": min(x[k] for x in rows),
                         "max": max(x[k] for x in rows)}
                     for k in ("p50_ms", "p99_ms", "max_ms", "stall_max_ms", "stall_p99_ms", "hold_max_ms",
                               "holds_over_5ms", "gc_max_ms", "gc_total_ms", "gc_full", "frames_applied",
                               "events_published")} if rows else {}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per cell")
    ap.add_argument("--warm", type=float, default=1.0, help="seconds of publishing before a measured events cell")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--rate", type=float, default=20.0, help="frames per second per engine")
    ap.add_argument("--blocks", type=int, default=32, help="new blocks per ordinary frame")
    ap.add_argument("--big-blocks", type=int, default=4096, help="blocks of a long prompt's frame")
    ap.add_argument("--big-every-s", type=float, default=2.0, help="per engine; 0 = never")
    ap.add_argument("--capacity", type=int, default=8192, help="blocks an engine holds before it evicts")
    ap.add_argument("--uvloop", action="store_true",
                    help="run the control plane on uvloop (no per-callback CPU clock: asyncio's loop is patched)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--offline", action="store_true",
                    help="no processes: the publisher's frames straight into the subscribers (CPU and holds)")
    ap.add_argument("--offline-seconds", type=float, default=15.0, help="--offline: seconds of the schedule")
    ap.add_argument("--out", help="directory for NAME.json")
    ap.add_argument("--name", default="kv_events_load")
    args = ap.parse_args()
    from omni_runtime import install_fast_loop

    if args.publisher or args.client or args.uvloop:
        install_fast_loop()
    if args.publisher:
        asyncio.run(publisher_main(args))
        return 0
    if args.client:
        asyncio.run(client_main(args))
        return 0
    import logging

    logging.basicConfig(level=logging.WARNING)
    if args.offline:
        out = asyncio.run(offline(args))
        out["load_avg"] = os.getloadavg()
        print(json.dumps(out, indent=1))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{args.name}.json").write_text(json.dumps(out, indent=1))
        return 0
    result = asyncio.run(run(args))
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("publisher", "client", "ready_file", "target")}
    result["summary"] = summarize(result)
    result["load_avg"] = os.getloadavg()
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
