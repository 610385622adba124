"""``omni-ctl``: the operators' command line for a running control plane.

    omni-ctl workers                          # workers: health, weight, drain, load, KV, hit rates
    omni-ctl drain ID [--wait]                # no new placements; --wait returns once it is idle
    omni-ctl undrain ID | weight ID 2.5 | remove ID
    omni-ctl add http://10.0.0.7:8000 --role decode [--id ID] [--model M] [--replace]
    omni-ctl stats                            # placements, errors, queue, sessions
    omni-ctl explain --prompt "..." --tokenizer DIR   # dry-run placement: match depth, load, score
    omni-ctl events                           # per-worker KV-event rate, gaps, last sequence

The control plane address comes from --controlplane or $OMNI_CONTROLPLANE; the token (when
the control plane requires one) from --token or $OMNI_TOKEN. --json prints typed JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

EPILOG = """exit status:
  0  done
  1  another failure (explain: no worker would be chosen; drain --wait: the worker was removed)
  2  usage: a bad flag, URL, file or value (the control plane's INVALID_ARGUMENT too)
  3  not found: no such worker
  4  conflict: it already exists (add without --replace), or the engine failed a check that
     says it is the wrong one (model not listed, PD role mismatch)
  5  unavailable: the control plane, or the engine add checks, cannot be reached
  6  timeout: a call took longer than --rpc-timeout, or drain --wait ran past --wait-timeout
  7  refused: the token or client certificate is not accepted

--rpc-timeout bounds each call to the control plane; drain --wait-timeout bounds the wait for
a draining worker to go idle. Changes are kept across control-plane restarts when it has a
state file ([state] file) or Redis; otherwise every change says it is lost at restart."""

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_CONFLICT = 4
EXIT_UNAVAILABLE = 5
EXIT_TIMEOUT = 6
EXIT_REFUSED = 7


def exit_code(code_name: str) -> int:
    """A gRPC status (by name) as omni-ctl's exit status (see EPILOG)."""
    return {"INVALID_ARGUMENT": EXIT_USAGE, "OUT_OF_RANGE": EXIT_USAGE, "NOT_FOUND": EXIT_NOT_FOUND,
            "ALREADY_EXISTS": EXIT_CONFLICT, "FAILED_PRECONDITION": EXIT_CONFLICT, "ABORTED": EXIT_CONFLICT,
            "UNAVAILABLE": EXIT_UNAVAILABLE, "DEADLINE_EXCEEDED": EXIT_TIMEOUT,
            "UNAUTHENTICATED": EXIT_REFUSED, "PERMISSION_DENIED": EXIT_REFUSED}.get(code_name, EXIT_ERROR)


class _SplitTimeout(argparse.Action):
    """--timeout meant two things (per call, and drain --wait's limit): it is refused, naming both."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--timeout was split in two: --rpc-timeout SECONDS (each call to the control plane, "
                     "before the action) or drain --wait-timeout SECONDS (how long drain --wait waits)")


def _controlplane(text: str) -> str:
    """host:port (checked), or a gRPC target with a scheme (unix:, dns:, ipv4:, ipv6:) as is."""
    from omni_runtime import flags

    if text.strip().startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return text.strip()
    return flags.target(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}")
    return value


def _version() -> str:
    from omni_proxy import __version__

    return __version__


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"omni-ctl {_version()}")
    p.add_argument("--controlplane", type=_controlplane,
                   default=os.environ.get("OMNI_CONTROLPLANE", "127.0.0.1:50051"),
                   help="control plane gRPC address (default $OMNI_CONTROLPLANE or 127.0.0.1:50051)")
    p.add_argument("--token", default=os.environ.get("OMNI_TOKEN", ""),
                   help="admin token, sent as 'authorization: Bearer' (default $OMNI_TOKEN; prefer the variable: "
                        "a flag is visible to other users in ps)")
    p.add_argument("--tls-ca", default=os.environ.get("OMNI_TLS_CA", ""),
                   help="PEM CA of a control plane serving TLS (default $OMNI_TLS_CA)")
    p.add_argument("--tls-cert", default=os.environ.get("OMNI_TLS_CERT", ""),
                   help="client certificate (PEM) for mutual TLS (default $OMNI_TLS_CERT)")
    p.add_argument("--tls-key", default=os.environ.get("OMNI_TLS_KEY", ""),
                   help="its private key (PEM) (default $OMNI_TLS_KEY)")
    p.add_argument("--json", action="store_true", help="print JSON (typed values) instead of tables")
    p.add_argument("--rpc-timeout", type=_seconds, default=5.0, metavar="SECONDS",
                   help="limit of each call to the control plane (default 5; exit status 6 past it)")
    p.add_argument("--timeout", nargs="?", action=_SplitTimeout, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text, description=help_text)
        # --json also after the subcommand (omni-ctl workers --json)
        s.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
        return s

    w = command("workers", "list workers: role, model, health, weight, drain, load, KV usage, hit rates, "
                           "last error")
    w.add_argument("--model", default="", help="only workers serving this model")
    s = command("drain", "stop new placements to a worker; its in-flight requests finish")
    s.add_argument("worker_id", help="the worker's full id (omni-ctl workers)")
    s.add_argument("--wait", action="store_true", help="return once the worker has no request in flight")
    s.add_argument("--wait-timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="with --wait: give up after this many seconds (exit status 6)")
    s.add_argument("--timeout", nargs="?", action=_SplitTimeout, help=argparse.SUPPRESS)
    s.add_argument("--poll", type=_seconds, default=0.5, help="with --wait: seconds between checks")
    s = command("undrain", "resume placements to a drained worker")
    s.add_argument("worker_id")
    s = command("remove", "forget a worker (its in-flight requests are not stopped); the registrations of "
                          "its running engine plugin are refused until the engine restarts or is added again")
    s.add_argument("worker_id")
    s = command("weight", "set a worker's capacity weight: placement shares follow weights (0 parks it)")
    s.add_argument("worker_id")
    s.add_argument("weight", type=float)
    s = command("add", "add an engine by URL; the control plane checks it first (/health, /v1/models) and "
                       "adds nothing when the check fails, unless --force")
    s.add_argument("url", help="http(s)://host[:port]")
    s.add_argument("--role", choices=["both", "prefill", "decode"], default=None,
                   help="default both (with --replace: the worker's)")
    s.add_argument("--model", default="", help="served model (default: discovered from /v1/models)")
    s.add_argument("--weight", type=float, default=None, help="capacity weight (default 1; kept on --replace)")
    s.add_argument("--id", default="", help="worker id (default: derived from role and URL; with --replace: "
                                            "the id of the worker with this URL)")
    s.add_argument("--bootstrap-port", type=int, default=0, help="SGLang/Mooncake bootstrap port")
    s.add_argument("--kv-events", default="", help="the engine's ZMQ KV-event endpoint (tcp://host:port)")
    s.add_argument("--replace", action="store_true",
                   help="overwrite a worker with the same id or URL (refused otherwise); it keeps its id and "
                        "every field not given here (model, weight, drain, bootstrap port, KV events, labels)")
    s.add_argument("--force", action="store_true",
                   help="add even when the first check fails (no placements until a check passes)")
    command("stats", "placements, refusals, queue depth, data-plane sessions")
    s = command("explain", "dry-run a placement: per candidate its prefix match depth, load and score")
    s.add_argument("--model", default="")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a completions prompt (text)")
    src.add_argument("--messages", help="a JSON file with chat messages (a list, or {\"messages\": [...]})")
    src.add_argument("--prompt-tokens", type=int, default=None, help="only a token count (no prefix match)")
    s.add_argument("--tokenizer", default=os.environ.get("OMNI_TOKENIZER", ""),
                   help="model directory with tokenizer.json, as the data plane's --tokenizer "
                        "(default $OMNI_TOKENIZER)")
    s.add_argument("--chat-template", default="", help="chat template, as the data plane's --chat-template")
    s.add_argument("--max-tokens", type=int, default=0)
    s.add_argument("--leg", choices=["entry", "prefill", "decode"], default="entry")
    s = command("events", "per-worker KV-event rate, sequence gaps, last sequence number")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between the two samples of the rate")


# ---------------------------------------------------------------------------------------- values


def _enum(pb_enum, value: int, prefix: str) -> str:
    try:
        return pb_enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and num >= 0 else None


def worker_json(w) -> dict[str, Any]:
    """One WorkerInfo as typed JSON: numbers as numbers, enums as lower-case names."""
    from protos import omni_proxy_pb2 as pb

    ld = w.load
    return {
        "id": w.id, "url": w.url, "role": _enum(pb.Role, w.role, "ROLE_"), "model": w.model,
        "status": _enum(pb.WorkerStatus, w.status, "STATUS_"), "circuit": w.circuit or "closed",
        "ejected_for_s": round(w.ejected_for_s, 3), "draining": w.draining, "weight": w.weight,
        "source": w.source,
        "load": {"inflight_requests": ld.inflight_requests, "inflight_tokens": ld.inflight_tokens,
                 "prefill_tokens_pending": w.prefill_tokens_pending,
                 "engine_running": ld.engine_running if ld.engine_running >= 0 else None,
                 "engine_waiting": ld.engine_waiting if ld.engine_waiting >= 0 else None,
                 "engine_kv_usage": ld.engine_kv_usage if ld.engine_kv_usage >= 0 else None,
                 "metrics_age_s": ld.metrics_age_s if ld.metrics_age_s >= 0 else None},
        "placements_total": w.placements_total, "failures_total": w.failures_total,
        "cached_blocks": w.cached_blocks,
        "predicted_hit_blocks": w.predicted_hit_blocks, "query_blocks": w.query_blocks,
        "predicted_hit_rate": _ratio(w.predicted_hit_blocks, w.query_blocks),
        "engine_hit_rate": _ratio(w.engine_prefix_hits, w.engine_prefix_queries),
        "last_error": w.last_error, "labels": dict(w.labels), "bootstrap_port": w.bootstrap_port,
        "kv_events": w.kv_events,
        "engine": ({"block_size": w.engine.block_size, "prefix_caching": w.engine.prefix_caching,
                    "hash_algo": w.engine.hash_algo or None, "hash_seed_set": w.engine.hash_seed_set,
                    "kv_capacity_tokens": w.engine.kv_capacity_tokens,
                    "max_batched_tokens": w.engine.max_batched_tokens,
                    "kv_connector": w.engine.kv_connector or None, "kv_role": w.engine.kv_role or None,
                    "version": w.engine.engine_version or None} if w.HasField("engine") else None),
    }


def engine_cell(w) -> str:
    """The engine plugin's facts in a few words: block size, hashing, KV tokens, batch, connector."""
    if not w.HasField("engine"):
        return "-"
    e = w.engine
    parts = [f"blk {e.block_size}", f"{e.hash_algo or '?'}{' seeded' if e.hash_seed_set else ''}",
             f"KV {e.kv_capacity_tokens} tok", f"batch {e.max_batched_tokens}"]
    if e.kv_connector:
        parts.append(f"{e.kv_connector} {e.kv_role}".strip())
    return ", ".join(parts)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _console():
    """Tables never cut: off a terminal they get a wide line ($COLUMNS wins) and wrap cells."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(width=int(os.environ.get("COLUMNS", "0") or 0) or 250, soft_wrap=False)


def _table(title: str, columns: list[str], whole: dict[str, int] | None = None):
    """Cells wrap (fold) rather than being cut; columns in ``whole`` (ids, URLs) get at least
    that width, so an id an operator copies is never split (:func:`_show` checks)."""
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, overflow="fold", no_wrap=False, min_width=(whole or {}).get(col))
    return table


def _show(table, console=None, whole: tuple[str, ...] = ()) -> None:
    """Print ``table`` if it fits with every cell of the ``whole`` columns (ids, URLs) on one
    line; else one block per row (its first cell on a line of its own, then "column: value"
    lines), so no id is ever cut or folded, whatever the width."""
    import io

    from rich.console import Console

    console = console or _console()
    out = io.StringIO()
    trial = Console(file=out, width=console.width, soft_wrap=False, color_system=None)
    trial.print(table)
    lines = out.getvalue().splitlines()
    keep = [i for i, c in enumerate(table.columns) if str(c.header) in whole]
    values = [str(cell) for i in keep for cell in table.columns[i].cells]
    if all(len(line) <= console.width for line in lines) and all(any(v in line for line in lines) for v in values):
        console.print(table)
        return
    names = [str(c.header) for c in table.columns]
    cells = [[str(cell) for cell in c.cells] for c in table.columns]
    if table.title:
        print(str(table.title))
    for r in range(table.row_count):
        row = [col[r] if r < len(col) else "" for col in cells]
        print(f"{names[0]}: {row[0]}" if names[0] else row[0])
        for name, value in zip(names[1:], row[1:], strict=False):
            if value not in ("", "-"):
                print(f"  {name}: {value}")


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def print_workers(resp, as_json: bool) -> None:
    from protos import omni_proxy_pb2 as pb

    if as_json:
        _print_json({"policy": resp.policy, "workers": [worker_json(w) for w in resp.workers]})
        return
    table = _table(f"workers (policy {resp.policy})",
                   ["id", "role", "model", "health", "weight", "drain", "load req/tok", "prefill pending",
                    "engine run/wait", "KV use", "hit pred/engine", "placed/failed", "last error", "source", "engine",
                    "url"],
                   whole={"id": max((len(w.id) for w in resp.workers), default=2),
                          "url": max((len(w.url) for w in resp.workers), default=3)})
    for w in resp.workers:
        health = _enum(pb.WorkerStatus, w.status, "STATUS_")
        if w.circuit == "open":
            health += f", ejected {w.ejected_for_s:.0f}s"
        elif w.circuit == "half_open":
            health += ", half open"
        ld = w.load
        eng = f"{ld.engine_running}/{ld.engine_waiting}" if ld.engine_running >= 0 else "-"
        kv = f"{100 * ld.engine_kv_usage:.0f}%" if ld.engine_kv_usage >= 0 else "-"
        hits = (f"{_pct(_ratio(w.predicted_hit_blocks, w.query_blocks))}/"
                f"{_pct(_ratio(w.engine_prefix_hits, w.engine_prefix_queries))}")
        table.add_row(w.id, _enum(pb.Role, w.role, "ROLE_"), w.model or "?", health, f"{w.weight:g}",
                      "draining" if w.draining else "-", f"{ld.inflight_requests}/{ld.inflight_tokens}",
                      str(w.prefill_tokens_pending), eng, kv, hits, f"{w.placements_total}/{w.failures_total}",
                      w.last_error or "-", w.source, engine_cell(w), w.url)
    _show(table, whole=("id", "url"))


# ---------------------------------------------------------------------------------------- explain

_CANDIDATE = re.compile(r"^(?P<mark>[* ])(?P<id>\S+) score=(?P<score>-?[\d.]+(?:e-?\d+)?|nan|-?inf) "
                        r"\[(?P<scores>[^\]]*)\](?: match=(?P<match>\d+)/(?P<chain>\d+)blk)?"
                        r"(?: ttft=(?P<ttft>[\d.]+)ms tpot=(?P<tpot>[\d.]+)ms)? "
                        r"load=(?P<req>\d+)req/(?P<tok>\d+)tok/(?P<prefill>\d+)prefill$")
_DROPPED = re.compile(r"^-(?P<id>\S+) dropped by (?P<why>.*)$")


def parse_explanation(text: str) -> list[dict[str, Any]]:
    """The Explain RPC's text as stages (entry, decode), each with typed candidates."""
    stages = []
    for i, section in enumerate(text.split(" | ") if text else []):
        name = "entry"
        if i:
            name, _, section = section.partition(": ")
        stage: dict[str, Any] = {"stage": name, "policy": "", "candidates": [], "dropped": {}, "notes": []}
        for part in section.split("; "):
            if part.startswith("policy="):
                stage["policy"] = part[len("policy="):]
                continue
            m = _CANDIDATE.match(part)
            if m:
                scores = {}
                for kv in filter(None, m["scores"].split(",")):
                    k, _, v = kv.partition("=")
                    try:
                        scores[k] = float(v)
                    except ValueError:
                        scores[k] = v
                stage["candidates"].append({
                    "worker_id": m["id"], "chosen": m["mark"] == "*", "score": float(m["score"]), "scores": scores,
                    "match_blocks": int(m["match"]) if m["match"] else None,
                    "chain_blocks": int(m["chain"]) if m["chain"] else None,
                    "predicted_ttft_ms": float(m["ttft"]) if m["ttft"] else None,
                    "predicted_tpot_ms": float(m["tpot"]) if m["tpot"] else None,
                    "inflight_requests": int(m["req"]), "inflight_tokens": int(m["tok"]),
                    "prefill_tokens_pending": int(m["prefill"])})
                continue
            m = _DROPPED.match(part)
            if m:
                stage["dropped"][m["id"]] = m["why"]
            elif part:
                stage["notes"].append(part)
        stages.append(stage)
    return stages


def _prompt_tokens(args, kv_hash) -> tuple[int, list[int], str]:
    """(token count, block-hash chain, how it was counted), tokenized as the data plane does."""
    if args.prompt is None and args.messages is None:
        return (args.prompt_tokens if args.prompt_tokens is not None else 100), [], "given"
    body: dict[str, Any]
    if args.messages is not None:
        with open(args.messages) as f:
            data = json.load(f)
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list):
            raise ValueError(f"{args.messages}: expected a list of messages or {{\"messages\": [...]}}")
        body = {"messages": messages}
    else:
        body = {"prompt": args.prompt}
    if not args.tokenizer:
        text = args.prompt if args.prompt is not None else json.dumps(body["messages"])
        return max(len(text) // 4, 1), [], "estimated (no --tokenizer: no prefix match)"
    import asyncio

    from dataplane.prefix import PrefixHasher
    from dataplane.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.tokenizer, chat_template=args.chat_template or None)
    ids = (tok.encode_chat_request(body) if args.messages is not None
           else tok.encode_completion_request(body)[0])
    chain = asyncio.run(PrefixHasher().chain(kv_hash, ids, None)) if kv_hash.enabled else []
    how = "tokenized" + ("" if kv_hash.enabled else " (the policy does not use the prefix cache)")
    return len(ids), chain, how


def print_explain(p, stages, prompt_tokens: int, chain: list[int], how: str, block_size: int,
                  as_json: bool) -> None:
    from protos import omni_proxy_pb2 as pb

    chosen = {"prefill": p.prefill.worker_id or None, "decode": p.decode.worker_id or None}
    # Data-parallel workers: the rank placement chose (its reasons are the "dp_rank" stage's notes).
    ranks = {k: e.dp_rank for k, e in (("prefill", p.prefill), ("decode", p.decode)) if e.dp_size > 1}
    if as_json:
        _print_json({"flow": _enum(pb.Flow, p.flow, "FLOW_"), "chosen": chosen, "dp_ranks": ranks,
                     "error": _enum(pb.ErrorCode, p.error, "") if p.error else None,
                     "error_message": p.error_message or None, "prompt_tokens": prompt_tokens,
                     "prompt_tokens_source": how, "chain_blocks": len(chain), "block_size": block_size,
                     "stages": stages})
        return
    console = _console()
    if p.error:
        console.print(f"error: {pb.ErrorCode.Name(p.error)}: {p.error_message}")
    else:
        console.print(f"flow {_enum(pb.Flow, p.flow, 'FLOW_')} -> "
                      + ", ".join(f"{k} {v}" + (f" (dp rank {ranks[k]})" if k in ranks else "")
                                  for k, v in chosen.items() if v))
    console.print(f"prompt: {prompt_tokens} tokens ({how}), {len(chain)} blocks hashed")
    for st in stages:
        if st["stage"] == "dp_rank":
            for note in st["notes"]:
                console.print(f"dp rank: {note}")
            continue
        console.print(f"{st['stage']}: policy={st['policy']}, {len(st['candidates'])} candidates")
        table = _table(f"{st['stage']} candidates",
                       ["", "worker", "score", "match blocks", "match tokens", "load req/tok", "prefill pending",
                        "ttft/tpot ms", "scores"],
                       whole={"worker": max((len(c["worker_id"]) for c in st["candidates"]), default=6)})
        for c in st["candidates"]:
            mb = c["match_blocks"]
            table.add_row("*" if c["chosen"] else "", c["worker_id"], f"{c['score']:.3f}",
                          "-" if mb is None else f"{mb}/{c['chain_blocks']}",
                          "-" if mb is None else str(mb * block_size),
                          f"{c['inflight_requests']}/{c['inflight_tokens']}", str(c["prefill_tokens_pending"]),
                          "-" if c["predicted_ttft_ms"] is None else
                          f"{c['predicted_ttft_ms']:.0f}/{c['predicted_tpot_ms']:.1f}",
                          ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in c["scores"].items()))
        for wid, why in sorted(st["dropped"].items()):
            table.add_row("-", wid, "", "", "", "", "", "", f"dropped by {why}")
        _show(table, console, whole=("worker",))
        for note in st["notes"]:
            console.print(f"  {note}")


# ---------------------------------------------------------------------------------------- stats, events


def stats_json(s) -> dict[str, Any]:
    return {"policy": s.policy, "workers": s.workers, "routable_workers": s.routable_workers,
            "placements_by_leg": dict(s.placements_by_leg), "placements_by_worker": dict(s.placements_by_worker),
            "placements_total": sum(s.placements_by_leg.values()), "errors": dict(s.errors),
            "sessions": dict(s.sessions), "queue_depth": s.queue_depth if s.queue_depth >= 0 else None,
            "placement_count": s.placement_count,
            "placement_mean_ms": (1000 * s.placement_seconds_sum / s.placement_count) if s.placement_count else None,
            "kv_hash": {"enabled": s.kv_hash.enabled, "block_size": s.kv_hash.block_size, "algo": s.kv_hash.algo,
                        "seed": s.kv_hash.seed if s.kv_hash.seed_set else None}}


def print_stats(s, as_json: bool) -> None:
    d = stats_json(s)
    if as_json:
        _print_json(d)
        return
    table = _table(f"control plane (policy {s.policy})", ["what", "value"])
    table.add_row("workers (routable)", f"{s.workers} ({s.routable_workers})")
    table.add_row("placements", str(d["placements_total"]))
    for leg, n in sorted(s.placements_by_leg.items()):
        table.add_row(f"  {leg}", str(n))
    table.add_row("refused", str(sum(s.errors.values())))
    for code, n in sorted(s.errors.items()):
        table.add_row(f"  {code}", str(n))
    table.add_row("queue depth", "no queue stage" if d["queue_depth"] is None else str(d["queue_depth"]))
    opened, closed = s.sessions.get("opened", 0), s.sessions.get("closed", 0)
    table.add_row("data-plane sessions", f"{opened - closed} connected ({opened} opened, {closed} closed)")
    for event, n in sorted(s.sessions.items()):
        if event not in ("opened", "closed"):
            table.add_row(f"  {event}", str(n))
    if d["placement_mean_ms"] is not None:
        table.add_row("placement time (mean)", f"{d['placement_mean_ms']:.3f} ms")
    kh = d["kv_hash"]
    table.add_row("prefix hashing", f"{'on' if kh['enabled'] else 'off'} (block {kh['block_size']}, {kh['algo']}, "
                                    f"seed {kh['seed'] if kh['seed'] is not None else 'unset'})")
    _show(table)


def events_json(first, second, interval_s: float) -> list[dict[str, Any]]:
    before = {e.worker_id: e for e in first.events}
    out = []
    for e in second.events:
        c = dict(e.counters)
        prev = before.get(e.worker_id)
        received_before = prev.counters.get("received", 0) if prev is not None else c.get("received", 0)
        out.append({"worker_id": e.worker_id, "exact": e.exact, "untracked_reason": e.untracked_reason or None,
                    "rate_per_s": (c.get("received", 0) - received_before) / interval_s if interval_s > 0 else None,
                    "received": c.get("received", 0), "gaps": c.get("gaps", 0), "replayed": c.get("replayed", 0),
                    "resets": c.get("resets", 0), "gaps_too_large": c.get("gaps_too_large", 0),
                    "malformed": c.get("malformed", 0), "failed": c.get("failed", 0),
                    "last_seq": e.last_seq if e.last_seq >= 0 else None, "counters": c})
    return out


def print_events(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        _print_json({"workers": rows})
        return
    table = _table("KV events", ["worker", "tracking", "rate/s", "received", "gaps", "replayed", "resets",
                                 "last seq", "note"], whole={"worker": max((len(r["worker_id"]) for r in rows),
                                                                           default=6)})
    for r in rows:
        table.add_row(r["worker_id"], "exact" if r["exact"] else "approximate",
                      "-" if r["rate_per_s"] is None else f"{r['rate_per_s']:.1f}", str(r["received"]),
                      f"{r['gaps']} ({r['gaps_too_large']} too large)", str(r["replayed"]), str(r["resets"]),
                      "-" if r["last_seq"] is None else str(r["last_seq"]), r["untracked_reason"] or "")
    _show(table, whole=("worker",))


# ---------------------------------------------------------------------------------------- run


def check_url(url: str) -> str:
    """http(s)://host[:port] (http:// added when missing), as the control plane checks it."""
    from urllib.parse import urlsplit

    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"not a URL: {url!r} (the port must be a number from 1 to 65535)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or \
            any(c.isspace() for c in text) or (parts.path not in ("", "/")) or parts.query or parts.fragment:
        raise ValueError(f"not an engine URL: {url!r} (expected http(s)://host[:port])")
    return text.rstrip("/")


def run(args: argparse.Namespace) -> int:
    import grpc

    from protos import omni_proxy_pb2 as pb
    from protos import omni_proxy_pb2_grpc as pb_grpc

    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    as_json = args.json
    if args.tls_ca or args.tls_cert or args.tls_key:
        def read(path: str) -> bytes | None:
            with open(path, "rb") as f:
                return f.read()

        try:
            creds = grpc.ssl_channel_credentials(root_certificates=read(args.tls_ca) if args.tls_ca else None,
                                                 private_key=read(args.tls_key) if args.tls_key else None,
                                                 certificate_chain=read(args.tls_cert) if args.tls_cert else None)
        except OSError as exc:
            print(f"omni-ctl: TLS: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
        channel = grpc.secure_channel(args.controlplane, creds)
    else:
        channel = grpc.insecure_channel(args.controlplane)
    admin = pb_grpc.AdminStub(channel)
    t = args.rpc_timeout

    def call(method, request):
        return method(request, timeout=t, metadata=metadata)

    def show_worker(w, what: str, persistence: str | None = None, **extra) -> None:
        if as_json:
            out = {**worker_json(w), **extra}
            if persistence is not None:
                out["persistence"] = persistence or None
            _print_json(out)
        else:
            print(f"{w.id}: {what}")
        if persistence == "":
            print("omni-ctl: note: this control plane keeps operators' changes in memory only: this one is lost "
                  "when it restarts (set [state] file / --state-file, or use the redis store)", file=sys.stderr)

    try:
        if args.action == "workers":
            print_workers(call(admin.ListWorkers, pb.ListWorkersRequest(model=args.model)), as_json)
        elif args.action == "drain":
            resp = call(admin.Drain, pb.WorkerRef(worker_id=args.worker_id))
            w = resp.worker
            if not args.wait:
                show_worker(w, f"draining ({w.load.inflight_requests} in flight)", resp.persistence)
                return 0
            deadline = time.monotonic() + args.wait_timeout
            while w.load.inflight_requests > 0 and time.monotonic() < deadline:
                time.sleep(max(min(args.poll, deadline - time.monotonic()), 0.0))
                listed = {x.id: x for x in call(admin.ListWorkers, pb.ListWorkersRequest()).workers}
                if args.worker_id not in listed:
                    print(f"{args.worker_id}: removed while draining", file=sys.stderr)
                    return EXIT_ERROR
                w = listed[args.worker_id]
            idle = w.load.inflight_requests == 0
            show_worker(w, "drained, idle" if idle else
                        f"still {w.load.inflight_requests} in flight after {args.wait_timeout:g}s", resp.persistence)
            return 0 if idle else EXIT_TIMEOUT
        elif args.action == "undrain":
            resp = call(admin.Undrain, pb.WorkerRef(worker_id=args.worker_id))
            show_worker(resp.worker, "undrained", resp.persistence)
        elif args.action == "weight":
            resp = call(admin.SetWeight, pb.SetWeightRequest(worker_id=args.worker_id, weight=args.weight))
            show_worker(resp.worker, f"weight {resp.worker.weight:g}", resp.persistence)
        elif args.action == "remove":
            resp = call(admin.RemoveWorker, pb.WorkerRef(worker_id=args.worker_id))
            fence = ("; this engine's registrations are refused until it restarts or is added again "
                     f"(omni-ctl add {resp.worker.url})" if resp.worker.source == "registry" else "")
            show_worker(resp.worker, f"removed{fence}", resp.persistence, removed=True)
        elif args.action == "add":
            try:
                url = check_url(args.url)
            except ValueError as exc:
                print(f"omni-ctl: {exc}", file=sys.stderr)
                return EXIT_USAGE
            role = {None: pb.ROLE_UNSPECIFIED, "both": pb.ROLE_BOTH, "prefill": pb.ROLE_PREFILL,
                    "decode": pb.ROLE_DECODE}[args.role]
            resp = call(admin.AddWorker, pb.RegisterRequest(
                url=url, role=role, model=args.model, weight=args.weight or 0.0, worker_id=args.id,
                bootstrap_port=args.bootstrap_port, kv_events=args.kv_events, replace=args.replace,
                require_check=not args.force))
            w = resp.worker
            check = ("passed its first check" if resp.checked and not resp.check_error else
                     f"first check failed: {resp.check_error} (no placements until a check passes)"
                     if resp.checked else "first check still running")
            show_worker(w, f"{'replaced' if args.replace else 'added'} ({w.url}, {_enum(pb.Role, w.role, 'ROLE_')}); "
                           f"{check}", resp.persistence, checked=resp.checked, check_error=resp.check_error or None)
        elif args.action == "stats":
            print_stats(call(admin.Stats, pb.StatsRequest()), as_json)
        elif args.action == "events":
            first = call(admin.Stats, pb.StatsRequest())
            start = time.monotonic()
            time.sleep(max(args.interval, 0.0))
            second = call(admin.Stats, pb.StatsRequest())
            print_events(events_json(first, second, time.monotonic() - start), as_json)
        elif args.action == "explain":
            try:
                stats = call(admin.Stats, pb.StatsRequest())
            except grpc.RpcError as exc:   # an older control plane: no hashing settings to read
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                stats = pb.StatsResponse()
            try:
                prompt_tokens, chain, how = _prompt_tokens(args, stats.kv_hash)
            except (OSError, ValueError) as exc:
                print(f"omni-ctl: explain: {exc}", file=sys.stderr)
                return EXIT_USAGE
            leg = {"entry": pb.LEG_ENTRY, "prefill": pb.LEG_PREFILL, "decode": pb.LEG_DECODE}[args.leg]
            p = call(admin.Explain, pb.PlaceRequest(request_id="explain", model=args.model, leg=leg,
                                                    prompt_tokens=prompt_tokens, max_tokens=args.max_tokens,
                                                    block_hashes=chain, explain=True))
            print_explain(p, parse_explanation(p.explanation), prompt_tokens, chain, how,
                          stats.kv_hash.block_size or 16, as_json)
            return EXIT_ERROR if p.error else 0
    except grpc.RpcError as exc:
        print(f"omni-ctl: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return exit_code(exc.code().name)
    finally:
        channel.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-ctl", description=__doc__.splitlines()[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args(argv)))
