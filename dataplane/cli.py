"""``omni-proxy dataplane``: run one stateless HTTP data-plane node."""

from __future__ import annotations

import argparse
import sys

from dataplane import bulk_priority
from dataplane.prefix_ids import DEFAULT_MAX_IDS as DEFAULT_PREFIX_IDS
from omni_runtime import flags

GIL_SWITCH_INTERVAL_S = 0.0005


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", type=flags.host, default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=flags.port, default=8000, help="port (0 = any free port)")
    p.add_argument("--controlplane", type=flags.targets, default="127.0.0.1:50051",
                   help="control-plane gRPC address, or several replicas' as a comma-separated list")
    p.add_argument("--workers", type=flags.count(1, 256), default=1,
                   help="serving processes on the one port (SO_REUSEPORT; each has its own control-plane session)")
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fallback-after", type=flags.seconds, default=1.0,
                   help="seconds without any control plane before placing locally (round robin over the "
                        "last known workers)")
    p.add_argument("--node-id", help="name of this node in the control plane's logs")
    p.add_argument("--max-body-bytes", type=flags.count(1, 2**40), default=32 * 1024 * 1024,
                   help="larger bodies get 413")
    p.add_argument("--placement-timeout", type=flags.seconds, default=5.0, help="seconds to wait for a placement")
    p.add_argument("--prefill-retries", type=flags.count(0, 16), default=1,
                   help="sequential PD: other prefill workers to try when one fails")
    p.add_argument("--retries", type=flags.count(0, 16), default=2,
                   help="aggregated and decode legs failing before the first byte: other workers to try")
    p.add_argument("--tokenizer", default="",
                   help="model directory with tokenizer.json (+ tokenizer_config.json): tokenize once here")
    p.add_argument("--chat-template", default="", help="chat template file or text, as vLLM's --chat-template")
    p.add_argument("--no-reuse-tokens", action="store_true",
                   help="keep sending completions prompts as text (default: send the token ids)")
    p.add_argument("--tokenizer-prefix-cache", type=flags.count(0, 2**31), default=DEFAULT_PREFIX_IDS,
                   metavar="IDS",
                   help="token ids of text prefixes kept so that a long prompt (a chat's earlier turns) "
                        "encodes only what follows the longest one tokenized before, with the same ids "
                        f"(default {DEFAULT_PREFIX_IDS:,}, about 8 bytes an id; 0 = no cache, a long prompt "
                        "still encoded in pieces)")
    p.add_argument("--bulk-nice", type=bulk_priority.parse, default=bulk_priority.DEFAULT_BULK_NICE,
                   metavar="N|idle",
                   help="CPU priority of the bulk work (long prompts' encode threads, the block-hashing process): "
                        f"a nice increment over the data plane's, 0-19 (default {bulk_priority.DEFAULT_BULK_NICE}: "
                        "the event loop's priority), or 'idle' (SCHED_IDLE); lowered, the event loop takes a "
                        "core first, but the encode waits for it")
    p.add_argument("--connect-timeout", type=flags.seconds, default=5.0, help="seconds to connect to an engine")
    p.add_argument("--read-timeout", type=flags.seconds, default=600.0,
                   help="longest silence from an engine before the leg fails")
    p.add_argument("--prefill-timeout", type=flags.seconds, default=300.0,
                   help="whole prefill leg, request to answer (a timed-out P is retried elsewhere)")
    p.add_argument("--engine-api-key", default=None,
                   help="sent to engines as a Bearer token (default: $OMNI_ENGINE_API_KEY; a flag shows in `ps`, "
                        "so prefer the variable or --engine-api-key-file)")
    p.add_argument("--engine-api-key-file", default="", metavar="FILE",
                   help="read the engine API key from this file (a mounted Secret), read once at start")
    p.add_argument("--api-keys", default="", metavar="FILE",
                   help="require client API keys (Authorization: Bearer): one per line, optionally name:key; "
                        "re-read when the file changes")
    p.add_argument("--controlplane-token", default=None,
                   help="token for the control plane's [auth] dataplane_tokens (default $OMNI_CONTROLPLANE_TOKEN)")
    p.add_argument("--controlplane-tls-ca", default="", help="PEM CA of a control plane serving TLS")
    p.add_argument("--controlplane-tls-cert", default="", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--controlplane-tls-key", default="", help="its private key (PEM)")
    p.add_argument("--forward-client-auth", action="store_true",
                   help="send the client's Authorization header to the engines (default: never)")
    p.add_argument("--allow-client-fields", default="",
                   help="comma-separated PD-internal body fields a client may set (kv_transfer_params, "
                        "bootstrap_*); by default the data plane drops them")
    p.add_argument("--client-header-timeout", type=flags.seconds_or_zero, default=30.0,
                   help="seconds for a client to send a request's line and headers (0 = no limit)")
    p.add_argument("--client-body-timeout", type=flags.seconds_or_zero, default=60.0,
                   help="seconds for a client to send a request's body (0 = no limit)")
    p.add_argument("--keepalive-timeout", type=flags.seconds, default=75.0,
                   help="seconds an idle client keep-alive connection stays open")
    p.add_argument("--max-header-bytes", type=flags.count(256, 1 << 20), default=8190,
                   help="longest request line or header field (431 beyond)")
    p.add_argument("--max-connections", type=flags.count(0, 1 << 24), default=0,
                   help="client connections at once (0 = half the open-file limit); at the cap the longest-idle "
                        "connection is closed for a new one, and with none idle the new one gets 503")
    p.add_argument("--max-connections-per-client", type=flags.count(0, 1 << 24), default=0,
                   help="client connections from one address (0 = no limit; behind a balancer all share one)")
    p.add_argument("--max-inflight", type=flags.count(1, 1 << 24), default=4096,
                   help="requests in progress at once in this process; more wait in the admission queue")
    p.add_argument("--max-queued", type=flags.count(0, 1 << 24), default=1024,
                   help="requests waiting for a slot (by priority, then arrival); beyond: 429 with Retry-After")
    p.add_argument("--queue-timeout", type=flags.seconds_or_zero, default=30.0,
                   help="seconds a request may wait for a slot before a 429")
    p.add_argument("--rate-limits", default="", metavar="FILE",
                   help="per-client token buckets (TOML: [default] and [keys.NAME] with requests_per_s, burst, "
                        "prompt_tokens_per_s, prompt_tokens_burst); over the limit: 429 with Retry-After")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="one JSON line per request on the omni_proxy.access logger (default: on)")
    p.add_argument("--otel-endpoint", default="",
                   help="OTLP/HTTP collector (e.g. http://127.0.0.1:4318): OpenTelemetry spans per request "
                        "and engine leg; needs the otel extra (default: off)")
    p.add_argument("--otel-service-name", default="omni-proxy-dataplane", help="service.name of the spans")
    from omni_runtime.logs import add_log_arguments

    add_log_arguments(p)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)


def engine_api_key(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    """The key engines get as a Bearer token: --engine-api-key-file, else --engine-api-key, else
    $OMNI_ENGINE_API_KEY (the control plane reads the same variable). A file or the variable keeps
    the key off the command line, which any user of the host can read."""
    import os

    path = getattr(args, "engine_api_key_file", "")
    if path:
        if args.engine_api_key is not None:
            raise SystemExit("omni-proxy dataplane: --engine-api-key and --engine-api-key-file: give one")
        try:
            key = open(path, encoding="utf-8").read().strip()
        except OSError as exc:
            raise SystemExit(f"omni-proxy dataplane: --engine-api-key-file {path}: {exc.strerror}") from None
        if not key:
            raise SystemExit(f"omni-proxy dataplane: --engine-api-key-file {path} is empty")
        return key
    if args.engine_api_key is not None:
        return args.engine_api_key
    return (os.environ if environ is None else environ).get("OMNI_ENGINE_API_KEY", "")


def config_from_args(args: argparse.Namespace):
    from dataplane.app import DataPlaneConfig
    from dataplane.hygiene import parse_field_list
    from dataplane.server import ClientLimits
    from dataplane.upstream import UpstreamConfig

    cfg = DataPlaneConfig(host=args.host, port=args.port, controlplane=args.controlplane,
                          max_body_bytes=args.max_body_bytes, placement_timeout_s=args.placement_timeout,
                          prefill_retries=args.prefill_retries, retries=args.retries,
                          fallback_after_s=args.fallback_after, tokenizer=args.tokenizer,
                          chat_template=args.chat_template, reuse_tokens=not args.no_reuse_tokens,
                          tokenizer_prefix_cache=args.tokenizer_prefix_cache, bulk_nice=args.bulk_nice,
                          allowed_client_fields=parse_field_list(args.allow_client_fields),
                          client=ClientLimits(header_timeout_s=args.client_header_timeout,
                                              body_timeout_s=args.client_body_timeout,
                                              keepalive_timeout_s=args.keepalive_timeout,
                                              max_header_bytes=args.max_header_bytes,
                                              max_connections=args.max_connections,
                                              max_connections_per_client=args.max_connections_per_client),
                          upstream=UpstreamConfig(connect_timeout_s=args.connect_timeout,
                                                  read_timeout_s=args.read_timeout,
                                                  prefill_timeout_s=args.prefill_timeout,
                                                  engine_api_key=engine_api_key(args),
                                                  forward_client_auth=args.forward_client_auth),
                          api_keys=args.api_keys,
                          access_log=args.access_log, otel_endpoint=args.otel_endpoint,
                          otel_service_name=args.otel_service_name)
    from dataplane.admission import AdmissionConfig

    cfg.admission = AdmissionConfig(max_inflight=args.max_inflight, max_queued=args.max_queued,
                                    queue_timeout_s=args.queue_timeout, rate_limits=args.rate_limits)
    if args.node_id:
        cfg.node_id = args.node_id
    if args.controlplane_token is not None:
        cfg.controlplane_token = args.controlplane_token
    cfg.controlplane_tls = (args.controlplane_tls_ca, args.controlplane_tls_cert, args.controlplane_tls_key)
    return cfg


def run(args: argparse.Namespace) -> int:
    import logging

    from omni_runtime import (bind_error, exit_with_parent, run_main, settle_heap, wait_for_stop_signal,
                               write_ready_file)

    from dataplane.observe import configure_logging

    configure_logging(args.log_level, args.log_format)
    # Long prompts are tokenized and hashed in threads, in per-block Python that holds the
    # GIL: at CPython's default 5 ms switch interval each of them held every other request's
    # placement for 5 ms at a time (bench/burst.py). At 0.5 ms the event loop gets it back
    # ten times sooner; the threads' own work takes a little longer.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    cfg = config_from_args(args)
    if not 1 <= args.workers <= 256:
        raise SystemExit("omni-proxy dataplane: --workers must be an integer from 1 to 256")
    try:
        cfg.client.validate()
    except ValueError as exc:
        raise SystemExit(f"omni-proxy dataplane: {exc}") from None
    helpers: list = []

    async def main() -> None:
        from dataplane.app import DataPlane
        from dataplane.server import serve

        if args.workers > 1:
            cfg.node_id = f"{cfg.node_id}-w0"
        dp = DataPlane(cfg)
        shared = args.workers > 1 or bool(args.parent_pid)
        try:
            site, port = await serve(dp.build_app(), cfg.host, cfg.port, reuse_port=shared)
        except OSError as exc:  # one line naming the flag, not a traceback
            raise bind_error(exc, "--host/--port", cfg.host, cfg.port) from None
        if args.parent_pid:
            exit_with_parent(args.parent_pid)
        helpers.extend(_start_helpers(args.workers - 1, port, cfg.node_id.removesuffix("-w0")))
        # Ready means ready to place: wait (bounded) for the control-plane session.
        if not await dp.placements.wait_connected(cfg.placement_timeout_s * 2):
            logging.getLogger("dataplane").warning("control plane %s not reachable yet", cfg.controlplane)
        settle_heap()   # start-up's objects (tokenizer, templates, modules) out of the GC's scans
        write_ready_file(args.ready_file, port=port, node_id=cfg.node_id)
        logging.getLogger("dataplane").info("data plane %s on %s:%d -> control plane %s",
                                            cfg.node_id, cfg.host, port, cfg.controlplane)
        try:
            await wait_for_stop_signal()
        finally:
            for proc in helpers:
                proc.terminate()
            await site.cleanup()
            for proc in helpers:
                try:
                    proc.wait(timeout=10)
                except Exception:   # noqa: BLE001 - a helper that will not stop is killed
                    proc.kill()

    run_main(main, "omni-proxy dataplane")
    return 0


_OWN_FLAGS = ("--workers", "--port", "--ready-file", "--node-id", "--parent-pid")


def _start_helpers(n: int, port: int, node_id: str) -> list:
    """Start ``n`` more serving processes on ``port`` with this process's other flags.

    Each is a full data plane (its own event loop, upstream pool and control-plane
    session) that exits when this one does; the kernel spreads connections over them.
    """
    import os
    import subprocess
    import sys

    argv = sys.argv[1:]
    rest = argv[argv.index("dataplane") + 1:] if "dataplane" in argv else argv
    kept, skip = [], False
    for arg in rest:
        if skip:
            skip = False
            continue
        if arg in _OWN_FLAGS:
            skip = True
            continue
        if arg.startswith(tuple(f + "=" for f in _OWN_FLAGS)):
            continue
        kept.append(arg)
    return [subprocess.Popen([sys.executable, "-m", "omni_proxy", "dataplane", *kept, "--port", str(port),
                              "--node-id", f"{node_id}-w{i}", "--parent-pid", str(os.getpid())])
            for i in range(1, n + 1)]
