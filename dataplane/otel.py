"""OpenTelemetry spans for the data plane (``--otel-endpoint``): one per request, one per leg.

Imported only when spans are on, so a data plane without ``--otel-endpoint`` never loads
the SDK and creates no span objects. Needs the ``otel`` extra
(``pip install 'omni-proxy[otel]'``: opentelemetry-sdk and the OTLP/HTTP exporter).

The request span (SERVER) continues the client's ``traceparent`` when it sent a valid
one, else starts a new trace. Each engine leg gets a CLIENT child span, and the leg's
``traceparent`` (the leg span as parent, the client's ``tracestate`` kept) goes to the
engine, so engine-side spans hang under the leg that called them. The stages
(tokenized, placed, first token, ...) are events on the request span, stamped at the
end of the request from the tracker's timestamps. Spans leave in batches from the SDK's
background thread (``OTEL_BSP_*`` settings apply), never on the event loop.
"""

from __future__ import annotations

import time
from typing import cast

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from dataplane.tracking import RequestTracker

_STAGES = ("tokenized", "matched", "placed_at", "dispatched", "prefill_answered", "decode_dispatched",
           "first_token_at", "last_token")
_STAGE_NAMES = {"placed_at": "placed", "first_token_at": "first_token"}


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base address (``http://collector:4318``) or the full traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracing:
    def __init__(self, endpoint: str, *, service_name: str = "omni-proxy-dataplane", node_id: str = "",
                 exporter: SpanExporter | None = None) -> None:
        attrs = {"service.name": service_name}
        if node_id:
            attrs["service.instance.id"] = node_id
        self.provider = TracerProvider(resource=Resource.create(attrs))
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter if exporter is not None else OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("omni_proxy.dataplane")
        self.propagator = TraceContextTextMapPropagator()

    def start_request(self, t: RequestTracker, route: str) -> None:
        """Open the request's span (at receipt); ``t.trace`` is the client's valid context, if any."""
        parent = self.propagator.extract(t.trace) if t.trace is not None else None
        span = self.tracer.start_span(f"POST {route}", context=parent, kind=SpanKind.SERVER,
                                      start_time=time.time_ns())
        t.span = span
        # What the access log shows: this request's own place in the trace.
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        t.trace = carrier

    def leg(self, t: RequestTracker, kind: str, worker_id: str) -> dict[str, str] | None:
        if t.span is None:
            return t.trace
        span = self.tracer.start_span(f"{kind} leg", context=set_span_in_context(t.span), kind=SpanKind.CLIENT,
                                      attributes={"omni.leg": kind, "omni.worker": worker_id})
        if t.legs is None:
            t.legs = {}
        previous = t.legs.pop(kind, None)
        if previous is not None:
            previous.end()
        t.legs[kind] = span
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        return carrier

    def end_leg(self, t: RequestTracker, kind: str, error: str) -> None:
        span = t.legs.pop(kind, None) if t.legs else None
        if span is not None:
            if error:
                span.set_status(Status(StatusCode.ERROR, error[:200]))
            span.end()

    def end_request(self, t: RequestTracker, code: int) -> None:
        span = t.span
        assert span is not None, "end_request without start_request"
        t.span = None
        start_ns = cast(ReadableSpan, span).start_time or 0   # the SDK's span (this provider's)
        ns = lambda at: start_ns + int((at - t.received) * 1e9)  # noqa: E731
        failed = t.outcome == "failed" or code >= 500
        legs = t.legs or {}
        for kind in list(legs):
            leg = legs.pop(kind)
            if failed:
                leg.set_status(Status(StatusCode.ERROR, t.error[:200] or f"HTTP {code}"))
            leg.end(end_time=ns(t.done))
        for attr in _STAGES:
            at = getattr(t, attr)
            if at:
                span.add_event(_STAGE_NAMES.get(attr, attr), timestamp=ns(at))
        req = t.req
        attrs: dict[str, AttributeValue] = {"http.response.status_code": code, "omni.outcome": t.outcome or "rejected",
                 "omni.completion_tokens": t.completion_tokens, "omni.retries": t.retries}
        if req is not None:
            attrs.update({"omni.request_id": req.request_id, "gen_ai.request.model": req.model,
                          "omni.prompt_tokens": req.prompt_tokens})
        if t.flow:
            attrs["omni.flow"] = t.flow
        if t.prefill_worker:
            attrs["omni.prefill_worker"] = t.prefill_worker
        if t.decode_worker:
            attrs["omni.decode_worker"] = t.decode_worker
        if t.queued_ms:
            attrs["omni.queued_ms"] = t.queued_ms
        span.set_attributes(attrs)
        if failed:
            span.set_status(Status(StatusCode.ERROR, t.error[:200] or f"HTTP {code}"))
        span.end(end_time=ns(t.done))

    def shutdown(self) -> None:
        self.provider.shutdown()
