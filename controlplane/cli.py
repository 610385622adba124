"""``omni-proxy controlplane``: run the gRPC control plane."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or YAML file (see controlplane/config.py)")
    p.add_argument("--listen", help="gRPC address (default 127.0.0.1:50051; port 0 = any free port)")
    p.add_argument("--http-host", help="host for /metrics, /health and the metaserver")
    p.add_argument("--http-port", type=int, help="port for /metrics and /health (0 = any free port)")
    p.add_argument("--policy", help="round_robin | random | power_of_two | least_load | a custom profile")
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
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace):
    from controlplane.config import ControlPlaneConfig, WorkerSpec
    from controlplane.workers import Role

    cfg = ControlPlaneConfig.from_file(args.config) if args.config else ControlPlaneConfig()
    for attr, key in (("listen", "listen"), ("http_host", "http_host"), ("http_port", "http_port"),
                      ("policy", "policy"), ("pd_flow", "pd_flow"),
                      ("parallel_protocol", "parallel_protocol"), ("metaserver_host", "metaserver_host")):
        value = getattr(args, attr, None)
        if value is not None:
            setattr(cfg, key, value)
    if args.health_interval is not None:
        cfg.health.interval_s = args.health_interval
    if args.metrics_interval is not None:
        cfg.health.metrics_interval_s = args.metrics_interval
    cfg.workers += [WorkerSpec.parse_flag(w) for w in args.worker]
    cfg.workers += [WorkerSpec.parse_flag(w, Role.PREFILL) for w in args.prefill]
    cfg.workers += [WorkerSpec.parse_flag(w, Role.DECODE) for w in args.decode]
    return cfg


def check_config(cfg) -> None:
    """Refuse settings that would only fail later, under traffic."""
    from metaserver.server import WILDCARD_HOSTS

    if cfg.pd_flow == "layerwise" and (cfg.metaserver_host or cfg.http_host).strip() in WILDCARD_HOSTS:
        raise ValueError("layerwise needs a metaserver address decode engines can reach: "
                         "set --metaserver-host (a wildcard address like 0.0.0.0 is refused)")
    if cfg.parallel_protocol not in ("sglang", "mooncake"):
        raise ValueError(f"parallel_protocol must be sglang or mooncake, not {cfg.parallel_protocol!r}")


def run(args: argparse.Namespace) -> int:
    import logging

    from omni_proxy.runtime import run_main, wait_for_stop_signal, write_ready_file

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        from controlplane.scheduling import build_profile

        build_profile(cfg.policy, cfg.profiles)  # fail fast on a bad policy
        check_config(cfg)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"omni-proxy controlplane: {exc}")

    async def main() -> None:
        from controlplane.server import ControlPlane

        cp = ControlPlane(cfg)
        await cp.start()
        write_ready_file(args.ready_file, port=cp.grpc_port, http_port=cp.http_port)
        try:
            await wait_for_stop_signal()
        finally:
            await cp.stop()

    run_main(main)
    return 0
