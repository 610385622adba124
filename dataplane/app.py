"""The data-plane HTTP server: OpenAI routes in, placements from the control plane, legs out."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dataplane import auth as client_auth
from dataplane.admission import Admission, AdmissionConfig, AdmissionMetrics
from dataplane.errors import APIError, error_response
from dataplane.flows import aggregated, layerwise, parallel, sequential
from dataplane.flows.context import FlowContext
from dataplane.intake import read_client_body
from dataplane.flows.recompute import run_recomputing
from dataplane.hygiene import sanitize_client_id
from dataplane.loopwatch import LoopWatch
from dataplane.messages import Request, Response, StreamResponse, json_response
from dataplane.metrics import DataPlaneMetrics
from dataplane.observe import (ACCESS_LOGGER, Ended, Observer, current_request_id, install_request_id_filter,
                               trace_headers)
from dataplane.placement_client import ControlPlaneUnavailable, PlacementClient
from dataplane import placing
from dataplane.bulk_priority import DEFAULT_BULK_NICE, BulkPriority
from dataplane.prefix import PrefixHasher
from dataplane.prefix_ids import DEFAULT_MAX_IDS as DEFAULT_PREFIX_IDS
from dataplane.prompt import PrefixReuseMetrics, PromptProcessor
from dataplane.tokenizer import Tokenizer
from dataplane import tokenize_api
from dataplane.requests import (CHAT, COMPLETIONS, PASSTHROUGH, ClientRequest, parse_passthrough, parse_request,
                                slo_header)
from dataplane.retry import counted, leg_retry, prefill_retry
from dataplane.server import App, ClientLimits
from dataplane.tracking import RequestTracker
from dataplane.upstream import Upstream, UpstreamConfig, UpstreamError
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

FLOWS = {pb.FLOW_AGGREGATED: ("aggregated", aggregated.run), pb.FLOW_SEQUENTIAL: ("sequential", sequential.run),
         pb.FLOW_PARALLEL: ("parallel", parallel.run), pb.FLOW_LAYERWISE: ("layerwise", layerwise.run)}


def _version() -> str:
    """The installed distribution's version (planes do not import the omni_proxy package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omni-proxy")
    except PackageNotFoundError:
        return "unknown"


VERSION = _version()
MODEL_PREFIX = "/v1/models/"
MODEL_ROUTE = MODEL_PREFIX + "{model}"


def _model_card(m: pb.ModelInfo) -> dict:
    """OpenAI's model object, with vLLM's ``max_model_len`` when the engines told it."""
    card = {"id": m.id, "object": "model", "created": 0, "owned_by": "omni-proxy", "root": m.id, "parent": None}
    if m.max_model_len:
        card["max_model_len"] = m.max_model_len
    return card


class _ControlPlaneLink:
    """Scrape-time view of the control-plane session and of local fallback placement."""

    def __init__(self, placements: PlacementClient) -> None:
        self.placements = placements

    def describe(self):
        return []

    def collect(self):
        pc = self.placements
        yield GaugeMetricFamily("omni_dp_controlplane_connected", "1 while a control-plane session is up",
                                value=1 if pc.connected else 0)
        yield CounterMetricFamily("omni_dp_controlplane_sessions", "Control-plane sessions started",
                                  value=pc.sessions_started)
        yield CounterMetricFamily("omni_dp_fallback_placements", "Placements made locally while no control "
                                  "plane answered", value=pc.fallback.placed)
        yield CounterMetricFamily("omni_dp_controlplane_fleet_updates", "Lists of routable workers received "
                                  "from the control plane", value=pc.fleet_updates)
        yield CounterMetricFamily("omni_dp_local_placements", "Entry legs placed by the data plane itself "
                                  "(the control plane's policy needs no shared state), the control plane "
                                  "told afterwards", value=pc.fallback.placed_local)
        yield GaugeMetricFamily("omni_dp_fallback_workers", "Workers known for local fallback placement",
                                value=pc.fallback.known)


@dataclass
class DataPlaneConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    controlplane: str = "127.0.0.1:50051"
    node_id: str = field(default_factory=lambda: f"dp-{uuid.uuid4().hex[:8]}")
    max_body_bytes: int = 32 * 1024 * 1024
    placement_timeout_s: float = 5.0
    prefill_retries: int = 1
    retries: int = 2               # aggregated / decode legs: other workers after a failure before the first byte
    fallback_after_s: float = 1.0  # no control plane for this long: place locally over the last known workers
    tokenizer: str = ""            # model directory with tokenizer.json: tokenize in the data plane
    chat_template: str = ""        # like vLLM's --chat-template
    reuse_tokens: bool = True      # send completions prompts to the engines as token ids
    tokenizer_prefix_cache: int = DEFAULT_PREFIX_IDS   # ids of text prefixes kept to reuse (0 = off)
    # encode threads and the hashing process below the loop's CPU priority (dataplane.bulk_priority)
    bulk_nice: BulkPriority = DEFAULT_BULK_NICE
    # PD-internal body fields a client may set anyway (default: none, they are dropped).
    allowed_client_fields: frozenset[str] = frozenset()
    client: ClientLimits = field(default_factory=ClientLimits)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    access_log: bool = True        # one JSON line per request on the omni_proxy.access logger
    otel_endpoint: str = ""        # OTLP/HTTP collector: spans per request and leg ("" = off, nothing loaded)
    otel_service_name: str = "omni-proxy-dataplane"
    api_keys: str = ""             # file of client API keys (one per line, name:key); "" = no keys needed
    # sent to the control plane as "authorization: Bearer" when it has [auth] dataplane_tokens
    controlplane_token: str = field(default_factory=lambda: os.environ.get("OMNI_CONTROLPLANE_TOKEN", ""),
                                    repr=False)
    controlplane_tls: tuple[str, str, str] = ("", "", "")   # (CA, client cert, key) PEM paths; empty: plaintext
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)   # in-flight limit, queue, rate limits


def _tracing(config: DataPlaneConfig):
    """Spans on (``--otel-endpoint``): the SDK is imported only here."""
    from urllib.parse import urlsplit

    from omni_runtime import StartupError

    url = urlsplit(config.otel_endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise StartupError(f"--otel-endpoint must be an http(s) URL with a host, got {config.otel_endpoint!r}")
    try:
        from dataplane.otel import Tracing
    except ImportError as exc:
        raise StartupError(f"--otel-endpoint needs OpenTelemetry ({exc.name} is missing): "
                           "pip install 'omni-proxy[otel]'") from None
    return Tracing(config.otel_endpoint, service_name=config.otel_service_name, node_id=config.node_id)


class DataPlane:
    """Owns the app's long-lived parts; the app's startup/cleanup hooks drive them."""

    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        self.tracing = _tracing(config) if config.otel_endpoint else None
        self.metrics = DataPlaneMetrics()
        self._retry = leg_retry(config.retries, counted(self.metrics))
        self._prefill_retry = prefill_retry(config.prefill_retries, counted(self.metrics, prefill=True))
        self.upstream = Upstream(config.upstream)
        self.api_keys = client_auth.ApiKeys(config.api_keys) if config.api_keys else None
        self.prefix = PrefixHasher(config.bulk_nice)
        self.prompts = PromptProcessor(None, reuse_tokens=config.reuse_tokens)
        self.placements = PlacementClient(config.controlplane, config.node_id,
                                          timeout_s=config.placement_timeout_s,
                                          fallback_after_s=config.fallback_after_s,
                                          token=config.controlplane_token,
                                          credentials=client_auth.grpc_credentials(*config.controlplane_tls),
                                          ssl_context=client_auth.ssl_context(*config.controlplane_tls))
        self.metrics.registry.register(_ControlPlaneLink(self.placements))
        self.metrics.registry.register(PrefixReuseMetrics(self.prompts))
        self.loopwatch = LoopWatch(self.metrics.registry)   # event-loop stalls on /metrics
        try:
            self.admission = Admission(config.admission)
        except ValueError as exc:
            from omni_runtime import StartupError
            raise StartupError(str(exc)) from None
        self.metrics.registry.register(AdmissionMetrics(self.admission))
        if config.access_log:
            # Access lines are INFO whatever --log-level says about the other loggers.
            logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
        self.observer = Observer(self.metrics, access_log_on=config.access_log, tracing=self.tracing)
        # The serving loop, read once: asyncio.get_running_loop() is a getpid() system call
        # per call on Python 3.11 (its fork check), and generate() needs the loop per request.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: list[Ended] = []          # requests ended in this loop turn (generate)
        # The context their bookkeeping runs in: no request's id (each line carries its own).
        self._quiet = contextvars.copy_context()

    def build_app(self) -> App:
        checks = ([client_auth.middleware(self.api_keys, self.config.upstream.forward_client_auth,
                                          failures=self.metrics.auth_failures)]
                  if self.api_keys is not None or self.config.upstream.forward_client_auth else [])
        app = App(limits=self.config.client, max_body_bytes=self.config.max_body_bytes,
                  middlewares=[self._errors, *checks])
        app.add_route("POST", COMPLETIONS, self.generate)
        app.add_route("POST", CHAT, self.generate)
        for path in sorted(PASSTHROUGH):     # embeddings, rerank, responses: one worker, body unchanged
            app.add_route("POST", path, self.generate)
        app.add_route("POST", "/tokenize", self.tokenize)
        app.add_route("POST", "/detokenize", self.detokenize)
        app.add_route("GET", "/v1/models", self.models)
        app.add_route("GET", MODEL_ROUTE, self.model)
        app.add_route("GET", "/version", self.version)
        app.add_route("GET", "/health", self.health)
        # vllm-router's and smg's probe names, and Kubernetes' own
        for path in ("/liveness", "/livez"):
            app.add_route("GET", path, self.liveness)
        for path in ("/readiness", "/readyz"):
            app.add_route("GET", path, self.readiness)
        app.add_route("GET", "/metrics", self.prometheus)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self) -> None:
        install_request_id_filter()
        self._loop = asyncio.get_running_loop()
        if self.config.tokenizer:
            loop = asyncio.get_running_loop()
            try:
                self.prompts.tokenizer = await loop.run_in_executor(None, lambda: Tokenizer.from_dir(
                    self.config.tokenizer, chat_template=self.config.chat_template or None,
                    prefix_cache_ids=self.config.tokenizer_prefix_cache, bulk_priority=self.config.bulk_nice))
            except Exception as exc:  # noqa: BLE001 - one line naming the tokenizer, not a port error
                from omni_runtime import StartupError

                raise StartupError(f"--tokenizer {self.config.tokenizer}: cannot load it: "
                                   f"{type(exc).__name__}: {exc}") from None
        await self.upstream.start()
        await self.placements.start()
        self.loopwatch.start()

    async def _cleanup(self) -> None:
        self.loopwatch.stop()
        self.prefix.close()
        if self.prompts.tokenizer is not None:
            self.prompts.tokenizer.close()      # its tokenizing threads
        await self.placements.close()
        await self.upstream.close()
        if self.tracing is not None:    # flush the last spans, off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    async def _errors(self, request: Request, handler):
        """Every failure leaves as OpenAI-style JSON: never a traceback, never a hang; every
        answer (4xx and 5xx included) carries an ``X-Request-Id``."""
        try:
            resp = await handler(request)
        except APIError as exc:
            resp = Response(status=exc.status, body=exc.body(), content_type="application/json",
                            headers=exc.headers)
            if exc.status == 408:
                # A body that is late: answer now and close, rather than keep reading the
                # rest of it (or read it as the next request).
                resp.force_close()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            resp = error_response(500, "internal error in the data plane; see its log")
        headers = resp.headers
        if "X-Request-Id" not in headers and type(resp) is Response:
            # The request's own id once parsed; else the client's label; else a new one.
            headers["X-Request-Id"] = (request.get("request_id") or sanitize_client_id(
                request.headers.get("X-Request-Id")) or uuid.uuid4().hex)
        return resp

    # ------------------------------------------------------------------ generation

    async def generate(self, http: Request) -> Response | StreamResponse:
        tracker = RequestTracker(self.placements)
        route = http.path
        traceparent = http.headers.get("traceparent")
        if traceparent:
            tracker.trace = trace_headers(traceparent, http.headers.get("tracestate"))
        if self.tracing is not None:
            tracker.tracing = self.tracing
            self.tracing.start_request(tracker, route)
        self.metrics.inflight_requests += 1
        code = 500
        try:
            # (what was _generate: one coroutine less per request)
            # Each await below is skipped when it would return at once: a coroutine per step
            # was a tenth of a non-streamed request's cost in the data plane.
            raw = http.body_at_hand() if "Content-Encoding" not in http.headers else None   # (intake.body_at_hand)
            if raw is None:
                raw = await read_client_body(http, max_bytes=self.config.max_body_bytes,
                                             timeout_s=self.config.client.body_timeout_s)
            passthrough = http.path in PASSTHROUGH
            req = (parse_passthrough if passthrough else parse_request)(
                http.path, raw, http.headers.get("X-Request-Id"), allowed_fields=self.config.allowed_client_fields)
            tracker.req = req
            http["request_id"] = req.echo_id
            current_request_id.set(req.request_id)   # on every log line about this request
            # 429 when over a limit; released in generate()
            priority = self.admission.try_admit(http, req, self.api_keys)
            if priority is not None:
                await self.admission.acquire(priority)
            tracker.admitted = True
            headers = http.headers
            if "X-SLO-TTFT-Ms" in headers or "X-SLO-TPOT-Ms" in headers:
                req.ttft_slo_ms = slo_header(headers, "X-SLO-TTFT-Ms")
                req.tpot_slo_ms = slo_header(headers, "X-SLO-TPOT-Ms")
            if not req.model:
                await self._resolve_model(req)
            if not passthrough and self.prompts.tokenizer is not None:
                await self.prompts.process(req)
            tracker.tokenized = time.perf_counter()
            if req.token_ids and self.placements.info.kv_hash.enabled:   # else there is no chain to hash
                await self._hash_prompt(req)
            tracker.matched = time.perf_counter()
            out = placing.message(self.placements, req, pb.LEG_ENTRY, trace=tracker.trace)
            placement = self.placements.place_here(out)   # (round_robin: placed here, no round trip)
            if placement is None:
                placement = await placing.ask(self.placements, out)
            pflow = placement.flow   # (read once: each read of a protobuf field builds its value)
            flow_name, flow = FLOWS.get(pflow, ("unsupported", None))
            tracker.attach(req, placement, flow_name)
            if passthrough and pflow != pb.FLOW_AGGREGATED:
                # A prefill/decode pair generates; it does not embed, rerank or keep a response's state.
                tracker.failed("", f"{http.path} on a prefill/decode deployment", 400)
                raise APIError(400, f"model {req.model!r} is served by prefill/decode pairs "
                                    f"({pb.Flow.Name(placement.flow).removeprefix('FLOW_').lower()} flow), which "
                                    f"cannot serve {http.path}; it needs an aggregated worker (role both)",
                               param="model")
            if flow is None:
                tracker.failed("", "flow not supported", 0)
                raise APIError(501, f"flow {pb.Flow.Name(placement.flow)} is not supported by this data plane")
            ctx = FlowContext(http=http, req=req, upstream=self.upstream, placements=self.placements,
                              tracker=tracker, metrics=self.metrics, retry=self._retry,
                              prefill_retry=self._prefill_retry,
                              watch_recompute=pflow != pb.FLOW_AGGREGATED)
            try:
                # Only a PD flow's decode can hand the request back (watch_recompute): the others
                # run without the recompute loop's two extra coroutine levels.
                response = await (self._run_flow(ctx, placement, flow) if ctx.watch_recompute else flow(ctx, placement))
            except UpstreamError as exc:
                log.warning("request failed on worker %s (upstream status %s): %s", exc.worker_id,
                            exc.upstream_status, exc.message, extra={"worker": exc.worker_id})
                tracker.failed(exc.worker_id, exc.message, exc.upstream_status or 0)
                self.metrics.upstream_errors.labels(exc.worker_id, str(exc.upstream_status)).inc()
                raise
            except APIError as exc:
                tracker.failed("", exc.message, exc.status)
                raise
            except asyncio.CancelledError:
                # The client went away: closing our upstream responses (done by the flows'
                # finally blocks) makes the engines abort; the report frees the load.
                tracker.cancelled()
                self.metrics.cancelled.inc()
                raise
            except BaseException as exc:
                tracker.failed("", f"{type(exc).__name__}: {exc}", 0)
                raise
            code = response.status
            return response
        except APIError as exc:
            code = exc.status
            raise
        except asyncio.CancelledError:
            code = 499
            raise
        finally:
            if tracker.admitted:
                self.admission.release()
            self.metrics.inflight_requests -= 1
            if not tracker.done:
                tracker.done = tracker.last_token or time.perf_counter()
            # The rest of the bookkeeping runs once the answer is on its way (the server writes
            # a returned response before the loop takes the next callback), for every request
            # that ended in this loop turn at once: one callback, one access-log write.
            ended = self._ended
            ended.append((tracker, route, code,
                          "" if tracker.req is not None else sanitize_client_id(http.headers.get("X-Request-Id")),
                          client_auth.key_id(http) if self.observer.access_log_on else None,
                          current_request_id.get()))
            if len(ended) == 1:
                (self._loop or asyncio.get_running_loop()).call_soon(self._complete, context=self._quiet)

    def _complete(self) -> None:
        ended, self._ended = self._ended, []
        self.observer.complete_all(ended)

    async def _resolve_model(self, req: ClientRequest) -> None:
        """A request without a model ("model" missing, null or "") runs only where that is
        unambiguous: a deployment serving exactly one model. Otherwise it is a 400, never a
        placement on any worker of any model."""
        if req.model:
            return
        try:
            served = [m.id for m in (await self.placements.list_models()).models]
        except ControlPlaneUnavailable as exc:
            raise APIError(503, f"control plane unavailable: {exc}") from None
        if len(served) == 1:
            req.model = served[0]
        elif not served:
            raise APIError(503, "no model is served here yet")
        else:
            raise APIError(400, "'model' is required: this deployment serves several models", param="model")

    async def _hash_prompt(self, req: ClientRequest) -> None:
        """The prompt's block-hash chain, when the control plane places by prefix cache; with
        the adapter's key when the request names a LoRA adapter a worker serves."""
        path = self.placements.fallback.lora_path(req.model)
        done = req.token_ids_json    # the ids' JSON, if it is of these ids (a recompute grows them)
        req.block_hashes = await self.prefix.chain(self.placements.info.kv_hash, req.token_ids,
                                                   req.body.get("cache_salt"),
                                                   (req.model, path) if path is not None else None,
                                                   ids_json=done[1] if done and done[0] is req.token_ids else None)

    async def _run_flow(self, ctx: FlowContext, placement: pb.Placement, flow) -> Response | StreamResponse:
        """Run the flow; when D hands the request back ("recomputed"), re-place and go on."""
        return await run_recomputing(ctx, placement, flow, flows=FLOWS, rehash=self._hash_prompt,
                                     encoder=self._continuation_encoder)

    def _continuation_encoder(self) -> Callable[[str], list[int]] | None:
        """How a recompute extends a token-id prompt: the tokenizer's, once it is loaded."""
        tok = self.prompts.tokenizer
        if tok is None:
            return None
        return lambda text: tok.encode_prompt(text, add_special_tokens=False)

    # ------------------------------------------------------------------ ops routes

    async def _models(self) -> list[pb.ModelInfo]:
        try:
            return list((await self.placements.list_models()).models)
        except ControlPlaneUnavailable as exc:
            raise APIError(503, f"control plane unavailable: {exc}") from None

    async def models(self, http: Request) -> Response:
        return json_response({"object": "list", "data": [_model_card(m) for m in await self._models()]})

    async def model(self, http: Request) -> Response:
        """``/v1/models/{model}``: one card, or 404 (OpenAI's retrieve-model)."""
        wanted = http.path[len(MODEL_PREFIX):]
        found = next((m for m in await self._models() if m.id == wanted), None)
        if found is None:
            raise APIError(404, f"The model {wanted[:200]!r} does not exist", param="model")
        return json_response(_model_card(found))

    async def version(self, http: Request) -> Response:
        return json_response({"version": VERSION})

    async def liveness(self, http: Request) -> Response:
        """200 while the process serves HTTP at all: a failing liveness probe restarts it."""
        return json_response({"status": "alive"})

    async def readiness(self, http: Request) -> Response:
        """200 only when a request could be placed now: a control-plane session is up and at
        least one worker is known; 503 (not ready: take it out of the load balancer) else."""
        pc = self.placements
        if not pc.connected:
            return error_response(503, f"not ready: no control-plane session ({self.config.controlplane})")
        if not pc.fallback.known:
            return error_response(503, "not ready: the control plane knows no worker yet")
        return json_response({"status": "ready", "controlplane": pc.target, "workers": pc.fallback.known})

    async def _tokenizer_request(self, http: Request) -> tuple[Tokenizer, dict]:
        raw = await read_client_body(http, max_bytes=self.config.max_body_bytes,
                                     timeout_s=self.config.client.body_timeout_s)
        body = tokenize_api.json_body(raw)
        tok = self.prompts.tokenizer
        if tok is None:
            raise APIError(400, tokenize_api.NO_TOKENIZER.format(path=http.path))
        return tok, body

    async def tokenize(self, http: Request) -> Response:
        tok, body = await self._tokenizer_request(http)
        model = body.get("model")
        cards = await self._models()
        if model and not any(m.id == model for m in cards):
            raise APIError(404, f"The model {model[:200]!r} does not exist", param="model")
        if not model and len(cards) == 1:
            model = cards[0].id
        limit = next((m.max_model_len for m in cards if m.id == model and m.max_model_len), None)
        return json_response(await tokenize_api.tokenize(tok, body, limit))

    async def detokenize(self, http: Request) -> Response:
        tok, body = await self._tokenizer_request(http)
        model = body.get("model")
        if model and not any(m.id == model for m in await self._models()):
            raise APIError(404, f"The model {model[:200]!r} does not exist", param="model")
        return json_response(tokenize_api.detokenize(tok, body))

    async def health(self, http: Request) -> Response:
        """200 while requests can be served: through a control plane, or (without one) by the
        local fallback over the last known workers, which says so."""
        pc = self.placements
        if pc.connected:
            return json_response({"status": "ok", "controlplane": pc.target, "session": pc.transport})
        if pc.fallback.known:
            return json_response({"status": "degraded", "controlplane": None,
                                  "fallback_workers": pc.fallback.known})
        return error_response(503, f"not connected to any control plane ({self.config.controlplane})")

    async def prometheus(self, http: Request) -> Response:
        return Response(body=generate_latest(self.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})
