"""Simulator settings, shared by the CLI, the HTTP server and the cost model.

One frozen dataclass so a running sim can report exactly what it models (``/sim/state``)
and so tests can build an engine in-process with the same knobs the CLI exposes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")
KV_EVENT_FORMATS: tuple[str, ...] = ("map", "array")


@dataclass(frozen=True)
class SimConfig:
    """What one simulated engine serves and how long its work takes."""

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    # LoRA adapters served besides the model, (name, path), as vLLM's --lora-modules: a
    # request naming one is served, and its blocks hash with the adapter's key.
    lora_modules: tuple[tuple[str, str], ...] = ()
    role: Role = "both"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    # Cost model (milliseconds). A step costs decode_ms_per_step if it decodes anything,
    # plus decode_ms_per_seq per decoding sequence, plus prefill_ms_per_token per prompt token.
    prefill_ms_per_token: float = 0.05
    decode_ms_per_step: float = 4.0
    decode_ms_per_seq: float = 0.05
    kv_transfer_ms_per_token: float = 0.005
    # Scheduler limits, named like vLLM's.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    default_max_tokens: int = 16
    block_size: int = 16
    # KV pool: 32768 blocks x 16 tokens ~ 512k tokens, a mid-size model on one 80 GB GPU.
    num_gpu_blocks: int = 32768
    kv_lease_s: float = 30.0
    # Parallel (bootstrap) PD: the port D fetches KV from (0 = the HTTP port) and how long a
    # prefill node holds a room's KV for its decode peer (and a fetch waits for its prefill).
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = 30.0
    # Layerwise PD (D first): how long a decode node waits for the metaserver's answer.
    metaserver_timeout_s: float = 60.0
    seed: int = 0
    # vLLM's --api-key: requests to /v1/* must carry "Authorization: Bearer <key>".
    api_key: str = ""
    # Automatic prefix caching, named like vLLM's flags. ``python_hash_seed`` is what vLLM reads
    # from PYTHONHASHSEED (None = unset: vLLM's fixed fallback for sha256*, random for xxhash*).
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    python_hash_seed: str | None = None
    # usage.prompt_tokens_details.cached_tokens in responses (vLLM: --enable-prompt-tokens-details).
    enable_prompt_tokens_details: bool = True
    # KV events (vLLM's --kv-events-config for the zmq publisher); off without an endpoint.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000
    # map = vLLM >= v0.26 (events as msgpack maps, replay frames carry the topic, as in 0.32);
    # array = older vLLM (positional events, replay frames without the topic).
    kv_events_format: str = "map"
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 64-bit ints (default) or raw digests in events.
    kv_events_int_hashes: bool = True
    # API-server tokenization, modelled as real time before the engine queue: text prompts
    # only, ``tokenize_workers`` prompts at a time (vLLM's async tokenizer runs one thread).
    tokenize_us_per_char: float = 0.4
    tokenize_workers: int = 1
    # Data parallelism (vLLM --data-parallel-size): this many ranks in one process, each with
    # its own scheduler and KV pool; a request names its rank by the X-data-parallel-rank
    # header (vLLM) or routed_dp_rank / data_parallel_rank in the body (SGLang), else round robin.
    # Rank r publishes KV events on the endpoint's port + r, its batches carrying the rank.
    dp_size: int = 1
    # With dp_size > 1: the ranks step together, a step lasting as long as the slowest rank's
    # (DP attention before expert-parallel MoE layers: vLLM's DPEngineCoreProc, SGLang's
    # --enable-dp-attention; see simulator.dp_barrier). False: independent ranks (dense models).
    dp_barrier: bool = True

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "default_max_tokens", "block_size", "num_gpu_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("prefill_ms_per_token", "decode_ms_per_step", "decode_ms_per_seq",
                     "kv_transfer_ms_per_token", "kv_lease_s", "bootstrap_timeout_s",
                     "metaserver_timeout_s", "tokenize_us_per_char"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("tokenize_workers", "kv_events_buffer_steps", "kv_events_hwm", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        from kvhash.hashing import HASH_ALGOS
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.kv_events_format not in KV_EVENT_FORMATS:
            raise ValueError(f"kv_events_format must be one of {KV_EVENT_FORMATS}, got {self.kv_events_format!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            ep = getattr(self, name)
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a tcp://, ipc:// or inproc:// zmq endpoint, got {ep!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if not 0 <= self.bootstrap_port <= 65535:
            raise ValueError("bootstrap_port must be in 0..65535")
        # A request that can never fit in the KV pool would sit at the head of the queue forever.
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"KV pool too small: num_gpu_blocks*block_size = {self.num_gpu_blocks * self.block_size} "
                f"tokens < max_model_len {self.max_model_len}")

    @property
    def advertised_host(self) -> str:
        """The host a decode node should dial back; a wildcard bind is not dialable."""
        return "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
