"""The control plane's CPU per non-streamed request, in process, in microseconds.

What one non-streamed request costs the control plane from a data plane's session: its
placement (``DataPlaneMessage.place``, round robin over two healthy workers, the memory
store) and its end (``EVENT_FINISHED``), through ``SchedulerService.Session`` as the
session socket drives it: messages arrive in batches (``--batch`` placements and the
previous batch's reports per incoming batch, as a loaded data plane sends them), and every
answer is serialized as it would be written. No socket and no other process: what it
measures is the control plane's own Python (``bench/overhead.py`` measures the processes).

    python bench/session_cost.py [--requests 10000] [--repeats 5] [--batch 16] \
        [--store memory|redis] [--policy round_robin] [--workers 2]

Prints the best of ``--repeats`` runs and every run, in microseconds of this thread's CPU
time (``time.thread_time``) per request. To compare two trees, run it from each
alternately (``PYTHONPATH=<tree> python <tree>/bench/session_cost.py``).

``--store redis``: the store ``[state] backend = "redis"`` makes with every other setting at
its default (what each replica of a scaled-out control plane runs), against a redis-server
this benchmark starts on loopback TCP (``tests/redis_fixtures``) and stops. The CPU counted
is still the control plane's thread alone: redis-server's share is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.compose import build  # noqa: E402
from controlplane.config import ControlPlaneConfig  # noqa: E402
from controlplane.workers import Health, HealthState, Role, WorkerSpec  # noqa: E402
from protos import omni_proxy_pb2 as pb  # noqa: E402



async def control_plane(*worker_ids: str, policy: str = "round_robin", redis_url: str = ""):
    """A control plane built in process with healthy workers of these ids; on the default
    Redis store at ``redis_url`` when given, else in memory."""
    state = {"state": {"backend": "redis", "redis_url": redis_url}} if redis_url else {}
    c = build(ControlPlaneConfig.from_dict({"policy": policy, "http_port": 0, **state}))
    for wid in worker_ids:
        spec = WorkerSpec(id=wid, url=f"http://127.0.0.1:1/{wid}", model="m", role=Role.BOTH)
        await c.store.put_spec(spec)
        c.fleet.put(spec)
        c.fleet.set_state(wid, HealthState(health=Health.HEALTHY))
    return c

class _Session:
    """One data plane's session on an in-process control plane."""

    def __init__(self, batch: int, *, policy: str = "round_robin", workers: int = 2, redis_url: str = "",
                 local: bool = False, fold: bool = False) -> None:
        self.batch = batch
        self.local = local
        self.fold = fold
        self.policy, self.redis_url = policy, redis_url
        self.worker_ids = ["a", "b"] if workers == 2 else [f"w{i:02d}" for i in range(workers)]
        self.seq = 0
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.finished: list[str] = []

    async def start(self) -> None:
        c = await control_plane(*self.worker_ids, policy=self.policy, redis_url=self.redis_url)
        self.store = c.store
        self.answers = c.scheduler.Session(self._messages(), None)
        await self.answers.__anext__()    # the session's info

    async def _messages(self):
        yield pb.DataPlaneMessage(open=pb.SessionOpen(node_id="bench", batches=True))
        while (msg := await self.incoming.get()) is not None:
            yield msg

    async def close(self) -> None:
        self.incoming.put_nowait(None)
        await self.answers.aclose()
        if self.redis_url:
            await self.store.close()

    async def run(self, n: int) -> None:
        """``n`` requests: placed in batches, each batch's reports sent with the next one."""
        done = 0
        while done < n:
            out = pb.DataPlaneMessage()
            msgs = out.batch.messages
            for rid in self.finished:
                ev = msgs.add().event
                ev.request_id, ev.kind, ev.latency_ms, ev.completion_tokens = rid, pb.EVENT_FINISHED, 1.0, 16
            for _ in range(self.batch):
                self.seq += 1
                p = msgs.add().place
                p.seq, p.request_id, p.model, p.leg = self.seq, f"r{self.seq}", "m", pb.LEG_ENTRY
                p.prompt_tokens, p.max_tokens = 12, 16
                if self.local:
                    p.placed_on = self.worker_ids[self.seq % len(self.worker_ids)]
                    if self.fold:   # it ended before its notice was written: one message
                        p.ended.request_id, p.ended.kind = p.request_id, pb.EVENT_FINISHED
                        p.ended.latency_ms, p.ended.completion_tokens = 1.0, 16
            # As read from the socket: decoded from its bytes.
            self.incoming.put_nowait(pb.DataPlaneMessage.FromString(out.SerializeToString()))
            self.finished = []
            if self.local:   # nothing is answered: the batch's requests end with the next one
                self.finished = [] if self.fold else [m.place.request_id for m in msgs if m.HasField("place")]
                await self._handled()
                done += self.batch
                continue
            while len(self.finished) < self.batch:
                answer = await self.answers.__anext__()
                answer.SerializeToString()            # as written to the socket
                body = answer.WhichOneof("body")
                parts = answer.batch.messages if body == "batch" else [answer] if body == "placement" else []
                for m in parts:
                    if m.WhichOneof("body") == "placement":
                        if m.placement.error:
                            raise RuntimeError(m.placement.error_message)
                        self.finished.append(m.placement.request_id)
            done += self.batch


    async def _handled(self) -> None:
        """Until the session has read what was queued (nothing comes back to wait for)."""
        while not self.incoming.empty():
            await asyncio.sleep(0)


async def measure(requests: int, repeats: int, batch: int, **session_args) -> list[float]:
    session = _Session(batch, **session_args)
    await session.start()
    try:
        await session.run(2000)    # warm-up
        runs = []
        for _ in range(repeats):
            t = time.thread_time()
            await session.run(requests)
            runs.append((time.thread_time() - t) / requests * 1e6)
        return runs
    finally:
        await session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="placements per incoming session batch")
    ap.add_argument("--store", choices=["memory", "redis"], default="memory")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--workers", type=int, default=2, help="healthy workers (ids a, b when 2)")
    ap.add_argument("--local", action="store_true", help="placements made by the data plane (PlaceRequest."
                    "placed_on, round_robin's local placement): recorded, not answered")
    ap.add_argument("--fold", action="store_true", help="with --local: each notice carries its request's end "
                    "(PlaceRequest.ended: it ended before the notice was written)")
    args = ap.parse_args()
    import uvloop   # as the control plane runs (a dependency)
    redis = None
    if args.store == "redis":
        from tests.redis_fixtures import RedisServer

        redis = RedisServer(tcp=True)
        redis.start()
    try:
        runs = uvloop.run(measure(args.requests, args.repeats, args.batch, policy=args.policy, workers=args.workers,
                                  local=args.local, fold=args.fold, redis_url=redis.url if redis is not None else ""))
    finally:
        if redis is not None:
            redis.close()
    what = ("local placement with its end folded" if args.fold else "local placement recorded") if args.local \
        else "place"
    print(f"control plane ({args.store} store, {args.policy}, {args.workers} workers), per non-streamed request "
          f"({what} + finish, batches of {args.batch}): "
          f"best {min(runs):.1f} us  "
          f"(runs: {' '.join(f'{r:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
