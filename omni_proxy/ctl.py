"""``omni-ctl``: the operators' command line for a running control plane.

    omni-ctl workers                      # table of workers, health and load
    omni-ctl drain prefill-10.0.0.5-8000  # no new placements; in-flight work finishes
    omni-ctl undrain ID | weight ID 2.5 | remove ID
    omni-ctl add http://10.0.0.7:8000 --role decode
    omni-ctl explain --model m --prompt-tokens 2000   # dry-run placement, with reasons

The control plane address comes from --controlplane or $OMNI_CONTROLPLANE.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controlplane", default=os.environ.get("OMNI_CONTROLPLANE", "127.0.0.1:50051"),
                   help="control plane gRPC address (default $OMNI_CONTROLPLANE or 127.0.0.1:50051)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--timeout", type=float, default=5.0)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    w = sub.add_parser("workers", help="list workers")
    w.add_argument("--model", default="")
    for name, help_text in (("drain", "stop new placements to a worker"), ("undrain", "resume placements"),
                            ("remove", "forget a worker")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("worker_id")
    s = sub.add_parser("weight", help="set a worker's capacity weight (0 parks it)")
    s.add_argument("worker_id")
    s.add_argument("weight", type=float)
    s = sub.add_parser("add", help="add a worker by URL")
    s.add_argument("url")
    s.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    s.add_argument("--model", default="")
    s.add_argument("--weight", type=float, default=1.0)
    s.add_argument("--id", default="")
    s = sub.add_parser("explain", help="dry-run a placement and show why the winner won")
    s.add_argument("--model", default="")
    s.add_argument("--prompt-tokens", type=int, default=100)
    s.add_argument("--max-tokens", type=int, default=0)
    s.add_argument("--leg", choices=["entry", "prefill", "decode"], default="entry")


def _worker_dict(w) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(w, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _print_workers(resp, as_json: bool) -> None:
    import json

    from protos import omni_proxy_pb2 as pb

    if as_json:
        print(json.dumps({"policy": resp.policy, "workers": [_worker_dict(w) for w in resp.workers]}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"workers (policy {resp.policy})")
    for col in ("id", "role", "model", "status", "weight", "in-flight req", "in-flight tok",
                "engine run/wait", "placed", "failed", "url"):
        table.add_column(col)
    for w in resp.workers:
        status = pb.WorkerStatus.Name(w.status).removeprefix("STATUS_").lower()
        if w.draining:
            status += " (draining)"
        if w.circuit == "open":
            status += f" (ejected {w.ejected_for_s:.0f}s)"
        elif w.circuit == "half_open":
            status += " (half open)"
        eng = f"{w.load.engine_running}/{w.load.engine_waiting}" if w.load.engine_running >= 0 else "-"
        table.add_row(w.id, pb.Role.Name(w.role).removeprefix("ROLE_").lower(), w.model, status,
                      f"{w.weight:g}", str(w.load.inflight_requests), str(w.load.inflight_tokens), eng,
                      str(w.placements_total), str(w.failures_total), w.url)
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    import json

    import grpc

    from protos import omni_proxy_pb2 as pb
    from protos import omni_proxy_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(args.controlplane)
    admin = pb_grpc.AdminStub(channel)
    t = args.timeout
    try:
        if args.action == "workers":
            _print_workers(admin.ListWorkers(pb.ListWorkersRequest(model=args.model), timeout=t), args.json)
        elif args.action in ("drain", "undrain"):
            call = admin.Drain if args.action == "drain" else admin.Undrain
            w = call(pb.WorkerRef(worker_id=args.worker_id), timeout=t).worker
            print(json.dumps(_worker_dict(w)) if args.json else f"{w.id}: draining={w.draining}")
        elif args.action == "weight":
            w = admin.SetWeight(pb.SetWeightRequest(worker_id=args.worker_id, weight=args.weight), timeout=t).worker
            print(json.dumps(_worker_dict(w)) if args.json else f"{w.id}: weight={w.weight:g}")
        elif args.action == "remove":
            admin.RemoveWorker(pb.WorkerRef(worker_id=args.worker_id), timeout=t)
            print(f"{args.worker_id}: removed")
        elif args.action == "add":
            role = {"both": pb.ROLE_BOTH, "prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}[args.role]
            w = admin.AddWorker(pb.RegisterRequest(url=args.url, role=role, model=args.model,
                                                   weight=args.weight, worker_id=args.id), timeout=t).worker
            print(json.dumps(_worker_dict(w)) if args.json else f"{w.id}: added ({w.url})")
        elif args.action == "explain":
            leg = {"entry": pb.LEG_ENTRY, "prefill": pb.LEG_PREFILL, "decode": pb.LEG_DECODE}[args.leg]
            p = admin.Explain(pb.PlaceRequest(request_id="explain", model=args.model, leg=leg,
                                              prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                              explain=True), timeout=t)
            if args.json:
                from google.protobuf.json_format import MessageToDict

                print(json.dumps(MessageToDict(p, preserving_proto_field_name=True)))
            else:
                if p.error:
                    print(f"error: {pb.ErrorCode.Name(p.error)}: {p.error_message}")
                else:
                    chosen = p.prefill.worker_id or p.decode.worker_id
                    print(f"flow {pb.Flow.Name(p.flow).removeprefix('FLOW_').lower()} -> {chosen}")
                for part in p.explanation.split("; "):
                    print("  " + part)
                return 1 if p.error else 0
    except grpc.RpcError as exc:
        print(f"omni-ctl: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    finally:
        channel.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-ctl", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args(argv)))
