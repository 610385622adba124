"""``omni-proxy dataplane``: run one stateless HTTP data-plane node."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    p.add_argument("--controlplane", default="127.0.0.1:50051", help="control plane gRPC address")
    p.add_argument("--node-id", help="name of this node in the control plane's logs")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument("--placement-timeout", type=float, default=5.0, help="seconds to wait for a placement")
    p.add_argument("--prefill-retries", type=int, default=1,
                   help="sequential PD: other prefill workers to try when one fails")
    p.add_argument("--tokenizer", default="",
                   help="model directory with tokenizer.json (+ tokenizer_config.json): tokenize once here")
    p.add_argument("--chat-template", default="", help="chat template file or text, as vLLM's --chat-template")
    p.add_argument("--no-reuse-tokens", action="store_true",
                   help="keep sending completions prompts as text (default: send the token ids)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to an engine")
    p.add_argument("--read-timeout", type=float, default=600.0,
                   help="longest silence from an engine before the leg fails")
    p.add_argument("--prefill-timeout", type=float, default=300.0,
                   help="whole prefill leg, request to answer (a timed-out P is retried elsewhere)")
    p.add_argument("--engine-api-key", default="", help="sent to engines as a Bearer token")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace):
    from dataplane.app import DataPlaneConfig
    from dataplane.upstream import UpstreamConfig

    cfg = DataPlaneConfig(host=args.host, port=args.port, controlplane=args.controlplane,
                          max_body_bytes=args.max_body_bytes, placement_timeout_s=args.placement_timeout,
                          prefill_retries=args.prefill_retries, tokenizer=args.tokenizer,
                          chat_template=args.chat_template, reuse_tokens=not args.no_reuse_tokens,
                          upstream=UpstreamConfig(connect_timeout_s=args.connect_timeout,
                                                  read_timeout_s=args.read_timeout,
                                                  prefill_timeout_s=args.prefill_timeout,
                                                  engine_api_key=args.engine_api_key))
    if args.node_id:
        cfg.node_id = args.node_id
    return cfg


def run(args: argparse.Namespace) -> int:
    import logging

    from omni_proxy.runtime import bind_error, run_main, start_http_site, wait_for_stop_signal, write_ready_file

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)

    async def main() -> None:
        from dataplane.app import DataPlane

        dp = DataPlane(cfg)
        try:
            runner, port = await start_http_site(dp.build_app(), cfg.host, cfg.port)
        except OSError as exc:  # one line naming the flag, not a traceback
            raise bind_error(exc, "--host/--port", cfg.host, cfg.port) from None
        # Ready means ready to place: wait (bounded) for the control-plane session.
        if not await dp.placements.wait_connected(cfg.placement_timeout_s * 2):
            logging.getLogger("dataplane").warning("control plane %s not reachable yet", cfg.controlplane)
        write_ready_file(args.ready_file, port=port, node_id=cfg.node_id)
        logging.getLogger("dataplane").info("data plane %s on %s:%d -> control plane %s",
                                            cfg.node_id, cfg.host, port, cfg.controlplane)
        try:
            await wait_for_stop_signal()
        finally:
            await runner.cleanup()

    run_main(main, "omni-proxy dataplane")
    return 0
