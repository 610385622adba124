"""OpenTelemetry spans for the control plane (``otel_endpoint`` / ``--otel-endpoint``).

Imported only when spans are on: a control plane without an endpoint never loads the SDK
and creates no span objects. Needs the ``otel`` extra, as the data plane's spans do.

Each placement is a ``placement`` span (SERVER) from the moment its request arrives to its
answer; a request the queue stage holds has a ``queued`` child span for its wait. The span
continues the trace the data plane sent in ``PlaceRequest.trace_headers`` (W3C trace
context: the data plane's request span, or the client's own ``traceparent``), so one trace
shows the client's request, its placement and queueing here, and its engine legs. A
placement without trace context starts a trace of its own. Spans leave in batches from the
SDK's background thread (``OTEL_BSP_*`` settings apply), never on the event loop.
"""

from __future__ import annotations

import asyncio

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from protos import omni_proxy_pb2 as pb


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base address (``http://collector:4318``) or the full traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracing:
    def __init__(self, endpoint: str, *, service_name: str = "omni-proxy-controlplane",
                 exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter if exporter is not None else OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("omni_proxy.controlplane")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, req: pb.PlaceRequest) -> Span:
        parent = self.propagator.extract(dict(req.trace_headers)) if req.trace_headers else None
        return self.tracer.start_span("placement", context=parent, kind=SpanKind.SERVER, attributes={
            "omni.request_id": req.request_id, "gen_ai.request.model": req.model,
            "omni.leg": pb.Leg.Name(req.leg).removeprefix("LEG_").lower(), "omni.prompt_tokens": req.prompt_tokens})

    def answered(self, span: Span, answer: pb.Placement | asyncio.Future) -> None:
        """End ``span`` with the placement; a held request's span ends when the queue answers."""
        if isinstance(answer, pb.Placement):
            _end(span, answer)
            return
        queued = self.tracer.start_span("queued", context=set_span_in_context(span))

        def done(fut: asyncio.Future) -> None:
            placement = None if fut.cancelled() or fut.exception() is not None else fut.result()
            if placement is None:
                queued.set_status(Status(StatusCode.ERROR, "left the queue unplaced"))
            queued.end()
            _end(span, placement)

        answer.add_done_callback(done)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _end(span: Span, placement: pb.Placement | None) -> None:
    if placement is None:
        span.set_status(Status(StatusCode.ERROR, "no placement (cancelled)"))
    elif placement.error:
        span.set_attribute("omni.error", pb.ErrorCode.Name(placement.error))
        span.set_status(Status(StatusCode.ERROR, placement.error_message[:200]))
    else:
        span.set_attribute("omni.flow", pb.Flow.Name(placement.flow).removeprefix("FLOW_").lower())
        if placement.prefill.worker_id:
            span.set_attribute("omni.prefill_worker", placement.prefill.worker_id)
        if placement.decode.worker_id:
            span.set_attribute("omni.decode_worker", placement.decode.worker_id)
        if placement.queued_ms:
            span.set_attribute("omni.queued_ms", placement.queued_ms)
    span.end()
