"""Read an engine's facts from vLLM's own objects (the API server's VllmConfig and args).

Only attribute reads with defaults, so a vLLM version that renamed something yields an
empty fact instead of an error.
"""

from __future__ import annotations

import os

from engine_plugins.vllm_plugin.agent import EngineFacts


def _get(obj, *path, default=None):
    for name in path:
        if obj is None:
            return default
        obj = getattr(obj, name, None)
    return default if obj is None else obj


def _as_str(value) -> str:
    if value is None:
        return ""
    value = getattr(value, "value", value)          # enums
    return str(value)


def facts_from_vllm(vllm_config, args, sock=None) -> EngineFacts:
    """``vllm_config``: engine_client.vllm_config (after the engines started, so the KV block
    count is known); ``args``: the serve arguments; ``sock``: the bound HTTP socket."""
    port = int(_get(args, "port", default=0) or 0)
    if sock is not None:
        try:
            port = int(sock.getsockname()[1])
        except (OSError, IndexError, TypeError):
            pass
    host = _get(args, "host", default="") or ""
    models = _get(args, "served_model_name", default=None)
    if isinstance(models, str):
        models = [models]
    if not models:
        name = _get(vllm_config, "model_config", "served_model_name", default=None)
        name = name or _get(vllm_config, "model_config", "model", default="")
        models = [name] if isinstance(name, str) else list(name)
    cache = _get(vllm_config, "cache_config")
    block_size = int(_get(cache, "block_size", default=0) or 0)
    gpu_blocks = int(_get(cache, "num_gpu_blocks", default=0) or 0)
    events_cfg = _get(vllm_config, "kv_events_config")
    events_on = bool(_get(events_cfg, "enable_kv_cache_events", default=False)) and \
        _as_str(_get(events_cfg, "publisher", default="zmq")) not in ("", "null")
    transfer = _get(vllm_config, "kv_transfer_config")
    parallel = _get(vllm_config, "parallel_config")
    try:
        import vllm
        version = f"vllm {vllm.__version__}"
    except Exception:  # noqa: BLE001
        version = "vllm"
    return EngineFacts(
        host=host, port=port, models=[m for m in models if m],
        block_size=block_size,
        prefix_caching=bool(_get(cache, "enable_prefix_caching", default=False)),
        hash_algo=_as_str(_get(cache, "prefix_caching_hash_algo", default="")),
        hash_seed=os.environ.get("PYTHONHASHSEED"),
        kv_events=_as_str(_get(events_cfg, "endpoint", default="")) if events_on else "",
        kv_replay=_as_str(_get(events_cfg, "replay_endpoint", default="")) if events_on else "",
        dp_size=int(_get(parallel, "data_parallel_size", default=1) or 1),
        kv_connector=_as_str(_get(transfer, "kv_connector", default="")),
        kv_role=_as_str(_get(transfer, "kv_role", default="")),
        kv_capacity_tokens=gpu_blocks * block_size,
        max_batched_tokens=int(_get(vllm_config, "scheduler_config", "max_num_batched_tokens", default=0) or 0),
        max_num_seqs=int(_get(vllm_config, "scheduler_config", "max_num_seqs", default=0) or 0),
        engine_version=version,
        tls=bool(_get(args, "ssl_certfile", default=None)),
    )
