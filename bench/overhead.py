"""Proxy overhead: zero-latency mock engines driven directly, through omni-proxy, and through
the compiled peer routers (vllm-router, sglang-router, smg), side by side.

    python bench/overhead.py --rounds 3 --seconds 2.5 --dp-workers 2

Two mock engines (``bench/mock_engine.py``: prebuilt answers, 16 tokens, one SSE event
per loop turn) answer at once. Each target fronts both, round robin:

* ``direct``: the load generator alternates between the two engines itself;
* ``omni``: our control plane (``--policy round_robin``) + one data-plane process
  (defaults otherwise: access log on); ``omni-wN`` the same with ``--workers N``;
* ``vllm-router`` 0.1.17, ``sglang-router`` 0.3.2 and ``smg`` 1.13 (PyPI, installed once
  into ``${OMNI_PROXY_CACHE:-~/.cache/omni-proxy}/bench-peers``, ``bench/peers.py``).

Every cell (streaming or not x concurrency 1, 32, 128) runs every target for
``--seconds`` after a short warm-up, on fresh keep-alive connections (one per concurrent
client), from a raw-asyncio load generator. Rounds are interleaved: in each round every
cell visits every target, in an order rotated per round, so all targets share the same
machine noise. Per cell and target: throughput (ratio to direct in the same round), p50 /
p99 latency and time to first body byte (added over direct in the same round), and CPU
microseconds per request of all the proxy's processes (``/proc/<pid>/stat`` utime+stime of
the process tree, before/after) and of the two engines. Reported: the median over rounds
and the spread (min..max). Writes docs/benchmarks/overhead.{json,md,png}. Everything binds
127.0.0.1, every child is started through ``omni_proxy.launcher`` so it dies with the
benchmark, and the run is bounded (``--max-seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, cast
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from omni_proxy.launcher import Child, LaunchError, ProcessGroup, port_in  # noqa: E402

from bench import peers, prom  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PEERS = ("vllm-router", "sglang-router", "smg")
PEER_VERSIONS = {"vllm-router": "0.1.17", "sglang-router": "0.3.2", "smg": "1.13.0"}
CONCURRENCY = (1, 32, 128)
NOTES_MARK = "<!-- analysis: kept across reruns -->"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes and CPU

def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def process_tree(pid: int) -> list[int]:
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])   # utime + stime (fields 14, 15)
    return total / TICK


def loop_lag(url: str) -> dict | None:
    """The data plane's event-loop lag histogram (cumulative bucket counts) and its 10 s
    max, from /metrics; None where it has none."""
    text = prom.scrape(url)
    hist = prom.histogram(text, "omni_dp_event_loop_lag_seconds") if text else None
    if text is None or hist is None:
        return None
    return {**hist, "max_10s": prom.gauge(text, "omni_dp_event_loop_lag_max_seconds")}


def lag_delta(before: dict | None, after: dict | None) -> dict | None:
    """Ticks over 5 ms between two ``loop_lag`` readings, the bucket the longest stall fell
    in (ms), and the longest stall itself where the 10 s max tells it: the after-reading's
    max is the window's longest when it beats the before-reading's (stalls before the window
    are at most that) and lies in the top non-empty bucket (nothing longer in between)."""
    if not before or not after:
        return None
    d = prom.delta(before, after)
    assert d is not None   # both readings are there
    top = prom.top_bucket(d)
    peak, prior = after["max_10s"] or 0.0, before["max_10s"] or 0.0
    exact = top is not None and peak > prior and top[0] < peak <= top[1]
    return {"ticks": d["count"], "ticks_over_5ms": prom.over(d, 0.005),
            "longest_le_ms": top[1] * 1000 if top else 0.0,
            "longest_ms": peak * 1000 if exact else None, "max_10s_ms": peak * 1000}


def host_line() -> str:
    return f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def write_keeping_notes(md_path: Path, md: str) -> None:
    """Write the report; hand-written analysis below ``NOTES_MARK`` in the old one survives."""
    old = md_path.read_text() if md_path.exists() else ""
    if NOTES_MARK in old:
        md = md + "\n" + old[old.index(NOTES_MARK):]
    md_path.write_text(md)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(group: ProcessGroup, i: int, tokens: int) -> Child:
    ready_file = group.workdir / f"engine{i}.ready"
    cmd = [sys.executable, str(ROOT / "bench" / "mock_engine.py"), "--port", "0", "--ready-file",
           str(ready_file), "--tokens", str(tokens)]
    return group.start_program(f"engine{i}", cmd, port_in(ready_file))


def start_peer(group: ProcessGroup, peer: str, engines: list[str]) -> Child:
    port, prom = free_port(), free_port()
    if peer == "sglang-router":
        cmd = [str(sglang_venv() / "bin" / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--worker-urls", *engines, "--policy", "round_robin",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warn"]
    else:
        cmd = peers.peer_command(peer, "round_robin", "agg", peers.Engines(engines, [], [], {}), port, prom)
    url = f"http://127.0.0.1:{port}"
    child = group.start_program(peer, cmd, lambda: port if peers._ready(url) else 0,
                                env={"RUST_LOG": "warn"}, poll_s=0.1)
    problem = probe(url)
    if problem:
        raise LaunchError(f"{peer} cannot serve the benchmark's requests: {problem}")
    return child


def sglang_venv() -> Path:
    """sglang-router gets a venv of its own: its wheel also installs a ``smg`` script, which
    would shadow smg 1.13's in the shared peer venv."""
    return peers.cache_dir() / "sglang-venv"


def ensure_sglang() -> str | None:
    import subprocess
    venv = sglang_venv()
    if (venv / "bin" / "sglang-router").exists():
        return None
    log(f"pip install sglang-router==0.3.2 into {venv}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "sglang-router==0.3.2"],
                       capture_output=True, text=True)
    return r.stderr[-500:] if r.returncode else None


def probe(url: str) -> str | None:
    """One string-prompt completion, streamed and not; the error text if refused."""
    import urllib.error
    import urllib.request
    for stream in (False, True):
        body = json.dumps({"model": "sim-model", "prompt": "probe", "max_tokens": 4, "stream": stream}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        for _attempt in range(40):
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
                    break
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    return f"HTTP {exc.code}: {exc.read()[:300]!r}"
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        else:
            return "no successful answer to a probe request"
    return None


# ---------------------------------------------------------------- load generator

class _Client(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time; Content-Length or chunked."""

    def __init__(self) -> None:
        # None until asyncio calls connection_made (its first call): typed as set.
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.waiter: asyncio.Future | None = None
        self.buf = bytearray()
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    def request(self, data: bytes) -> asyncio.Future:
        self.buf.clear()
        self.head_end = -1
        self.first = 0.0
        self.status = 0
        self.length = -1      # -1: chunked
        self.pos = 0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.head_end < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head_end = end + 4
            head = bytes(buf[:end]).lower()
            self.status = int(head[9:12])
            at = head.find(b"content-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at)
                self.length = int(head[at + 15:stop if stop >= 0 else None])
            self.pos = self.head_end
        if not self.first and len(buf) > self.head_end:
            self.first = time.perf_counter()
        if self.length >= 0:
            if len(buf) - self.head_end >= self.length:
                self._done()
            return
        pos = self.pos            # chunked: walk the chunk sizes
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(bytes(buf[pos:nl]).split(b";")[0], 16)
            if size == 0:
                if buf.find(b"\r\n", nl + 2) >= 0 or len(buf) >= nl + 4:
                    self._done()
                return
            if len(buf) < nl + 2 + size + 2:
                break
            pos = nl + 2 + size + 2
        self.pos = pos

    def _done(self) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result((self.status, self.first, time.perf_counter()))


def request_bytes(port: int, stream: bool, max_tokens: int) -> bytes:
    body = json.dumps({"model": "sim-model", "prompt": "measure the proxy overhead", "max_tokens": max_tokens,
                       "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body))


async def run_cell(ports: list[int], stream: bool, conc: int, seconds: float, warm: float,
                   proxy_pids: list[int], engine_pids: list[int], max_tokens: int,
                   parts: dict[str, list[int]] | None = None) -> dict:
    loop = asyncio.get_running_loop()
    clients = []
    for i in range(conc):
        _, c = await loop.create_connection(_Client, "127.0.0.1", ports[i % len(ports)])
        clients.append((c, request_bytes(ports[i % len(ports)], stream, max_tokens)))
    lat, ttfb = [], []
    errors = 0
    t0 = time.perf_counter()
    t_start, t_end = t0 + warm, t0 + warm + seconds
    marks: dict[str, Any] = {}

    async def worker(c: _Client, data: bytes) -> None:
        nonlocal errors
        while True:
            s = time.perf_counter()
            if s >= t_end or c.closed:
                return
            try:
                status, first, end = await c.request(data)
            except ConnectionError:
                errors += 1
                return
            if status != 200:
                errors += 1
            elif s >= t_start and end <= t_end:
                lat.append(end - s)
                ttfb.append(first - s)

    async def sampler() -> None:
        await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
        marks["p0"], marks["e0"], marks["g0"] = cpu_seconds(proxy_pids), cpu_seconds(engine_pids), time.process_time()
        marks["parts0"] = {k: cpu_seconds(v) for k, v in (parts or {}).items()}
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        marks["p1"], marks["e1"], marks["g1"] = cpu_seconds(proxy_pids), cpu_seconds(engine_pids), time.process_time()
        marks["parts1"] = {k: cpu_seconds(v) for k, v in (parts or {}).items()}

    await asyncio.gather(sampler(), *(worker(c, d) for c, d in clients))
    for c, _ in clients:
        c.transport.close()
    n = len(lat)
    lat.sort()
    ttfb.sort()

    def q(v, p):
        return v[min(len(v) - 1, int(p * len(v)))] * 1000 if v else float("nan")
    return {"n": n, "errors": errors, "rps": n / seconds,
            "p50_ms": q(lat, 0.5), "p99_ms": q(lat, 0.99), "ttfb_p50_ms": q(ttfb, 0.5), "ttfb_p99_ms": q(ttfb, 0.99),
            "proxy_cpu_us": (marks["p1"] - marks["p0"]) * 1e6 / n if n else float("nan"),
            "engine_cpu_us": (marks["e1"] - marks["e0"]) * 1e6 / n if n else float("nan"),
            "loadgen_cpu_us": (marks["g1"] - marks["g0"]) * 1e6 / n if n else float("nan"),
            "parts_cpu_us": {k: (marks["parts1"][k] - marks["parts0"][k]) * 1e6 / n if n else float("nan")
                             for k in marks["parts0"]}}


# ---------------------------------------------------------------- the run

CELLS = [(s, c) for s in (False, True) for c in CONCURRENCY]


def cells() -> list[tuple[bool, int]]:
    return CELLS


def cell_key(stream: bool, conc: int) -> str:
    return f"{'stream' if stream else 'json'}-c{conc}"


def run(args) -> dict:
    wanted_peers = [p for p in PEERS if p not in args.skip]
    install_errors = {}
    if wanted_peers:
        need = [p for p in wanted_peers if p in peers.PEER_PACKAGES]
        install_errors = peers.ensure_installed(need, log=log)
        if "sglang-router" in wanted_peers:
            err = ensure_sglang()
            if err:
                install_errors["sglang-router"] = err
    results: dict = {"rounds": [], "skipped": dict(install_errors)}
    deadline = time.monotonic() + args.max_seconds
    with ProcessGroup(ready_timeout=60) as group:
        engines = [start_engine(group, i, args.tokens) for i in range(2)]
        engine_urls = [e.url for e in engines]
        engine_pids = [p for e in engines for p in process_tree(e.proc.pid)]
        log(f"engines {engine_urls}")
        targets: dict[str, tuple[list[int], list[int]]] = {"direct": ([e.port for e in engines], [])}
        parts: dict[str, dict[str, list[int]]] = {}
        cp = group.start("controlplane", ["controlplane", "--listen", "127.0.0.1:0", "--http-port", "0",
                                          "--policy", "round_robin", "--worker", engine_urls[0],
                                          "--worker", engine_urls[1], "--log-level", "WARNING"])
        if args.baseline_tree:
            # The same two processes from another checkout (e.g. before an optimisation),
            # with its own control plane, so both sides speak that tree's protocol.
            env = {"PYTHONPATH": str(Path(args.baseline_tree).resolve())}
            here = os.getcwd()
            os.chdir(args.baseline_tree)   # python -m puts the cwd first on sys.path
            bcp = group.start("controlplane-baseline", ["controlplane", "--listen", "127.0.0.1:0", "--http-port",
                                                        "0", "--policy", "round_robin", "--worker", engine_urls[0],
                                                        "--worker", engine_urls[1], "--log-level", "WARNING"],
                              env=env)
            bdp = group.start("dataplane-baseline", ["dataplane", "--port", "0", "--controlplane", bcp.address,
                                                     "--log-level", "WARNING",
                                                     *([] if args.access_log else ["--no-access-log"])], env=env)
            os.chdir(here)
            targets["omni-baseline"] = ([bdp.port], process_tree(bdp.proc.pid) + process_tree(bcp.proc.pid))
            parts["omni-baseline"] = {"dataplane": process_tree(bdp.proc.pid),
                                      "controlplane": process_tree(bcp.proc.pid)}
        dp_counts = [1] + ([args.dp_workers] if args.dp_workers > 1 else [])
        for n in dp_counts:
            name = "omni" if n == 1 else f"omni-w{n}"
            extra = [] if args.access_log else ["--no-access-log"]
            dp = group.start(f"dataplane-{n}", ["dataplane", "--port", "0", "--controlplane", cp.address,
                                                "--workers", str(n), "--log-level", "WARNING", *extra])
            time.sleep(0.5)   # helpers (--workers) fork after ready
            # The control plane is shared by both omni targets; it is counted with each.
            targets[name] = ([dp.port], process_tree(dp.proc.pid) + process_tree(cp.proc.pid))
            parts[name] = {"dataplane": process_tree(dp.proc.pid), "controlplane": process_tree(cp.proc.pid)}
            results.setdefault("pids", {})[name] = parts[name]
        for peer in wanted_peers:
            if peer in install_errors:
                continue
            try:
                child = start_peer(group, peer, engine_urls)
            except LaunchError as exc:
                log(f"{peer}: not run: {exc}")
                results["skipped"][peer] = str(exc)[-800:]
                continue
            targets[peer] = ([child.port], process_tree(child.proc.pid))
        names = list(targets)
        log(f"targets: {', '.join(names)}")
        if args.pause_for_profile:
            log(f"pausing: {json.dumps(results.get('pids'))}")
        # warm every target once (connection pools, JIT-less caches)
        for name in names:
            for stream in (False, True):
                asyncio.run(run_cell(targets[name][0], stream, 8, 0.3, 0.0, [], [], args.tokens))
        results["targets"] = names
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            rnd: dict = {}
            for stream, conc in cells():
                key = cell_key(stream, conc)
                for name in order:
                    if time.monotonic() > deadline:
                        log("--max-seconds reached: stopping")
                        results["rounds"].append(rnd)
                        return results
                    ports, pids = targets[name]
                    watch = name in ("omni", "omni-baseline")   # one process: its /metrics is the one loop
                    before = loop_lag(f"http://127.0.0.1:{ports[0]}") if watch else None
                    res = asyncio.run(run_cell(ports, stream, conc, args.seconds, args.warm, pids, engine_pids,
                                               args.tokens, parts.get(name)))
                    if watch:
                        res["loop_lag"] = lag_delta(before, loop_lag(f"http://127.0.0.1:{ports[0]}"))
                    rnd.setdefault(key, {})[name] = res
                    log(f"round {r + 1}/{args.rounds} {key:11s} {name:13s} {res['rps']:8.0f} req/s "
                        f"p50 {res['p50_ms']:6.2f} ms ttfb {res['ttfb_p50_ms']:6.2f} ms "
                        f"proxy {res['proxy_cpu_us']:6.0f} us/req engines {res['engine_cpu_us']:5.0f} us/req"
                        + "".join(f" {k} {v:.0f}" for k, v in res["parts_cpu_us"].items())
                        + (f" loop stall <= {res['loop_lag']['longest_le_ms']:.0f} ms"
                           if res.get("loop_lag") else "")
                        + (f" errors {res['errors']}" if res["errors"] else ""))
            results["rounds"].append(rnd)
    return results


def summarize(results: dict) -> dict:
    """Per cell and target: median over rounds and (min, max) of each derived number."""
    out: dict = {}
    for stream, conc in cells():
        key = cell_key(stream, conc)
        for name in results["targets"]:
            per: dict[str, list[float]] = {}
            for rnd in results["rounds"]:
                cell = rnd.get(key, {})
                if name not in cell or "direct" not in cell:
                    continue
                t, d = cell[name], cell["direct"]
                vals = {"rps": t["rps"], "ratio": t["rps"] / d["rps"] if d["rps"] else float("nan"),
                        "add_p50_ms": t["p50_ms"] - d["p50_ms"], "add_p99_ms": t["p99_ms"] - d["p99_ms"],
                        "ttfb_p50_ms": t["ttfb_p50_ms"], "add_ttfb_p50_ms": t["ttfb_p50_ms"] - d["ttfb_p50_ms"],
                        "proxy_cpu_us": t["proxy_cpu_us"], "engine_cpu_us": t["engine_cpu_us"],
                        "errors": t["errors"]}
                for part, v in (t.get("parts_cpu_us") or {}).items():
                    vals[f"{part}_cpu_us"] = v
                if t.get("loop_lag"):
                    vals["loop_stall_le_ms"] = t["loop_lag"]["longest_le_ms"]
                    vals["loop_ticks_over_5ms"] = t["loop_lag"]["ticks_over_5ms"]
                for k, v in vals.items():
                    per.setdefault(k, []).append(v)
            if per:
                out.setdefault(key, {})[name] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                                 for k, v in per.items()}
    return out


def _fmt(s: dict, k: str, digits: int = 2) -> str:
    v = s[k]
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}..{v['max']:.{digits}f})"


def markdown(results: dict, summary: dict, command: str) -> str:
    lines = ["# Proxy overhead: omni-proxy vs direct vs compiled peer routers", "",
             f"Command: `{command}`", "",
             f"Host: {results['host']}. Two zero-latency mock engines (`bench/mock_engine.py`, "
             f"{results['args']['tokens']} tokens, streamed one SSE event per loop turn), round robin, "
             f"{len(results['rounds'])} interleaved rounds of {results['args']['seconds']} s per cell and target. "
             "Each number: the median over rounds, (min..max) the spread. Ratio: throughput over direct's in the "
             "same round. Added p50/p99 and TTFB: over direct's in the same round (ms). CPU: microseconds per "
             "request of all the proxy's processes (omni: data plane + control plane), and of the two engines.", "",
             "![throughput vs direct, proxy CPU per request and added p50, per target and cell](overhead.png)", ""]
    for stream, conc in cells():
        key = cell_key(stream, conc)
        if key not in summary:
            continue
        lines += [f"## {'streamed' if stream else 'non-streamed'}, concurrency {conc}", "",
                  "| target | req/s | ratio vs direct | added p50 ms | added p99 ms | TTFB p50 ms | added TTFB ms "
                  "| proxy CPU us/req | engine CPU us/req |",
                  "|---|---|---|---|---|---|---|---|---|"]
        split = []
        for name, s in summary[key].items():
            lines.append(f"| {name} | {s['rps']['median']:.0f} | {_fmt(s, 'ratio')} | {_fmt(s, 'add_p50_ms')} | "
                         f"{_fmt(s, 'add_p99_ms')} | {_fmt(s, 'ttfb_p50_ms')} | {_fmt(s, 'add_ttfb_p50_ms')} | "
                         f"{_fmt(s, 'proxy_cpu_us', 0)} | {_fmt(s, 'engine_cpu_us', 0)} |")
            if "dataplane_cpu_us" in s:
                split.append(f"{name}: data plane {_fmt(s, 'dataplane_cpu_us', 0)}, control plane "
                             f"{_fmt(s, 'controlplane_cpu_us', 0)} us/req"
                             + (f", longest event-loop stall <= {s['loop_stall_le_ms']['max']:.0f} ms "
                                f"({s['loop_ticks_over_5ms']['max']:.0f} of "
                                f"~{100 * (results['args']['seconds'] + results['args']['warm']):.0f} "
                                "10-ms ticks over 5 ms)" if "loop_stall_le_ms" in s else ""))
        lines.append("")
        if split:
            lines += ["CPU split: " + "; ".join(split) + ".", ""]
    if results.get("skipped"):
        lines += ["Not run: " + "; ".join(f"{k}: {v[:200]}" for k, v in results["skipped"].items()), ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [cell_key(s, c) for s, c in cells() if cell_key(s, c) in summary]
    names = [n for n in next(iter(summary.values())) if n != "direct"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 11))
    width = 0.8 / max(1, len(names))
    for ax, metric, title in ((axes[0], "ratio", "throughput / direct"),
                              (axes[1], "proxy_cpu_us", "proxy CPU us per request"),
                              (axes[2], "add_p50_ms", "added p50 latency (ms)")):
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(keys))]
            med = [summary[k][name][metric]["median"] if name in summary[k] else 0 for k in keys]
            lo = [m - summary[k][name][metric]["min"] if name in summary[k] else 0
                  for k, m in zip(keys, med, strict=False)]
            hi = [summary[k][name][metric]["max"] - m if name in summary[k] else 0
                  for k, m in zip(keys, med, strict=False)]
            ax.bar(xs, med, width, yerr=[lo, hi], label=name, capsize=2)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))], keys)
        ax.set_title(title)
        if metric == "add_p50_ms":
            ax.set_yscale("symlog", linthresh=1)
    axes[0].legend(ncol=len(names), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.5, help="measured seconds per cell and target")
    p.add_argument("--warm", type=float, default=0.3, help="unmeasured seconds at the start of each cell")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dp-workers", type=int, default=2, help="also run our data plane with --workers N (1: not)")
    p.add_argument("--skip", nargs="*", default=[], choices=PEERS, help="peers not to run")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="our data plane's access log (default on, as deployed)")
    p.add_argument("--baseline-tree", default="", help="also run data plane + control plane from this "
                   "checkout (target omni-baseline), e.g. a git worktree of an earlier commit")
    p.add_argument("--cells", nargs="*", default=[], metavar="CELL",
                   help="only these cells (json-c32 stream-c128 ...; default: all six)")
    p.add_argument("--max-seconds", type=float, default=1500)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "overhead"))
    p.add_argument("--pause-for-profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cells:
        known = {cell_key(s, c): (s, c) for s, c in CELLS}
        unknown = [c for c in args.cells if c not in known]
        if unknown:
            p.error(f"--cells: unknown {', '.join(unknown)} (known: {', '.join(known)})")
        CELLS[:] = [known[c] for c in known if c in args.cells]
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    command = "python bench/overhead.py " + " ".join(sys.argv[1:])
    started = time.time()
    results = run(args)
    results["args"] = {k: v for k, v in vars(args).items() if k != "out"}   # no paths of this machine
    results["command"] = command
    results["host"] = host_line()
    results["peer_versions"] = PEER_VERSIONS
    results["wall_s"] = round(time.time() - started, 1)
    summary = summarize(results)
    results["summary"] = summary
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    md = markdown(results, summary, command)
    write_keeping_notes(out.with_suffix(".md"), md)
    try:
        plot(summary, out.with_suffix(".png"))
    except Exception as exc:   # noqa: BLE001 - plots are a convenience
        log(f"plot failed: {exc}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
