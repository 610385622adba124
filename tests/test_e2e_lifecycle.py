"""Request lifecycle and observability end to end, on real processes.

Simulators, a control plane and a data plane on loopback. For requests through each flow:
the stage timestamps in the data plane's access-log line are ordered and add up to the
request's end-to-end time (which matches what the client measured), the data plane's
/metrics histograms count the request, W3C ``traceparent``/``tracestate`` reach every
engine leg the data plane sends, engine failures and retries are logged with the request
id, and with ``--otel-endpoint`` the spans reach an OTLP/HTTP receiver and tie up with the
``traceparent`` the engine received.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Cluster, start_cluster, wait_until

MODEL = "sim-model"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
SLOW_DECODE = ["--decode-ms-per-step", "8"]     # a measurable decode: 8 ms a token
ORDER = ["tokenized", "matched", "placed", "dispatched", "decode_dispatched", "first_token", "last_token", "done"]
ACCESS_MARK = "omni_proxy.access: "


# ---------------------------------------------------------------------------- helpers

def access_lines(cluster: Cluster) -> list[dict]:
    lines = []
    for line in cluster.dp.log_path.read_text(errors="replace").splitlines():
        at = line.find(ACCESS_MARK)
        if at >= 0:
            lines.append(orjson.loads(line[at + len(ACCESS_MARK):]))
    return lines


async def access_line(cluster: Cluster, client_id: str) -> dict:
    """The access-log line of the request the client labelled ``client_id`` (written once it ends)."""
    found: list[dict] = []

    async def logged() -> bool:
        found[:] = [x for x in access_lines(cluster) if x["client_request_id"] == client_id]
        return bool(found)

    await wait_until(logged, what=f"the access-log line of {client_id}")
    assert len(found) == 1, found
    return found[0]


def log_lines_with(cluster: Cluster, text: str) -> list[str]:
    return [line for line in cluster.dp.log_path.read_text(errors="replace").splitlines() if text in line]


async def scrape(http, url: str) -> dict[tuple[str, tuple], float]:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def check_stages(line: dict, *, prefill_answered: bool) -> list[float]:
    stages = line["stages_ms"]
    order = list(ORDER)
    if prefill_answered:
        order.insert(order.index("decode_dispatched"), "prefill_answered")
    else:
        assert stages["prefill_answered"] is None
    values = [stages[k] for k in order]
    assert None not in values, stages
    assert values == sorted(values), f"stages out of order: {stages}"
    # The stages partition the request: their durations add up to the end-to-end time.
    durations = [values[0]] + [b - a for a, b in zip(values, values[1:], strict=False)]
    assert all(d >= 0 for d in durations)
    assert sum(durations) == pytest.approx(line["e2e_ms"], abs=0.01)
    return values


async def stream(http, url: str, client_id: str, *, max_tokens: int = 12, headers: dict | None = None,
                 path: str = "/v1/completions") -> tuple[float, float, bytes]:
    """Stream one request; (client TTFT ms, client total ms, body)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = "tell me about the lifecycle of a request " * 4
    else:
        body["messages"] = [{"role": "user", "content": "tell me about the lifecycle of a request"}]
    t0 = time.perf_counter()
    first = 0.0
    data = b""
    async with http.post(url + path, json=body, headers={"X-Request-Id": client_id, **(headers or {})}) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            if not first:
                first = time.perf_counter()
            data += chunk
    total = time.perf_counter()
    return (first - t0) * 1000, (total - t0) * 1000, data


def check_against_client(line: dict, client_ttft_ms: float, client_total_ms: float) -> None:
    """What the data plane measured sits inside what the client measured, give or take the HTTP hops."""
    slack = max(50.0, 0.25 * client_total_ms)
    assert line["e2e_ms"] <= client_total_ms + 1.0
    assert line["e2e_ms"] >= client_total_ms - slack, (line["e2e_ms"], client_total_ms)
    assert line["ttft_ms"] <= client_ttft_ms + 1.0
    assert line["ttft_ms"] >= client_ttft_ms - max(50.0, 0.5 * client_ttft_ms), (line["ttft_ms"], client_ttft_ms)


def trace_of(entry: dict) -> tuple[str, str]:
    h = entry.get("headers") or {}
    return h.get("traceparent", ""), h.get("tracestate", "")


def engine_entry(entries: list[dict], client_id: str) -> dict:
    mine = [e for e in entries if e["request_id"].startswith(client_id + "-")]
    assert len(mine) == 1, [e["request_id"] for e in entries]
    return mine[0]


def fresh_cluster(sims: dict[str, str], **kw) -> Cluster:
    return start_cluster(sims, sim_args={name: SLOW_DECODE for name in sims}, **kw)


# ---------------------------------------------------------------------------- aggregated

@pytest.fixture(scope="module")
def agg_cluster():
    c = fresh_cluster({"agg": "both"})
    yield c
    c.group.close()


@pytest.fixture
async def agg(agg_cluster: Cluster):
    await agg_cluster.fresh()
    yield agg_cluster
    await wait_until(agg_cluster.all_idle, what="idle after the test (load leaked)")


async def test_streamed_request_stages_add_up_and_are_counted(agg: Cluster, http):
    before = await scrape(http, agg.url)
    ttft, total, data = await stream(http, agg.url, "lc-agg-1", max_tokens=12,
                                     headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    assert data.endswith(b"data: [DONE]\n\n")
    line = await access_line(agg, "lc-agg-1")

    # The access-log line: ids, where it ran, how it ended, tokens, stage times.
    assert line["request_id"].startswith("lc-agg-1-") and line["model"] == MODEL
    assert line["route"] == "/v1/completions" and line["stream"] is True
    assert line["flow"] == "aggregated" and line["decode_worker"] == "agg" and line["prefill_worker"] is None
    assert line["status"] == 200 and line["outcome"] == "finished" and "error" not in line
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 12 and line["retries"] == 0
    assert line["queued_ms"] >= 0 and line["traceparent"] == TRACEPARENT
    check_stages(line, prefill_answered=False)
    check_against_client(line, ttft, total)
    # 12 tokens at 8 ms a decode step: the mean inter-token time is about a step.
    assert 2.0 <= line["tpot_ms"] <= 200.0
    assert line["ttft_ms"] == line["stages_ms"]["first_token"]

    # /metrics counts it, by model and flow.
    after = await scrape(http, agg.url)
    mf = {"model": MODEL, "model_name": MODEL, "flow": "aggregated"}
    for name in ("omni_dp_time_to_first_token_seconds_count", "omni_dp_time_per_output_token_seconds_count",
                 "omni_dp_e2e_request_latency_seconds_count", "omni_dp_placement_seconds_count",
                 "omni_dp_queue_seconds_count", "omni_dp_prefill_seconds_count", "omni_dp_decode_seconds_count"):
        assert value(after, name, **mf) - value(before, name, **mf) == 1, name
    e2e_sum = value(after, "omni_dp_e2e_request_latency_seconds_sum", **mf) - \
        value(before, "omni_dp_e2e_request_latency_seconds_sum", **mf)
    assert e2e_sum * 1000 == pytest.approx(line["e2e_ms"], abs=0.01)
    assert value(after, "omni_dp_generation_tokens_total", **mf) - \
        value(before, "omni_dp_generation_tokens_total", **mf) == 12
    assert value(after, "omni_dp_prompt_tokens_total", **mf) - \
        value(before, "omni_dp_prompt_tokens_total", **mf) == line["prompt_tokens"]
    assert value(after, "omni_dp_requests_total", route="/v1/completions", code_class="2xx") - \
        value(before, "omni_dp_requests_total", route="/v1/completions", code_class="2xx") == 1
    assert value(after, "process_cpu_seconds_total") > 0
    assert value(after, "process_resident_memory_bytes") > 0
    # No series is labelled by request.
    assert not any("lc-agg-1" in str(labels) for _, labels in after)

    # The trace context reached the engine unchanged.
    entry = engine_entry(await agg.sim_requests("agg"), "lc-agg-1")
    assert trace_of(entry) == (TRACEPARENT, TRACESTATE)


async def test_usage_gives_completion_and_cached_tokens(agg: Cluster, http):
    prompt = "the same long prefix for the prefix cache to hit " * 8
    before = await scrape(http, agg.url)
    for i in range(2):
        async with http.post(agg.url + "/v1/completions", headers={"X-Request-Id": f"lc-usage-{i}"},
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": True,
                                   "stream_options": {"include_usage": True}}) as r:
            assert r.status == 200
            await r.read()
    line = await access_line(agg, "lc-usage-1")
    # The usage chunk's own count, not the number of SSE events (which includes the usage chunk).
    assert line["completion_tokens"] == 5
    assert line["cached_tokens"] and line["cached_tokens"] > 0
    after = await scrape(http, agg.url)
    mf = {"model": MODEL, "model_name": MODEL, "flow": "aggregated"}
    assert value(after, "omni_dp_cached_tokens_total", **mf) - value(before, "omni_dp_cached_tokens_total", **mf) \
        >= line["cached_tokens"]


async def test_non_streamed_request_has_ordered_stages(agg: Cluster, http):
    t0 = time.perf_counter()
    async with http.post(agg.url + "/v1/chat/completions", headers={"X-Request-Id": "lc-agg-json"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}) as r:
        assert r.status == 200
        usage = (await r.json())["usage"]
    total = (time.perf_counter() - t0) * 1000
    line = await access_line(agg, "lc-agg-json")
    assert line["route"] == "/v1/chat/completions" and line["stream"] is False
    assert line["completion_tokens"] == usage["completion_tokens"] == 6
    assert line["ttft_ms"] is None and line["tpot_ms"] is None      # no tokens were streamed
    check_stages(line, prefill_answered=False)
    assert total - max(50.0, 0.25 * total) <= line["e2e_ms"] <= total + 1.0


async def test_rejected_request_is_logged_and_counted_by_class(agg: Cluster, http):
    before = await scrape(http, agg.url)
    async with http.post(agg.url + "/v1/completions", headers={"X-Request-Id": "lc-bad"},
                         json={"model": "no-such-model", "prompt": "x"}) as r:
        assert r.status == 404
    line = await access_line(agg, "lc-bad")
    assert line["status"] == 404 and line["outcome"] == "rejected" and line["flow"] is None
    assert line["stages_ms"]["placed"] is None and line["stages_ms"]["done"] is not None
    after = await scrape(http, agg.url)
    assert value(after, "omni_dp_requests_total", route="/v1/completions", code_class="4xx") - \
        value(before, "omni_dp_requests_total", route="/v1/completions", code_class="4xx") == 1
    # An unplaced request's model is whatever the client typed: never a label.
    assert not any("no-such-model" in str(labels) for _, labels in after)


async def test_engine_5xx_is_logged_with_the_request_id(agg: Cluster, http):
    await agg.sim_post("agg", "/sim/faults", {"status": 500, "message": "engine on fire", "count": 1})
    async with http.post(agg.url + "/v1/completions", headers={"X-Request-Id": "lc-5xx"},
                         json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 502
    line = await access_line(agg, "lc-5xx")
    assert line["status"] == 502 and line["outcome"] == "failed"
    assert "engine on fire" in line["error"] and line["upstream_status"] == 500
    warnings = log_lines_with(agg, "engine on fire")
    assert any(" WARNING " in w and f"[{line['request_id']}]" in w for w in warnings), warnings


async def test_engines_get_no_trace_context_the_client_did_not_send(agg: Cluster, http):
    await stream(http, agg.url, "lc-none", max_tokens=2)
    await stream(http, agg.url, "lc-invalid", max_tokens=2,
                 headers={"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"})
    entries = await agg.sim_requests("agg")
    for cid in ("lc-none", "lc-invalid"):
        assert trace_of(engine_entry(entries, cid)) == ("", "")
        assert "traceparent" not in await access_line(agg, cid)


# ---------------------------------------------------------------------------- sequential PD

@pytest.fixture(scope="module")
def seq_cluster():
    c = fresh_cluster({"p-a": "prefill", "p-b": "prefill", "d": "decode"}, policy="round_robin")
    yield c
    c.group.close()


@pytest.fixture
async def seq(seq_cluster: Cluster):
    await seq_cluster.fresh()
    yield seq_cluster
    await wait_until(seq_cluster.all_idle, what="idle after the test (load leaked)")


async def test_sequential_stages_and_trace_on_both_legs(seq: Cluster, http):
    before = await scrape(http, seq.url)
    ttft, total, _ = await stream(http, seq.url, "lc-seq", max_tokens=10, path="/v1/chat/completions",
                                  headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    line = await access_line(seq, "lc-seq")
    assert line["flow"] == "sequential" and line["prefill_worker"] in ("p-a", "p-b") and line["decode_worker"] == "d"
    assert line["completion_tokens"] == 10 and line["outcome"] == "finished"
    check_stages(line, prefill_answered=True)
    check_against_client(line, ttft, total)
    p_entry = engine_entry(await seq.sim_requests(line["prefill_worker"]), "lc-seq")
    d_entry = engine_entry(await seq.sim_requests("d"), "lc-seq")
    assert trace_of(p_entry) == trace_of(d_entry) == (TRACEPARENT, TRACESTATE)
    after = await scrape(http, seq.url)
    mf = {"model": MODEL, "model_name": MODEL, "flow": "sequential"}
    for name in ("omni_dp_prefill_seconds_count", "omni_dp_decode_seconds_count",
                 "omni_dp_time_to_first_token_seconds_count", "omni_dp_e2e_request_latency_seconds_count"):
        assert value(after, name, **mf) - value(before, name, **mf) == 1, name


async def test_prefill_retry_and_final_failure_are_logged(seq: Cluster, http):
    await seq.sim_post("p-a", "/sim/faults", {"status": 500, "message": "p-a is sick", "count": -1})
    # Round robin: one of two requests meets p-a first and is retried on p-b.
    for i in range(2):
        async with http.post(seq.url + "/v1/completions", headers={"X-Request-Id": f"lc-retry-{i}"},
                             json={"model": MODEL, "prompt": "retry me", "max_tokens": 2}) as r:
            assert r.status == 200
    lines = [await access_line(seq, f"lc-retry-{i}") for i in range(2)]
    retried = [x for x in lines if x["retries"] == 1]
    assert len(retried) == 1 and retried[0]["prefill_worker"] == "p-b" and retried[0]["status"] == 200
    rid = retried[0]["request_id"]
    logged = log_lines_with(seq, f"[{rid}]")
    assert any(" WARNING " in x and "returned 500" in x for x in logged), logged
    assert any(" WARNING " in x and "trying another prefill worker" in x for x in logged), logged

    await seq.sim_post("p-b", "/sim/faults", {"status": 500, "message": "p-b is sick too", "count": -1})
    async with http.post(seq.url + "/v1/completions", headers={"X-Request-Id": "lc-retry-fail"},
                         json={"model": MODEL, "prompt": "retry me", "max_tokens": 2}) as r:
        assert r.status == 502
    line = await access_line(seq, "lc-retry-fail")
    assert line["outcome"] == "failed" and line["retries"] == 1 and line["upstream_status"] == 500
    assert "sick" in line["error"] and line["stages_ms"]["dispatched"] is not None
    assert any(" WARNING " in x and "request failed" in x for x in log_lines_with(seq, f"[{line['request_id']}]"))


# ---------------------------------------------------------------------------- parallel and layerwise PD

@pytest.fixture(scope="module")
def parallel_cluster():
    c = fresh_cluster({"prefill-0": "prefill", "decode-0": "decode"},
                      cp_args=["--pd-flow", "parallel", "--parallel-protocol", "sglang"])
    yield c
    c.group.close()


@pytest.fixture(scope="module")
def layerwise_cluster():
    c = fresh_cluster({"prefill-0": "prefill", "decode-0": "decode"}, cp_args=["--pd-flow", "layerwise"])
    yield c
    c.group.close()


async def test_parallel_trace_on_both_legs(parallel_cluster: Cluster, http):
    c = parallel_cluster
    await c.fresh()
    ttft, total, _ = await stream(http, c.url, "lc-par", max_tokens=6,
                                  headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    line = await access_line(c, "lc-par")
    assert line["flow"] == "parallel" and (line["prefill_worker"], line["decode_worker"]) == ("prefill-0", "decode-0")
    check_stages(line, prefill_answered=False)
    check_against_client(line, ttft, total)
    for name in ("prefill-0", "decode-0"):
        assert trace_of(engine_entry(await c.sim_requests(name), "lc-par")) == (TRACEPARENT, TRACESTATE)
    await wait_until(c.all_idle, what="idle after the test")


async def test_layerwise_trace_on_both_legs(layerwise_cluster: Cluster, http):
    """The data plane sends only D; P's leg is sent by the control plane's metaserver,
    which gets the trace context with the placement request."""
    c = layerwise_cluster
    await c.fresh()
    ttft, total, _ = await stream(http, c.url, "lc-lw", max_tokens=6,
                                  headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    line = await access_line(c, "lc-lw")
    assert line["flow"] == "layerwise" and line["decode_worker"] == "decode-0"
    check_stages(line, prefill_answered=False)
    check_against_client(line, ttft, total)
    assert trace_of(engine_entry(await c.sim_requests("decode-0"), "lc-lw")) == (TRACEPARENT, TRACESTATE)
    assert trace_of(engine_entry(await c.sim_requests("prefill-0"), "lc-lw")) == (TRACEPARENT, TRACESTATE)
    await wait_until(c.all_idle, what="idle after the test")


# ---------------------------------------------------------------------------- OpenTelemetry

class _Collector:
    """An OTLP/HTTP receiver on 127.0.0.1: keeps every span POSTed to /v1/traces."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)
        self.spans: list = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                msg = ExportTraceServiceRequest.FromString(data)
                with collector.lock:
                    for rs in msg.resource_spans:
                        for ss in rs.scope_spans:
                            collector.spans.extend(ss.spans)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def of_trace(self, trace_id: str) -> list:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _start_exporting_fast(roles: dict, **kw):
    """start_cluster with the processes' span exporters flushing every 100 ms (their
    environment is read at start; this process's is restored at once)."""
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        return start_cluster(roles, **kw)
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


@pytest.fixture(scope="module")
def otel():
    pytest.importorskip("opentelemetry.sdk")
    collector = _Collector()
    c = _start_exporting_fast({"agg": "both"}, dp_args=["--otel-endpoint", collector.url])
    try:
        yield c, collector
    finally:
        c.group.close()
        collector.close()


_TP = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")   # sampled: flags & 1


async def _spans(collector: _Collector, trace_id: str, n: int) -> list:
    async def arrived() -> bool:
        return len(collector.of_trace(trace_id)) >= n
    await wait_until(arrived, what=f"{n} spans of trace {trace_id}")
    return collector.of_trace(trace_id)


async def test_otel_spans_start_a_trace_the_engine_joins(otel, http):
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    c, collector = otel
    await c.fresh()
    await stream(http, c.url, "lc-otel", max_tokens=4)
    line = await access_line(c, "lc-otel")
    sent, _ = trace_of(engine_entry(await c.sim_requests("agg"), "lc-otel"))
    m = _TP.fullmatch(sent)
    assert m and int(m.group(3), 16) & 1, f"the engine got no generated, sampled traceparent: {sent!r}"
    trace_id, leg_span_id, _ = m.groups()
    assert line["traceparent"].split("-")[1] == trace_id
    spans = await _spans(collector, trace_id, 2)
    server = [s for s in spans if s.kind == Span.SPAN_KIND_SERVER]
    legs = [s for s in spans if s.kind == Span.SPAN_KIND_CLIENT]
    assert len(server) == 1 and len(legs) == 1
    root, leg = server[0], legs[0]
    assert root.parent_span_id == b"" and root.name == "POST /v1/completions"
    assert leg.parent_span_id == root.span_id and leg.span_id.hex() == leg_span_id
    events = [e.name for e in root.events]
    assert events[:3] == ["tokenized", "matched", "placed"] and "first_token" in events
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["omni.request_id"].string_value == line["request_id"]
    assert attrs["http.response.status_code"].int_value == 200
    assert (root.end_time_unix_nano - root.start_time_unix_nano) / 1e6 == pytest.approx(line["e2e_ms"], abs=1.0)


async def test_otel_spans_continue_the_clients_trace(otel, http):
    c, collector = otel
    await c.fresh()
    await stream(http, c.url, "lc-otel-2", max_tokens=3,
                 headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    sent, state = trace_of(engine_entry(await c.sim_requests("agg"), "lc-otel-2"))
    m = _TP.fullmatch(sent)
    assert m and m.group(1) == TRACE_ID and m.group(2) != PARENT_ID    # the leg span is the engine's parent
    assert state == TRACESTATE
    spans = await _spans(collector, TRACE_ID, 2)
    root = next(s for s in spans if s.parent_span_id.hex() == PARENT_ID)
    assert any(s.parent_span_id == root.span_id and s.span_id.hex() == m.group(2) for s in spans)


HELD_PROFILE = """
[profiles.held]
scorers = [{name = "least_load"}]
queue = {name = "omni", hold_s = 0.0, max_wait_s = 30.0}
"""


@pytest.fixture(scope="module")
def otel_cp(tmp_path_factory):
    """Spans from both planes to one collector; a queue that holds a request while an
    engine has prefill work pending, and a slow engine, so requests wait in it."""
    pytest.importorskip("opentelemetry.sdk")
    collector = _Collector()
    config = tmp_path_factory.mktemp("cp") / "cp.toml"
    config.write_text(HELD_PROFILE)
    c = _start_exporting_fast({"agg": "both"}, policy="held", dp_args=["--otel-endpoint", collector.url],
                              cp_args=["--config", str(config), "--otel-endpoint", collector.url],
                              sim_args={"agg": ["--prefill-ms-per-token", "2.0"]})
    try:
        yield c, collector
    finally:
        c.group.close()
        collector.close()


async def test_control_plane_spans_for_placement_and_queueing_join_the_data_planes_trace(otel_cp, http):
    c, collector = otel_cp
    await c.fresh()

    async def one(i: int) -> None:
        body = {"model": MODEL, "prompt": [i + 1] + [7] * 199, "max_tokens": 2, "stream": True}
        async with http.post(c.url + "/v1/completions", json=body, headers={"X-Request-Id": f"cp-span-{i}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    await asyncio.gather(*(one(i) for i in range(3)))   # one prefills, the others are held
    queued = 0
    for i in range(3):
        line = await access_line(c, f"cp-span-{i}")
        trace_id = line["traceparent"].split("-")[1]
        spans = await _spans(collector, trace_id, 3 + (line["queued_ms"] > 0))
        server = next(s for s in spans if s.name == "POST /v1/completions")
        placement = next(s for s in spans if s.name == "placement")
        assert placement.parent_span_id == server.span_id, "the placement span hangs under the request's"
        attrs = {a.key: a.value for a in placement.attributes}
        assert attrs["omni.request_id"].string_value and attrs["omni.decode_worker"].string_value == "agg"
        waits = [s for s in spans if s.name == "queued"]
        if line["queued_ms"] > 0:
            queued += 1
            assert len(waits) == 1 and waits[0].parent_span_id == placement.span_id
            held_ms = (waits[0].end_time_unix_nano - waits[0].start_time_unix_nano) / 1e6
            assert held_ms == pytest.approx(line["queued_ms"], abs=5.0)
        else:
            assert not waits
    assert queued >= 1, "no request waited in the control plane's queue"
