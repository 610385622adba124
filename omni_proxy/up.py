"""``omni-proxy up``: control plane and one data plane in one process, for real engines.

    omni-proxy up --prefill http://p1:8000 --decode http://d1:8000 --worker http://agg:8000 --port 8080

Scale out by running more ``omni-proxy dataplane`` nodes against the same control plane.
"""

from __future__ import annotations

import argparse

from controlplane import cli as cp_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    cp_cli.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="data-plane listen address")
    p.add_argument("--port", type=int, default=8000, help="data-plane port")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024)


def run(args: argparse.Namespace) -> int:
    import logging

    from omni_runtime import run_main, wait_for_stop_signal, write_ready_file

    from dataplane.observe import configure_logging

    configure_logging(args.log_level, args.log_format)    # the data plane's: request ids on its lines
    try:
        cfg = cp_cli.config_from_args(args)
        cp_cli.check_config(cfg)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"omni-proxy up: {exc}")
    if args.listen is None:
        cfg.listen = "127.0.0.1:0"  # private to this process unless asked otherwise

    async def main() -> None:
        from controlplane.server import ControlPlane
        from dataplane.app import DataPlane, DataPlaneConfig
        from dataplane.server import serve
        from dataplane.upstream import UpstreamConfig

        cp = ControlPlane(cfg)
        await cp.start()
        dp = DataPlane(DataPlaneConfig(host=args.host, port=args.port, controlplane=f"127.0.0.1:{cp.grpc_port}",
                                       max_body_bytes=args.max_body_bytes,
                                       upstream=UpstreamConfig(engine_api_key=cfg.engine_api_key)))
        site, port = await serve(dp.build_app(), args.host, args.port)
        await dp.placements.wait_connected(10)
        write_ready_file(args.ready_file, port=port, grpc_port=cp.grpc_port, http_port=cp.http_port)
        logging.getLogger("omni_proxy").info("omni-proxy up: OpenAI API on http://%s:%d, control plane %s",
                                             args.host, port, f"127.0.0.1:{cp.grpc_port}")
        try:
            await wait_for_stop_signal()
        finally:
            await site.cleanup()
            await cp.stop()

    run_main(main)
    return 0
