"""``omni-proxy controlplane``: run the gRPC control plane."""

from __future__ import annotations

import argparse

from omni_runtime import flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or YAML file (see controlplane/config.py)")
    p.add_argument("--listen", help="gRPC address (default 127.0.0.1:50051; port 0 = any free port)")
    p.add_argument("--session-listen", help="data-plane session socket: host:port, auto (the gRPC host, "
                   "any free port) or off (sessions on gRPC only)")
    p.add_argument("--http-host", help="host for /metrics, /health and the metaserver")
    p.add_argument("--http-port", type=flags.port,
                   help="port for /metrics and /health (default 9090; 0 = any free port)")
    p.add_argument("--policy", help="predicted_latency (default: with the queue stage) | predicted_latency_unqueued | "
                   "cache_aware | apc_first | least_load | power_of_two | round_robin | random | a custom profile")
    p.add_argument("--pd-flow", choices=["sequential", "parallel", "layerwise"], help="how P/D pairs run")
    p.add_argument("--parallel-protocol", choices=["sglang", "mooncake"],
                   help="parallel flow: SGLang bootstrap fields or vLLM MooncakeConnector bootstrap")
    p.add_argument("--metaserver-host", help="address decode engines use to call the metaserver (layerwise)")
    p.add_argument("--worker", action="append", default=[], metavar="URL[,role=..,model=..,weight=..]",
                   help="an engine; repeatable")
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,...]", help="a prefill engine")
    p.add_argument("--decode", action="append", default=[], metavar="URL[,...]", help="a decode engine")
    p.add_argument("--health-interval", type=float, help="seconds between health checks")
    p.add_argument("--metrics-interval", type=float, help="seconds between engine /metrics polls")
    p.add_argument("--engine-api-key", help="Bearer token for every call to an engine "
                                             "(default: $OMNI_ENGINE_API_KEY)")
    p.add_argument("--discovery-file", help="TOML file of [[workers]] re-read when it changes ([discovery] file)")
    p.add_argument("--tokens-file", help="gRPC API tokens, lines SCOPE NAME TOKEN ([auth] tokens_file)")
    p.add_argument("--tls-cert", help="PEM certificate for TLS on the gRPC port ([auth] tls_cert)")
    p.add_argument("--tls-key", help="its PEM private key ([auth] tls_key)")
    p.add_argument("--tls-client-ca", help="PEM CA that signs client certificates: mutual TLS ([auth] tls_client_ca)")
    p.add_argument("--state-file", help="keep operators' changes (drains, weights, added and removed workers) "
                                        "in this file across restarts, with the memory store ([state] file)")
    p.add_argument("--slo-ttft-ms", type=float, help="the deployment's TTFT target in ms, for requests without "
                   "X-SLO-TTFT-Ms ([slo] ttft_ms; 0 = none: the scorer's 2 s)")
    p.add_argument("--slo-tpot-ms", type=float, help="the deployment's TPOT target in ms, for requests without "
                   "X-SLO-TPOT-Ms ([slo] tpot_ms; 0 = none: the scorer's 100 ms)")
    p.add_argument("--otel-endpoint", help="OTLP/HTTP collector (e.g. http://127.0.0.1:4318): spans for placement "
                                            "and queueing, joined to the data plane's trace (otel_endpoint; "
                                            "needs the otel extra)")
    p.add_argument("--otel-service-name", help="service.name of the spans (otel_service_name; default "
                                                "omni-proxy-controlplane)")
    from omni_runtime.logs import add_log_arguments

    add_log_arguments(p)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace):
    """The config file, then the flags over it; every value goes through the same checks."""
    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.workers import Role

    cfg = ControlPlaneConfig.from_file(args.config) if args.config else ControlPlaneConfig()
    for attr, key in (("listen", "listen"), ("session_listen", "session_listen"), ("http_host", "http_host"),
                      ("http_port", "http_port"),
                      ("policy", "policy"), ("pd_flow", "pd_flow"),
                      ("parallel_protocol", "parallel_protocol"), ("metaserver_host", "metaserver_host"),
                      ("health_interval", "health.interval_s"), ("metrics_interval", "health.metrics_interval_s"),
                      ("engine_api_key", "engine_api_key"), ("discovery_file", "discovery.file"),
                      ("tokens_file", "auth.tokens_file"), ("tls_cert", "auth.tls_cert"),
                      ("tls_key", "auth.tls_key"), ("tls_client_ca", "auth.tls_client_ca"),
                      ("otel_endpoint", "otel_endpoint"), ("otel_service_name", "otel_service_name"),
                      ("state_file", "state.file"), ("slo_ttft_ms", "slo.ttft_ms"),
                      ("slo_tpot_ms", "slo.tpot_ms")):
        value = getattr(args, attr, None)
        if value is not None:
            cfg.set(key, value, "--" + attr.replace("_", "-"))
    cfg.workers += [WorkerSpec.parse_flag(w, flag="--worker") for w in args.worker]
    cfg.workers += [WorkerSpec.parse_flag(w, Role.PREFILL, flag="--prefill") for w in args.prefill]
    cfg.workers += [WorkerSpec.parse_flag(w, Role.DECODE, flag="--decode") for w in args.decode]
    cfg.check()
    return cfg


def check_config(cfg) -> None:
    """Refuse settings that would only fail later, under traffic."""
    from controlplane.admin_state import AdminState
    from kvhash.hashing import BlockHashConfig, UnreproducibleHashError, resolve_seed
    from controlplane.scheduling import build_profile
    from metaserver.server import WILDCARD_HOSTS

    if cfg.pd_flow == "layerwise" and (cfg.metaserver_host or cfg.http_host).strip() in WILDCARD_HOSTS:
        raise ValueError("metaserver_host: layerwise needs a metaserver address decode engines can reach: "
                         "set metaserver_host / --metaserver-host (a wildcard address like 0.0.0.0 is refused)")
    AdminState.load(cfg.state.file)   # a state file that cannot be read stops the start (ValueError)
    if cfg.parallel_protocol not in ("sglang", "mooncake"):
        raise ValueError(f"parallel_protocol must be sglang or mooncake, not {cfg.parallel_protocol!r}")
    try:
        profile = build_profile(cfg.policy, cfg.profiles)
    except (TypeError, AttributeError, KeyError) as exc:  # a plugin option of the wrong shape
        raise ValueError(f"policy {cfg.policy!r}: bad plugin options: {exc}") from None
    if any(scorer.name == "prefix_cache" for scorer, _ in profile.scorers):
        kv = cfg.kv_cache
        try:
            resolve_seed(BlockHashConfig(block_size=kv.block_size, algo=kv.hash_algo,
                                         python_hash_seed=kv.hash_seed, lora_key_format=kv.lora_key_format))
        except UnreproducibleHashError as exc:
            raise ValueError(f"kv_cache.hash_seed is required for policy {cfg.policy!r}: {exc}") from None


def _probe_listen(listen: str):
    """The bind error of ``listen`` (a StartupError naming the key), or None: tried once here,
    before gRPC, whose C core logs its own line on stderr when a bind fails and then only
    says "Failed to bind"."""
    import socket

    from omni_runtime import bind_error

    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        if int(port) == 0:
            return None
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC: TIME_WAIT is no error
            probe.bind(addr)
    except OSError as exc:
        return bind_error(exc, "listen", host, port)
    except ValueError:
        pass
    return None


def _grpc_bind_error(listen: str):
    """gRPC only says "Failed to bind": find out why by trying the same bind once ourselves."""
    from omni_runtime import StartupError

    return _probe_listen(listen) or StartupError(f"listen: cannot listen on {listen}")


async def _start(cp, cfg) -> None:
    """Start the control plane; a port it cannot bind is a :class:`StartupError` naming the key."""
    from controlplane.state import StoreUnavailable
    from omni_runtime import StartupError, bind_error
    from protos.framing import split_target

    refused = _probe_listen(cfg.listen)
    if refused is not None:
        raise refused
    try:
        await cp.start()
    except BaseException as exc:
        try:
            await cp.stop()  # release what did start (health checks, subscribers, sockets)
        except Exception:  # noqa: BLE001 - the start failure is what the operator needs to see
            pass
        if isinstance(exc, RuntimeError) and str(exc).startswith("Failed to bind"):  # grpc's message
            raise _grpc_bind_error(cfg.listen) from None
        if isinstance(exc, OSError) and cp.grpc_port and not cp.session_port and cfg.session_listen != "off":
            host, port = split_target(cfg.session_listen if cfg.session_listen != "auto" else cfg.listen)
            raise bind_error(exc, "session_listen", host, port if cfg.session_listen != "auto" else 0) from None
        if isinstance(exc, OSError) and not cp.http_port and cp.grpc_port:
            raise bind_error(exc, "http_port", cfg.http_host, cfg.http_port) from None
        if isinstance(exc, ValueError):
            raise StartupError(str(exc)) from None
        if isinstance(exc, StoreUnavailable):
            raise StartupError(f"state.redis_url: {exc}") from None
        raise


def run(args: argparse.Namespace) -> int:
    from controlplane.validate import choice as v_choice
    from omni_runtime import run_main, settle_heap, wait_for_stop_signal, write_ready_file
    from omni_runtime.logs import configure as configure_logging

    try:
        level = v_choice(args.log_level.upper(), "--log-level", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
        configure_logging(level, args.log_format)
        cfg = config_from_args(args)
        check_config(cfg)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"omni-proxy controlplane: {exc}") from None

    async def main() -> None:
        from controlplane.server import ControlPlane

        cp = ControlPlane(cfg)
        await _start(cp, cfg)
        settle_heap()
        write_ready_file(args.ready_file, port=cp.grpc_port, http_port=cp.http_port)
        try:
            await wait_for_stop_signal()
        finally:
            await cp.stop()

    run_main(main, "omni-proxy controlplane")
    return 0
