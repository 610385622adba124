"""``omni-proxy up``: control plane and one data plane in one process, for real engines.

    omni-proxy up --prefill http://p1:8000 --decode http://d1:8000 --worker http://agg:8000 --port 8080
    omni-proxy up --config fleet.toml --api-keys keys.txt --rate-limits limits.toml --tokenizer /models/m

Every control-plane flag and config key applies as in ``omni-proxy controlplane`` (the file's
``listen`` included: without it, or ``--listen``, the gRPC port is a free one private to this
process), and every data-plane flag as in ``omni-proxy dataplane`` (API keys, rate limits,
tokenizer, OpenTelemetry, retries, timeouts, client limits), but for ``--controlplane`` (the
one in this process) and ``--workers``. Flags both have (``--engine-api-key``,
``--otel-endpoint``, logging) set both. Scale out by running more ``omni-proxy dataplane``
nodes against the same control plane (``listen`` on an address they reach).
"""

from __future__ import annotations

import argparse

from controlplane import cli as cp_cli
from dataplane import cli as dp_cli

# Data-plane flags that have no meaning here: its control plane is this process's.
_NOT_HERE = ("--controlplane", "--workers", "--parent-pid")


def add_arguments(p: argparse.ArgumentParser) -> None:
    cp_cli.add_arguments(p)
    dp = argparse.ArgumentParser(add_help=False)
    dp_cli.add_arguments(dp)
    for action in dp._actions:
        strings = action.option_strings
        if not strings or any(s in _NOT_HERE for s in strings) or any(s in p._option_string_actions for s in strings):
            continue    # the control plane's flag of that name serves both (or none is wanted here)
        p._add_action(action)


def _dataplane_target(cfg, grpc_port: int) -> str:
    """Where this process's data plane reaches its control plane: the listen host (loopback
    for a wildcard), the bound port."""
    host = cfg.listen.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::", "*"):
        host = "127.0.0.1"
    return f"{host}:{grpc_port}"


def dataplane_config(args: argparse.Namespace, cfg, grpc_port: int):
    """The data plane's config from its flags, against this process's control plane; the
    engine API key and the OTel endpoint fall back to the control plane's (config file)."""
    args.controlplane = _dataplane_target(cfg, grpc_port)
    args.workers, args.parent_pid = 1, 0
    given_key = args.engine_api_key is not None or bool(getattr(args, "engine_api_key_file", ""))
    if not given_key and cfg.engine_api_key:
        args.engine_api_key = cfg.engine_api_key
    if args.otel_endpoint is None:
        args.otel_endpoint = getattr(cfg, "otel_endpoint", "") or ""
    if args.otel_service_name is None:
        args.otel_service_name = "omni-proxy-dataplane"
    dcfg = dp_cli.config_from_args(args)
    if args.controlplane_token is None:
        # [auth] closes the Scheduler service: this process's data plane uses a token the
        # control plane accepts for it (it never leaves the process).
        tokens = cfg.auth.resolved().accepted("dataplane")
        if tokens:
            dcfg.controlplane_token = next(iter(tokens.values()))
    return dcfg


def check_args(args: argparse.Namespace, cfg) -> None:
    """What would only fail later: a TLS control plane the data plane has no CA for."""
    if (cfg.auth.tls_cert or cfg.auth.tls_client_ca) and not args.controlplane_tls_ca:
        raise ValueError("auth.tls_cert: the control plane serves TLS: give --controlplane-tls-ca (and "
                         "--controlplane-tls-cert/--controlplane-tls-key with tls_client_ca) for the data plane")


def run(args: argparse.Namespace) -> int:
    import logging

    from omni_runtime import StartupError, bind_error, run_main, wait_for_stop_signal, write_ready_file

    from dataplane.observe import configure_logging

    configure_logging(args.log_level, args.log_format)    # the data plane's: request ids on its lines
    try:
        cfg = cp_cli.config_from_args(args)
        cp_cli.check_config(cfg)
        check_args(args, cfg)
        if args.engine_api_key_file:      # one key for both planes, read from the file
            cfg.engine_api_key = dp_cli.engine_api_key(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"omni-proxy up: {exc}") from None
    if args.listen is None and "listen" not in cfg.explicit:
        cfg.listen = "127.0.0.1:0"  # private to this process unless the flag or the file says otherwise

    async def main() -> None:
        from controlplane.server import ControlPlane
        from dataplane.app import DataPlane
        from dataplane.server import serve

        cp = ControlPlane(cfg)
        await cp_cli._start(cp, cfg)     # a port it cannot bind: one line naming the key
        site = None
        try:
            dcfg = dataplane_config(args, cfg, cp.grpc_port)
            dp = DataPlane(dcfg)
            try:
                site, port = await serve(dp.build_app(), dcfg.host, dcfg.port)
            except OSError as exc:
                raise bind_error(exc, "--host/--port", dcfg.host, dcfg.port) from None
            if not await dp.placements.wait_connected(10):
                raise StartupError(f"the data plane cannot reach this process's control plane at "
                                   f"{dcfg.controlplane} (listen: {cfg.listen})")
            write_ready_file(args.ready_file, port=port, grpc_port=cp.grpc_port, http_port=cp.http_port)
            logging.getLogger("omni_proxy").info("omni-proxy up: OpenAI API on http://%s:%d, control plane %s",
                                                 dcfg.host, port, dcfg.controlplane)
            await wait_for_stop_signal()
        finally:
            if site is not None:
                await site.cleanup()
            await cp.stop()

    run_main(main, "omni-proxy up")
    return 0
