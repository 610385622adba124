"""``omni-proxy sim``: run one simulated vLLM engine.

Only argparse is imported at module level: ``omni-proxy`` builds every subcommand's
parser on each start, and the server stack is loaded by ``run`` alone.
"""

from __future__ import annotations

import argparse

from omni_runtime import flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    from omni_runtime.logs import add_log_arguments

    add_log_arguments(g, level=False)
    g.add_argument("--host", type=flags.host, default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=flags.port, default=0, help="HTTP port; 0 picks a free one (default 0)")
    g.add_argument("--ready-file", default=None,
                   help="write {pid, port, bootstrap_port, model, role, engine_id, kv_events_port, "
                        "kv_replay_port, ...} as JSON here once listening")
    g.add_argument("--model", default="sim-model", help="served model name (default sim-model)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="as vLLM's: LoRA adapters served besides the model, listed in /v1/models with "
                        "their parent and path, their requests' blocks hashed with the adapter's key")
    g.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="both = aggregated; prefill = kv_producer; decode = kv_consumer (default both)")
    g.add_argument("--engine-id", default=None, help="engine id put in kv_transfer_params (default: random uuid)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated text (default 0)")
    g.add_argument("--api-key", default="", help="as vLLM's: /v1/* requests need this Bearer token")
    c = parser.add_argument_group("cost model")
    c.add_argument("--prefill-ms-per-token", type=flags.number(0, 1e6), default=0.05, help="default 0.05")
    c.add_argument("--decode-ms-per-step", type=flags.number(0, 1e6), default=4.0,
                   help="fixed cost of a step that decodes anything (default 4.0)")
    c.add_argument("--decode-ms-per-seq", type=flags.number(0, 1e6), default=0.05,
                   help="extra step time per decoding sequence (default 0.05)")
    c.add_argument("--kv-transfer-ms-per-token", type=flags.number(0, 1e6), default=0.005,
                   help="decode-side time to pull one prompt token's KV (default 0.005)")
    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=flags.count(1, 1 << 20), default=64,
                   help="running batch size cap (default 64)")
    s.add_argument("--max-num-batched-tokens", type=flags.count(1, 1 << 30), default=8192,
                   help="per-step token budget; longer prompts prefill in chunks (default 8192)")
    s.add_argument("--dp-size", type=flags.count(1, 1024), default=1,
                   help="data-parallel ranks in this process (vLLM --data-parallel-size; default 1)")
    s.add_argument("--dp-barrier", action=argparse.BooleanOptionalAction, default=True,
                   help="DP ranks step together, each step lasting the slowest rank's, as with DP attention "
                        "before MoE layers (vLLM, SGLang); --no-dp-barrier: independent ranks (default on)")
    s.add_argument("--max-model-len", type=flags.count(1, 1 << 30), default=32768, help="default 32768")
    s.add_argument("--default-max-tokens", type=flags.count(1, 1 << 30), default=16,
                   help="max_tokens when a request gives none (default 16)")
    s.add_argument("--block-size", type=flags.count(1, 4096), default=16, help="KV block size in tokens (default 16)")
    s.add_argument("--num-gpu-blocks", type=flags.count(1, 1 << 30), default=32768,
                   help="KV pool size in blocks; when full, admission waits and decodes preempt (default 32768)")
    s.add_argument("--kv-lease-s", type=flags.seconds, default=30.0,
                   help="how long a prefill node keeps KV for a decode node to pull (default 30)")
    k = parser.add_argument_group("parallel / layerwise PD")
    k.add_argument("--bootstrap-port", type=flags.port, default=0,
                   help="port serving /sim/bootstrap/pull, i.e. the bootstrap_port a proxy puts in requests; "
                        "0 = the HTTP port (default 0)")
    k.add_argument("--bootstrap-timeout-s", type=flags.seconds, default=30.0,
                   help="how long a prefill node holds a bootstrap room's KV waiting for its decode peer, "
                        "and how long a decode node's fetch waits for the prefill (default 30)")
    k.add_argument("--metaserver-timeout-s", type=flags.seconds, default=60.0,
                   help="layerwise decode: how long to wait for the metaserver's answer (default 60)")
    p = parser.add_argument_group("prefix caching (vLLM's flags; PYTHONHASHSEED is read from the environment)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached full KV blocks across requests (default on)")
    p.add_argument("--prefix-caching-hash-algo", default="sha256",
                   choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"), help="block hash (default sha256)")
    p.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=True,
                   help="usage.prompt_tokens_details.cached_tokens when some prompt tokens were cached "
                        "(default on; vLLM's default is off)")
    e = parser.add_argument_group("KV events (vLLM's ZmqEventPublisher)")
    e.add_argument("--kv-events-endpoint", default=None,
                   help="PUB endpoint, e.g. tcp://*:5557 (binds: has * or ::, or ipc:// / inproc://; "
                        "otherwise connects); port 0 or * (tcp://*:0, tcp://127.0.0.1:0, tcp://127.0.0.1:*) "
                        "binds a free port, reported as kv_events_port in the ready file; off when not given")
    e.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ROUTER endpoint for replay (always binds), e.g. tcp://*:5558, or tcp://127.0.0.1:0 "
                        "for a free port, reported as kv_replay_port in the ready file")
    e.add_argument("--kv-events-topic", default="", help="first frame of every message (default empty)")
    e.add_argument("--kv-events-buffer-steps", type=flags.count(0, 1 << 30), default=10_000,
                   help="batches kept for replay (default 10000)")
    e.add_argument("--kv-events-format", choices=("map", "array"), default="map",
                   help="map = vLLM >= v0.26 (0.32): events as maps, replay frames with the topic; "
                        "array = older vLLM: positional events, replay frames without it (default map)")
    e.add_argument("--kv-events-config", default=None,
                   help="vLLM's JSON form, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                        "\"tcp://*:5557\"}'; its endpoint, replay_endpoint, topic, buffer_steps and hwm "
                        "fill the flags above")
    t = parser.add_argument_group("API-server tokenization cost")
    t.add_argument("--tokenize-us-per-char", type=flags.number(0, 1e6), default=0.4,
                   help="microseconds of real time per character of a text prompt (chat is always text), spent "
                        "before the engine queue; token-id prompts skip it (default 0.4)")
    t.add_argument("--tokenize-workers", type=flags.count(1, 1024), default=1,
                   help="text prompts tokenized at once (default 1, like vLLM's single tokenizer thread)")


def _kv_events_kwargs(args: argparse.Namespace) -> dict:
    import json

    kw = dict(kv_events_endpoint=args.kv_events_endpoint, kv_events_replay_endpoint=args.kv_events_replay_endpoint,
              kv_events_topic=args.kv_events_topic, kv_events_buffer_steps=args.kv_events_buffer_steps,
              kv_events_format=args.kv_events_format)
    if args.kv_events_config:
        try:
            conf = json.loads(args.kv_events_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(conf, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        if conf.get("enable_kv_cache_events") and conf.get("publisher", "zmq") == "zmq":
            kw["kv_events_endpoint"] = conf.get("endpoint", "tcp://*:5557")
            kw["kv_events_replay_endpoint"] = conf.get("replay_endpoint")
            kw["kv_events_topic"] = conf.get("topic", "")
            kw["kv_events_buffer_steps"] = conf.get("buffer_steps", 10_000)
            kw["kv_events_hwm"] = conf.get("hwm", 100_000)
    return kw


def _lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise SystemExit(f"--lora-modules: expected NAME=PATH, got {spec!r}")
        out.append((name.strip(), path.strip()))
    return tuple(out)


def config_from_args(args: argparse.Namespace):
    import os

    from simulator.config import SimConfig

    kwargs = dict(
        host=args.host, port=args.port, model=args.model, lora_modules=_lora_modules(args.lora_modules),
        role=args.role, seed=args.seed, api_key=args.api_key,
        prefill_ms_per_token=args.prefill_ms_per_token, decode_ms_per_step=args.decode_ms_per_step,
        decode_ms_per_seq=args.decode_ms_per_seq, kv_transfer_ms_per_token=args.kv_transfer_ms_per_token,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, default_max_tokens=args.default_max_tokens,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks, kv_lease_s=args.kv_lease_s,
        bootstrap_port=args.bootstrap_port, bootstrap_timeout_s=args.bootstrap_timeout_s,
        metaserver_timeout_s=args.metaserver_timeout_s,
        enable_prefix_caching=args.enable_prefix_caching, prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        python_hash_seed=os.environ.get("PYTHONHASHSEED"),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_events_int_hashes=os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in ("0", ""),
        tokenize_us_per_char=args.tokenize_us_per_char, tokenize_workers=args.tokenize_workers,
        dp_size=args.dp_size, dp_barrier=args.dp_barrier,
        **_kv_events_kwargs(args),
    )
    if args.engine_id:
        kwargs["engine_id"] = args.engine_id
    return SimConfig(**kwargs)


def run(args: argparse.Namespace) -> int:
    import sys

    from omni_runtime import StartupError, run_main
    from omni_runtime.logs import configure as configure_logging
    from simulator.server import serve

    configure_logging("INFO", args.log_format)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"omni-proxy sim: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        import zmq

        try:
            await serve(cfg, args.ready_file)
        except (OSError, zmq.ZMQError) as exc:  # a port in use: one line, not a traceback
            raise StartupError(f"cannot listen (--host/--port, --bootstrap-port or --kv-events-*): {exc}") from None

    run_main(main, "omni-proxy sim")
    return 0
