"""The ``omni-proxy`` command: one entry point, one subcommand per process kind.

Each subcommand lives with the package it runs (``controlplane.cli``, ``dataplane.cli``,
``simulator.cli``...); this module only wires them together and imports them lazily,
so ``omni-proxy sim`` does not pay for importing gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args), help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("omni_proxy.demo", "start simulated engines, control plane and data plane; send traffic; report"),
    "up": ("omni_proxy.up", "run control plane + data plane against real engine URLs"),
    "controlplane": ("controlplane.cli", "run the gRPC control plane"),
    "dataplane": ("dataplane.cli", "run one HTTP data-plane node"),
    "sim": ("simulator.cli", "run one simulated vLLM-compatible engine"),
    "ctl": ("omni_proxy.ctl", "operator commands against a control plane (same as omni-ctl)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-proxy", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        # Argument definitions are cheap to import; heavy imports happen in run().
        mod = importlib.import_module(module)
        epilog = getattr(mod, "EPILOG", None)    # omni-ctl's exit statuses
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter if epilog else argparse.HelpFormatter)
        p.set_defaults(_module=module)
        mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    rc = importlib.import_module(args._module).run(args)
    sys.exit(rc or 0)
