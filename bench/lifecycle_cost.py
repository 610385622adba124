"""Per-request CPU cost of the data plane's lifecycle bookkeeping, in microseconds.

What one request costs the data plane beyond routing it: the tracker's stage stamps and
its lifecycle reports (protobuf messages built; the gRPC send is stubbed out), the
Prometheus observations at the end, the JSON access-log line (formatted and written by
the standard logging handler to /dev/null, with the request-id filter installed), the
trace-context check of a client ``traceparent``, and, for comparison, OpenTelemetry spans
(request + one leg, batch processor, exporter that drops them).

    python bench/lifecycle_cost.py [--requests 20000] [--repeats 5] [--json]

Prints the best of ``--repeats`` runs for each variant, in microseconds of this thread's
CPU time per request (``time.thread_time``, so other processes on a busy machine do not
count); the goal is well under 20 µs for the default configuration (access log on, spans
off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from dataplane.metrics import DataPlaneMetrics  # noqa: E402
from dataplane.observe import (ACCESS_LOGGER, BatchedStreamHandler, CachedTimeFormatter,  # noqa: E402
                               Observer, install_request_id_filter, skip_unused_record_fields, trace_headers)
from dataplane.requests import parse_request  # noqa: E402
from dataplane.tracking import LEG_DECODE, LEG_PREFILL, LEG_WHOLE, RequestTracker  # noqa: E402
from protos import omni_proxy_pb2 as pb  # noqa: E402

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Client:
    """The placement client's report(), minus the queue to the gRPC stream."""

    def report(self, event) -> None:
        pass

    def finished(self, rid, prompt_tokens, completion_tokens, ttft_ms, latency_ms) -> None:
        self.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED, prompt_tokens=prompt_tokens,
                                      completion_tokens=completion_tokens, ttft_ms=ttft_ms, latency_ms=latency_ms))


def _setup_logging(access_log: bool) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    # As the data plane's own process has it (configure_logging): the batched handler, whose
    # access lines skip logging's machinery, and the cached-time formatter.
    handler = BatchedStreamHandler(os.open(os.devnull, os.O_WRONLY))
    handler.setFormatter(CachedTimeFormatter())
    skip_unused_record_fields()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access_log else logging.WARNING)
    install_request_id_filter()


def _request(path: str = "/v1/completions", stream: bool = True):
    body = {"model": "m", "prompt": "hello " * 50, "max_tokens": 128, "stream": stream}
    return parse_request(path, orjson.dumps(body), "client-7")


def run_variant(name: str, n: int, *, access_log: bool = True, stamps_only: bool = False,
                flow: str = "aggregated", traceparent: str = "", tracing=None, stream: bool = True) -> float:
    _setup_logging(access_log)
    metrics = DataPlaneMetrics()
    obs = Observer(metrics, access_log_on=access_log, tracing=tracing)
    client = _Client()
    req = _request(stream=stream)
    placement = pb.Placement(flow=pb.FLOW_AGGREGATED, queued_ms=0.0)
    now = time.perf_counter
    pd = flow == "sequential"

    def one() -> None:
        t = RequestTracker(client)
        if traceparent:
            t.trace = trace_headers(traceparent, None)
        if tracing is not None:
            t.tracing = tracing
            tracing.start_request(t, "/v1/completions")
        t.req = req
        t.tokenized = now()
        t.matched = now()
        t.attach(req, placement, flow)
        if pd:
            t.leg(LEG_PREFILL, "p0")
            t.prefill_answer()
            t.leg(LEG_DECODE, "d0")
        else:
            t.leg(LEG_WHOLE, "w0")
        t.first_token(streamed=stream)
        if pd:
            t.prefill_done()
        if stream:
            t.stream_ended()
        t.finished(128)
        if not stamps_only:
            obs.complete(t, "/v1/completions", 200)

    for _ in range(min(n, 2000)):   # warm: series resolved, caches filled
        one()
    # CPU time of this thread: what the bookkeeping costs, not time lost to other processes.
    t0 = time.thread_time()
    for _ in range(n):
        one()
    return (time.thread_time() - t0) / n * 1e6


def _tracing():
    try:
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    except ImportError:
        return None
    from dataplane.otel import Tracing

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    return Tracing("http://127.0.0.1:1", exporter=Drop())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    variants: list[tuple[str, dict[str, Any]]] = [
        ("tracker stamps + lifecycle events only", dict(stamps_only=True)),
        ("+ metrics (access log off)", dict(access_log=False)),
        ("+ metrics + access log (default)", dict()),
        ("default, non-streamed (one report)", dict(stream=False)),
        ("default, sequential PD (two legs)", dict(flow="sequential")),
        ("default + client traceparent forwarded", dict(traceparent=TRACEPARENT)),
    ]
    tracing = _tracing()
    if tracing is not None:
        variants.append(("default + OpenTelemetry spans (--otel-endpoint)", dict(tracing=tracing)))
    results = {}

    async def measure() -> None:   # in a running loop, as the handler's flush timer needs
        for name, kw in variants:
            results[name] = min(run_variant(name, args.requests, **kw) for _ in range(args.repeats))

    asyncio.run(measure())
    if tracing is not None:
        tracing.shutdown()
    logging.getLogger().handlers.clear()
    if args.json:
        print(orjson.dumps({"python": sys.version.split()[0], "requests": args.requests,
                            "us_per_request": {k: round(v, 2) for k, v in results.items()}}).decode())
        return
    print(f"per-request bookkeeping, best of {args.repeats} x {args.requests} requests "
          f"(python {sys.version.split()[0]})")
    for name, us in results.items():
        print(f"  {name:<52} {us:7.2f} us")


if __name__ == "__main__":
    main()
