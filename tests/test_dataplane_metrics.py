"""Data-plane observability in units: metrics series, access-log line, request-id filter,
trace-context checks, spans, and that OpenTelemetry costs nothing when it is off."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dataplane.metrics import DataPlaneMetrics
from dataplane.observe import (ACCESS_LOGGER, CachedTimeFormatter, Observer, RequestIdFilter, current_request_id,
                               trace_headers)
from dataplane.requests import parse_request
from dataplane.tracking import LEG_DECODE, LEG_PREFILL, LEG_WHOLE, RequestTracker
from protos import omni_proxy_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Reports:
    def __init__(self) -> None:
        self.events: list[pb.LifecycleEvent] = []

    def report(self, event: pb.LifecycleEvent) -> None:
        self.events.append(event)

    def finished(self, rid: str, prompt_tokens: int, completion_tokens: int, ttft_ms: float,
                 latency_ms: float) -> None:
        self.report(pb.LifecycleEvent(request_id=rid, kind=pb.EVENT_FINISHED, prompt_tokens=prompt_tokens,
                                      completion_tokens=completion_tokens, ttft_ms=ttft_ms, latency_ms=latency_ms))


def _req(stream: bool = True, client_id: str | None = "cli-1"):
    body = {"model": "m", "prompt": "hello world " * 10, "max_tokens": 10, "stream": stream}
    return parse_request("/v1/completions", orjson.dumps(body), client_id)


def _samples(metrics: DataPlaneMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _run(t: RequestTracker, *, flow: str = "aggregated", tokens: int = 10, pd: bool = False) -> None:
    """Drive a tracker through a request's stages, as the flows do."""
    req = t.req
    t.tokenized = time.perf_counter()
    t.matched = time.perf_counter()
    t.attach(req, pb.Placement(queued_ms=2.5), flow)
    if pd:
        t.leg(LEG_PREFILL, "p0")
        t.prefill_answer()
        t.leg(LEG_DECODE, "d0")
    else:
        t.leg(LEG_WHOLE, "w0")
    t.first_token(streamed=req.stream)
    if req.stream:
        time.sleep(0.002)
        t.stream_ended()
    t.finished(tokens)


# ---------------------------------------------------------------------------- tracker

def test_stages_are_stamped_in_order_and_events_reach_the_control_plane():
    reports = Reports()
    t = RequestTracker(reports)
    t.req = _req()
    t.failed("", "before placement", 400)          # not placed: the control plane hears nothing
    assert reports.events == []
    t = RequestTracker(reports)
    t.req = _req()
    _run(t, flow="sequential", pd=True)
    stamps = [t.received, t.tokenized, t.matched, t.placed_at, t.dispatched, t.prefill_answered,
              t.decode_dispatched, t.first_token_at, t.last_token, t.done]
    assert all(stamps) and stamps == sorted(stamps)
    assert (t.prefill_worker, t.decode_worker, t.queued_ms, t.outcome) == ("p0", "d0", 2.5, "finished")
    assert [e.kind for e in reports.events] == [pb.EVENT_FIRST_TOKEN, pb.EVENT_FINISHED]
    assert reports.events[0].streamed and reports.events[1].completion_tokens == 10


def test_a_non_streamed_request_sends_one_report_without_a_ttft():
    """A whole answer's first byte is its last: one finished report (no first-token one),
    and no ttft in it, from which the control plane would learn a TPOT of about zero."""
    reports = Reports()
    t = RequestTracker(reports)
    t.req = _req(stream=False)
    _run(t)
    assert [e.kind for e in reports.events] == [pb.EVENT_FINISHED]
    [done] = reports.events
    assert done.ttft_ms == 0 and done.latency_ms > 0 and done.completion_tokens == 10
    assert t.first_token_at and t.last_token == t.first_token_at      # the stages keep their stamps
    streamed = Reports()
    t = RequestTracker(streamed)
    t.req = _req(stream=True)
    _run(t)
    assert [e.kind for e in streamed.events] == [pb.EVENT_FIRST_TOKEN, pb.EVENT_FINISHED]
    assert streamed.events[1].ttft_ms > 0 and streamed.events[1].latency_ms > streamed.events[1].ttft_ms


def test_a_retried_prefill_counts_a_retry_and_keeps_the_first_dispatch():
    t = RequestTracker(Reports())
    t.req = _req()
    t.attach(t.req, pb.Placement(), "sequential")
    t.leg(LEG_PREFILL, "p0")
    first = t.dispatched
    t.leg_failed("p0", "boom", 500)
    t.leg(LEG_PREFILL, "p1")
    assert t.retries == 1 and t.dispatched == first and t.prefill_worker == "p1"


def test_tracker_has_no_per_instance_dict():
    t = RequestTracker(Reports())
    assert not hasattr(t, "__dict__")


# ---------------------------------------------------------------------------- metrics

def test_observer_fills_histograms_by_model_and_flow_only():
    metrics = DataPlaneMetrics()
    obs = Observer(metrics, access_log_on=False)
    t = RequestTracker(Reports())
    t.req = _req()
    _run(t, tokens=11)
    t.cached_tokens = 16
    obs.complete(t, "/v1/completions", 200)
    s = _samples(metrics)
    mf = (("flow", "aggregated"), ("model", "m"), ("model_name", "m"))
    for name in ("omni_dp_time_to_first_token_seconds", "omni_dp_time_per_output_token_seconds",
                 "omni_dp_e2e_request_latency_seconds", "omni_dp_placement_seconds", "omni_dp_queue_seconds",
                 "omni_dp_prefill_seconds", "omni_dp_decode_seconds"):
        assert s[(name + "_count", mf)] == 1, name
        assert s[(name + "_bucket", tuple(sorted(mf + (("le", "+Inf"),))))] == 1
    assert s[("omni_dp_e2e_request_latency_seconds_sum", mf)] == pytest.approx(t.done - t.received)
    assert s[("omni_dp_time_per_output_token_seconds_sum", mf)] == pytest.approx(
        (t.last_token - t.first_token_at) / 10)
    assert s[("omni_dp_queue_seconds_sum", mf)] == pytest.approx(0.0025)
    assert s[("omni_dp_generation_tokens_total", mf)] == 11
    assert s[("omni_dp_cached_tokens_total", mf)] == 16
    assert s[("omni_dp_prompt_tokens_total", mf)] == t.req.prompt_tokens
    assert s[("omni_dp_requests_total", (("code_class", "2xx"), ("route", "/v1/completions")))] == 1
    assert s[("omni_dp_flows_total", (("flow", "aggregated"),))] == 1
    assert s[("omni_dp_inflight_requests", ())] == 0
    assert s[("process_cpu_seconds_total", ())] > 0
    # Buckets are cumulative and end at the count.
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in s.items()
                     if k[0] == "omni_dp_e2e_request_latency_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == 1


def test_value_on_a_bucket_edge_counts_in_that_bucket():
    metrics = DataPlaneMetrics()
    metrics.ttft.labels("m", "m", "f").observe(0.5)
    s = _samples(metrics)
    def key(le):
        return ("omni_dp_time_to_first_token_seconds_bucket",
                (("flow", "f"), ("le", le), ("model", "m"), ("model_name", "m")))
    assert s[key("0.25")] == 0 and s[key("0.5")] == 1


def test_non_streamed_and_unplaced_requests():
    metrics = DataPlaneMetrics()
    obs = Observer(metrics, access_log_on=False)
    t = RequestTracker(Reports())
    t.req = _req(stream=False)
    _run(t)
    obs.complete(t, "/v1/completions", 200)
    rejected = RequestTracker(Reports())
    rejected.req = _req()
    rejected.req.model = "typed-by-a-client"
    obs.complete(rejected, "/v1/completions", 404)
    s = _samples(metrics)
    mf = (("flow", "aggregated"), ("model", "m"), ("model_name", "m"))
    # No streamed tokens: no TTFT/TPOT/decode observation; e2e and placement still.
    assert s.get(("omni_dp_time_to_first_token_seconds_count", mf), 0) == 0
    assert s.get(("omni_dp_time_per_output_token_seconds_count", mf), 0) == 0
    assert s[("omni_dp_e2e_request_latency_seconds_count", mf)] == 1
    assert s[("omni_dp_requests_total", (("code_class", "4xx"), ("route", "/v1/completions")))] == 1
    assert not any("typed-by-a-client" in str(k) for k in s)


def test_series_stop_growing_at_the_guard(monkeypatch):
    import dataplane.metrics as m
    monkeypatch.setattr(m, "_MAX_SERIES", 3)
    metrics = DataPlaneMetrics()
    for i in range(10):
        metrics.series(f"model-{i}", "aggregated").e2e.observe(0.1)
    models = {dict(k[1]).get("model") for k in _samples(metrics) if k[0].startswith("omni_dp_e2e")}
    assert models == {"model-0", "model-1", "model-2", "_other"}


# ---------------------------------------------------------------------------- access log

def test_access_line_fields():
    obs = Observer(DataPlaneMetrics())
    t = RequestTracker(Reports())
    t.req = _req()
    t.trace = trace_headers(TP, "a=b")
    _run(t, flow="sequential", pd=True)
    line = orjson.loads(obs.access_line(t, "/v1/completions", 200))
    assert line["request_id"] == t.req.request_id and line["client_request_id"] == "cli-1"
    assert ((line["model"], line["flow"], line["prefill_worker"], line["decode_worker"])
            == ("m", "sequential", "p0", "d0"))
    assert (line["status"], line["outcome"], line["completion_tokens"], line["retries"]) == (200, "finished", 10, 0)
    assert line["traceparent"] == TP and line["queued_ms"] == 2.5 and "error" not in line
    stages = line["stages_ms"]
    order = ["tokenized", "matched", "placed", "dispatched", "prefill_answered", "decode_dispatched",
             "first_token", "last_token", "done"]
    assert [stages[k] for k in order] == sorted(stages[k] for k in order)
    assert stages["done"] == line["e2e_ms"] and line["ttft_ms"] == stages["first_token"]
    assert line["tpot_ms"] == pytest.approx((stages["last_token"] - stages["first_token"]) / 9, abs=0.002)


def test_access_line_of_a_failure_and_of_a_rejection():
    obs = Observer(DataPlaneMetrics())
    t = RequestTracker(Reports())
    t.req = _req()
    t.attach(t.req, pb.Placement(), "aggregated")
    t.leg(LEG_WHOLE, "w0")
    t.failed("w0", "worker w0 returned 500: boom", 500)
    line = orjson.loads(obs.access_line(t, "/v1/completions", 502))
    assert (line["outcome"], line["error"], line["upstream_status"]) == ("failed", "worker w0 returned 500: boom", 500)
    assert line["stages_ms"]["first_token"] is None and line["ttft_ms"] is None
    early = RequestTracker(Reports())
    obs.complete(early, "/v1/completions", 400, client_id="c-9")   # rejected before parsing
    line = orjson.loads(obs.access_line(early, "/v1/completions", 400, "c-9"))
    assert line["request_id"] is None and line["client_request_id"] == "c-9" and line["outcome"] == "rejected"


def test_access_log_goes_to_its_logger_at_info(caplog):
    obs = Observer(DataPlaneMetrics())
    t = RequestTracker(Reports())
    t.req = _req()
    _run(t)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        obs.complete(t, "/v1/completions", 200)
    [record] = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert record.levelno == logging.INFO
    assert orjson.loads(record.getMessage())["request_id"] == t.req.request_id
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        Observer(DataPlaneMetrics(), access_log_on=False).complete(t, "/v1/completions", 200)
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]


def test_requests_ended_in_one_turn_are_each_recorded_and_a_failure_stays_their_own(caplog):
    """``complete_all`` records a loop turn's ended requests together: each is counted and
    logged as ``complete`` would, and one whose bookkeeping fails costs only its own."""
    metrics = DataPlaneMetrics()
    obs = Observer(metrics)
    good = RequestTracker(Reports())
    good.req = _req()
    _run(good)
    bad = RequestTracker(Reports())
    bad.placed = True                 # placed without a request: its histograms cannot be found
    with caplog.at_level(logging.INFO):
        obs.complete_all([(bad, "/v1/completions", 200, "", None, "rid-bad"),
                          (good, "/v1/completions", 200, "", None, good.req.request_id)])
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [line["request_id"] for line in lines] == [good.req.request_id]
    assert any("recording a request's metrics" in r.getMessage() for r in caplog.records)
    assert metrics._classes["/v1/completions"][2].value == 2          # both counted
    assert metrics.series("m", "aggregated").e2e.counts != [0] * (len(metrics.e2e.buckets) + 1)


def test_access_lines_of_one_turn_go_in_one_write_each_with_its_own_request_id():
    """Several lines written together (one time stamp, one write) carry their own request ids,
    byte for byte what logging writes for each with that id current."""
    code = """
import asyncio, logging
from dataplane import observe
from dataplane.observe import ACCESS_LOGGER, configure_logging, current_request_id
configure_logging("WARNING", "json")
logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
handler = observe.direct_access_handler()
assert handler is not None
import time
time.time = lambda: 1_700_000_000.5
writes = []
write_text = handler.write_text
handler.write_text = lambda text: (writes.append(text), write_text(text))
async def main():
    observe.write_access_lines(handler, [('{"n":1}', "rid-1"), ('{"n":2}', "rid-2")])
    assert len(writes) == 1
    for line, rid in (('{"n":1}', "rid-1"), ('{"n":2}', "rid-2")):
        current_request_id.set(rid)
        record = logging.getLogger(ACCESS_LOGGER).makeRecord(ACCESS_LOGGER, logging.INFO, "f", 0, line, None, None)
        record.json_message = True
        logging.getLogger(ACCESS_LOGGER).handle(record)
    handler.flush_now()
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[:2] == lines[2:] and len(lines) == 4
    assert [orjson.loads(x)["request_id"] for x in lines[:2]] == ["rid-1", "rid-2"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_access_lines_written_directly_match_what_logging_writes(fmt, tmp_path):
    """In the data plane's own logging setup an access line skips logging's machinery: the
    bytes must be the ones logging would write (same time, same request id). With another
    handler anywhere on the way (a caplog), logging is used."""
    code = f"""
import asyncio, logging, os, sys, time
from dataplane import observe
from dataplane.metrics import DataPlaneMetrics
from dataplane.observe import ACCESS_LOGGER, Observer, configure_logging, current_request_id
configure_logging("WARNING", {fmt!r})
logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
handler = observe.direct_access_handler()
assert handler is not None, "the data plane's own setup writes directly"
time.time = lambda: 1_700_000_000.1234
async def main():
    current_request_id.set("rid-7")
    line = '{{"request_id":"rid-7","status":200}}'
    observe.write_access_line(handler, line)
    record = logging.getLogger(ACCESS_LOGGER).makeRecord(ACCESS_LOGGER, logging.INFO, "f", 0, line, None, None)
    record.json_message = True
    logging.getLogger(ACCESS_LOGGER).handle(record)
    extra = logging.StreamHandler(open(os.devnull, "w"))
    logging.getLogger("omni_proxy").addHandler(extra)
    assert observe.direct_access_handler() is None, "a handler on the way: through logging"
    logging.getLogger("omni_proxy").removeHandler(extra)
    logging.getLogger().addHandler(extra)
    assert observe.direct_access_handler() is None
    logging.getLogger().removeHandler(extra)
    assert observe.direct_access_handler() is handler
    handler.flush_now()
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    direct, logged = out.stderr.splitlines()
    assert direct == logged
    if fmt == "json":
        assert orjson.loads(direct)["request_id"] == "rid-7" and orjson.loads(direct)["access"]["status"] == 200
    else:
        assert direct.endswith(" INFO omni_proxy.access: {\"request_id\":\"rid-7\",\"status\":200}")


def test_request_id_filter_prefixes_lines_of_the_request_and_its_tasks():
    f = RequestIdFilter()

    def record(name: str = "dataplane.x", msg: str = "worker %s returned %d") -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, ("w0", 500) if "%" in msg else None, None)

    r = record()
    f.filter(r)
    assert r.getMessage() == "worker w0 returned 500" and r.request_id == ""

    async def request() -> list[str]:
        current_request_id.set("abc-123")
        child = asyncio.ensure_future(asyncio.sleep(0, result=None))
        await child
        inner = await asyncio.ensure_future(_in_task())
        r = record()
        f.filter(r)
        f.filter(r)                      # a second handler: prefixed once
        access = record(ACCESS_LOGGER, "{}")
        f.filter(access)
        return [r.getMessage(), inner, access.getMessage()]

    async def _in_task() -> str:
        r = record()
        f.filter(r)
        return r.getMessage()

    msg, inner, access = asyncio.run(request())
    assert msg == inner == "[abc-123] worker w0 returned 500"
    assert access == "{}"


def test_cached_time_formatter_matches_the_default():
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    cached = CachedTimeFormatter()
    for created in (1_700_000_000.123, 1_700_000_000.987, 1_700_000_001.001):
        r = logging.LogRecord("n", logging.INFO, __file__, 1, "m", None, None)
        r.created, r.msecs = created, (created - int(created)) * 1000
        assert cached.format(r) == plain.format(r)


# ---------------------------------------------------------------------------- trace context

@pytest.mark.parametrize("value,ok", [
    (TP, True),
    (TP.upper(), True),                                             # normalised to lower case
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", True),   # future versions may extend
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", False),  # version 00 may not
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),
    ("garbage", False),
    ("", False),
])
def test_traceparent_validation(value, ok):
    headers = trace_headers(value, "rojo=00f067aa0ba902b7")
    if ok:
        assert headers == {"traceparent": value.lower(), "tracestate": "rojo=00f067aa0ba902b7"}
    else:
        assert headers is None


def test_tracestate_is_dropped_when_unusable():
    assert trace_headers(TP, None) == {"traceparent": TP}
    assert trace_headers(TP, "x" * 600) == {"traceparent": TP}
    assert trace_headers(TP, "a=b\x00") == {"traceparent": TP}


# ---------------------------------------------------------------------------- OpenTelemetry

def test_opentelemetry_is_not_imported_when_off():
    code = ("import sys\n"
            "from dataplane.app import DataPlane, DataPlaneConfig\n"
            "dp = DataPlane(DataPlaneConfig())\n"
            "dp.build_app()\n"
            "assert dp.tracing is None\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_bad_otel_endpoint_is_one_line():
    from dataplane.app import DataPlane, DataPlaneConfig
    from omni_runtime import StartupError

    with pytest.raises(StartupError, match="--otel-endpoint"):
        DataPlane(DataPlaneConfig(otel_endpoint="collector:4318"))


def test_spans_for_a_request_and_its_legs():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from dataplane.otel import Tracing, traces_url

    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
    exporter = InMemorySpanExporter()
    tracing = Tracing("http://unused:4318", exporter=exporter)
    t = RequestTracker(Reports())
    t.trace = trace_headers(TP, "rojo=1")
    t.tracing = tracing
    tracing.start_request(t, "/v1/completions")
    t.req = _req()
    t.tokenized = t.matched = time.perf_counter()
    t.attach(t.req, pb.Placement(), "sequential")
    p_headers = t.leg(LEG_PREFILL, "p0")
    t.leg_failed("p0", "p0 down", 500)
    p2_headers = t.leg(LEG_PREFILL, "p1")
    t.prefill_answer()
    d_headers = t.leg(LEG_DECODE, "d0")
    t.first_token()
    t.stream_ended()
    t.finished(3)
    Observer(DataPlaneMetrics(), access_log_on=False, tracing=tracing).complete(t, "/v1/completions", 200)
    tracing.shutdown()
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.kind == SpanKind.SERVER)
    legs = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert format(root.context.trace_id, "032x") == TP.split("-")[1]
    assert format(root.parent.span_id, "016x") == TP.split("-")[2]
    assert len(legs) == 3 and all(s.parent.span_id == root.context.span_id for s in legs)
    assert [s.attributes["omni.worker"] for s in legs] == ["p0", "p1", "d0"]
    assert legs[0].status.status_code == StatusCode.ERROR
    for headers, leg in zip((p_headers, p2_headers, d_headers), legs, strict=False):
        assert headers["traceparent"].split("-")[2] == format(leg.context.span_id, "016x")
        assert headers["tracestate"] == "rojo=1"
    assert root.attributes["omni.flow"] == "sequential" and root.attributes["omni.prefill_worker"] == "p1"
    assert [e.name for e in root.events][:4] == ["tokenized", "matched", "placed", "dispatched"]


def test_a_retried_whole_leg_counts_a_retry():
    t = RequestTracker(Reports())
    t.req = _req()
    t.attach(t.req, pb.Placement(), "aggregated")
    t.leg(LEG_WHOLE, "w0")
    first = t.dispatched
    t.leg_failed("w0", "boom", 503)
    t.leg(LEG_WHOLE, "w1")
    assert t.retries == 1 and t.dispatched == first and t.decode_worker == "w1" and t.decode_dispatched >= first


def test_a_recompute_keeps_the_first_attempts_stamps():
    t = RequestTracker(Reports())
    t.req = _req()
    _run(t, flow="sequential", pd=True)
    t.ended = False                                  # the relay saw "recomputed", not an end
    before = (t.dispatched, t.prefill_answered, t.decode_dispatched, t.first_token_at)
    t.continue_as(_req(), 5)
    t.leg(LEG_PREFILL, "p1")
    t.prefill_answer()
    t.leg(LEG_DECODE, "d1")
    t.finished(7)
    assert (t.dispatched, t.prefill_answered, t.decode_dispatched, t.first_token_at) == before
    assert (t.retries, t.recomputes, t.prefill_worker, t.decode_worker) == (0, 1, "p1", "d1")
    line = orjson.loads(Observer(DataPlaneMetrics()).access_line(t, "/v1/completions", 200))
    assert line["recomputes"] == 1
