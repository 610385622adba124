"""The call map: every Python function one request runs in the data plane (and the control
plane), with its calls and self time per request, under a steady load.

    python bench/call_map.py [--stream] [--clients 32] [--seconds 5] [--top 60] [--plane dataplane]

Two zero-latency mock engines (``bench/mock_engine.py``), our control plane (``round_robin``)
and one data-plane process, as ``bench/overhead.py`` runs them; ``--clients`` keep-alive
clients load the data plane (``overhead.run_cell``). After a warm-up, cProfile is switched on
in both planes for ``--seconds`` (a ``sitecustomize`` written to a temporary directory on
their ``PYTHONPATH`` installs it, started and dumped by SIGUSR1 / SIGUSR2), then the table is
printed: calls per request, self and cumulative microseconds per request. A request is one
call of ``--per`` (``parse_request``: once per request in the data plane; a coroutine counts a
call each time it resumes, so ``generate`` counts about two).

cProfile's own cost per call inflates every time (about 3x here); the counts are exact, and
they are what this map is for: which steps a request takes, how many, in which layers. Times
under a loaded host include preemption. For CPU per request use ``bench/overhead.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import overhead  # noqa: E402
from omni_proxy.launcher import ProcessGroup  # noqa: E402

_HOOK = '''
import os, sys
_dir = os.environ.get("OMNI_CALL_MAP_DIR")
if _dir and any(a in ("dataplane", "controlplane") for a in sys.argv):
    import cProfile, signal
    _role = "dataplane" if "dataplane" in sys.argv else "controlplane"
    _p = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda s, f: _p.enable())
    def _dump(s, f):
        _p.disable()
        _p.dump_stats(os.path.join(_dir, f"{_role}-{os.getpid()}.prof"))
    signal.signal(signal.SIGUSR2, _dump)
'''


def table(path: str, per: str, top: int, requests: int) -> str:
    stats = pstats.Stats(path).stats   # type: ignore[attr-defined]
    n = next((v[1] for k, v in stats.items() if k[2] == per), 0) or requests
    total = sum(v[2] for v in stats.values())
    calls = sum(v[1] for v in stats.values())
    out = [f"{Path(path).name.split('-')[0]}: {n} requests; {calls / n:.1f} calls and {total * 1e6 / n:.1f} us "
           f"self time (under cProfile) per request, {len(stats)} functions",
           "calls/req  self us/req  cum us/req  function"]
    for (fn, line, name), (_, nc, tt, ct, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = fn.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        out.append(f"{nc / n:9.2f} {tt * 1e6 / n:12.2f} {ct * 1e6 / n:11.2f}  {name} {where}:{line}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--per", default="parse_request", help="the data plane's function called once per request")
    p.add_argument("--plane", choices=("dataplane", "controlplane", "both"), default="both")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="omni-call-map-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(_HOOK)
        os.environ["OMNI_CALL_MAP_DIR"] = tmp
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), tmp])
        with ProcessGroup(ready_timeout=60) as group:
            engines = [overhead.start_engine(group, i, args.tokens) for i in range(2)]
            urls = [e.url for e in engines]
            cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                              "--policy", "round_robin", "--worker", urls[0], "--worker", urls[1],
                                              "--log-level", "WARNING"])
            dp = group.start("dataplane", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                           "--log-level", "WARNING"])
            pids = overhead.process_tree(dp.proc.pid) + overhead.process_tree(cp.proc.pid)
            asyncio.run(overhead.run_cell([dp.port], args.stream, 8, 1.0, 0.0, [], [], args.tokens))   # warm
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            res = asyncio.run(overhead.run_cell([dp.port], args.stream, args.clients, args.seconds, 0.0, pids, [],
                                                args.tokens))
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while len(glob.glob(f"{tmp}/*.prof")) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)   # (the dump's write)
        print(f"{'streamed' if args.stream else 'non-streamed'}, {args.clients} clients, {args.seconds:g} s: "
              f"{res['n']} requests, {res['rps']:.0f} req/s (profiled)\n")
        for plane in ("dataplane", "controlplane"):
            if args.plane in (plane, "both"):
                for path in glob.glob(f"{tmp}/{plane}-*.prof"):
                    print(table(path, args.per if plane == "dataplane" else "", args.top, res["n"]))
                    print()


if __name__ == "__main__":
    main()
