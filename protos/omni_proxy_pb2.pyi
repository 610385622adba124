from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class WorkerStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNKNOWN: _ClassVar[WorkerStatus]
    STATUS_HEALTHY: _ClassVar[WorkerStatus]
    STATUS_UNHEALTHY: _ClassVar[WorkerStatus]

class Leg(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEG_UNSPECIFIED: _ClassVar[Leg]
    LEG_ENTRY: _ClassVar[Leg]
    LEG_PREFILL: _ClassVar[Leg]
    LEG_DECODE: _ClassVar[Leg]

class Flow(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOW_UNSPECIFIED: _ClassVar[Flow]
    FLOW_AGGREGATED: _ClassVar[Flow]
    FLOW_SEQUENTIAL: _ClassVar[Flow]
    FLOW_PARALLEL: _ClassVar[Flow]
    FLOW_LAYERWISE: _ClassVar[Flow]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[ErrorCode]
    NO_HEALTHY_WORKER: _ClassVar[ErrorCode]
    UNKNOWN_MODEL: _ClassVar[ErrorCode]
    INVALID_REQUEST: _ClassVar[ErrorCode]
    UNKNOWN_REQUEST: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    OVERLOADED: _ClassVar[ErrorCode]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_PREFILL_DONE: _ClassVar[EventKind]
    EVENT_FIRST_TOKEN: _ClassVar[EventKind]
    EVENT_FINISHED: _ClassVar[EventKind]
    EVENT_FAILED: _ClassVar[EventKind]
    EVENT_CANCELLED: _ClassVar[EventKind]
    EVENT_LEG_FAILED: _ClassVar[EventKind]
ROLE_UNSPECIFIED: Role
ROLE_BOTH: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
STATUS_UNKNOWN: WorkerStatus
STATUS_HEALTHY: WorkerStatus
STATUS_UNHEALTHY: WorkerStatus
LEG_UNSPECIFIED: Leg
LEG_ENTRY: Leg
LEG_PREFILL: Leg
LEG_DECODE: Leg
FLOW_UNSPECIFIED: Flow
FLOW_AGGREGATED: Flow
FLOW_SEQUENTIAL: Flow
FLOW_PARALLEL: Flow
FLOW_LAYERWISE: Flow
OK: ErrorCode
NO_HEALTHY_WORKER: ErrorCode
UNKNOWN_MODEL: ErrorCode
INVALID_REQUEST: ErrorCode
UNKNOWN_REQUEST: ErrorCode
INTERNAL: ErrorCode
OVERLOADED: ErrorCode
EVENT_UNSPECIFIED: EventKind
EVENT_PREFILL_DONE: EventKind
EVENT_FIRST_TOKEN: EventKind
EVENT_FINISHED: EventKind
EVENT_FAILED: EventKind
EVENT_CANCELLED: EventKind
EVENT_LEG_FAILED: EventKind

class Endpoint(_message.Message):
    __slots__ = ("worker_id", "url", "role", "bootstrap_port", "dp_rank", "dp_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    url: str
    role: Role
    bootstrap_port: int
    dp_rank: int
    dp_size: int
    def __init__(self, worker_id: _Optional[str] = ..., url: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., bootstrap_port: _Optional[int] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("inflight_requests", "inflight_tokens", "engine_running", "engine_waiting", "engine_kv_usage", "metrics_age_s")
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WAITING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    inflight_requests: int
    inflight_tokens: int
    engine_running: int
    engine_waiting: int
    engine_kv_usage: float
    metrics_age_s: float
    def __init__(self, inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., engine_running: _Optional[int] = ..., engine_waiting: _Optional[int] = ..., engine_kv_usage: _Optional[float] = ..., metrics_age_s: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("id", "url", "role", "model", "weight", "status", "draining", "load", "source", "placements_total", "failures_total", "last_error", "labels", "bootstrap_port", "kv_events", "cached_blocks", "circuit", "ejected_for_s", "prefill_tokens_pending", "predicted_hit_blocks", "query_blocks", "engine_prefix_hits", "engine_prefix_queries", "engine")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PENDING_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    id: str
    url: str
    role: Role
    model: str
    weight: float
    status: WorkerStatus
    draining: bool
    load: WorkerLoad
    source: str
    placements_total: int
    failures_total: int
    last_error: str
    labels: _containers.ScalarMap[str, str]
    bootstrap_port: int
    kv_events: str
    cached_blocks: int
    circuit: str
    ejected_for_s: float
    prefill_tokens_pending: int
    predicted_hit_blocks: int
    query_blocks: int
    engine_prefix_hits: float
    engine_prefix_queries: float
    engine: EngineFacts
    def __init__(self, id: _Optional[str] = ..., url: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., model: _Optional[str] = ..., weight: _Optional[float] = ..., status: _Optional[_Union[WorkerStatus, str]] = ..., draining: _Optional[bool] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., source: _Optional[str] = ..., placements_total: _Optional[int] = ..., failures_total: _Optional[int] = ..., last_error: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., bootstrap_port: _Optional[int] = ..., kv_events: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., circuit: _Optional[str] = ..., ejected_for_s: _Optional[float] = ..., prefill_tokens_pending: _Optional[int] = ..., predicted_hit_blocks: _Optional[int] = ..., query_blocks: _Optional[int] = ..., engine_prefix_hits: _Optional[float] = ..., engine_prefix_queries: _Optional[float] = ..., engine: _Optional[_Union[EngineFacts, _Mapping]] = ...) -> None: ...

class EngineFacts(_message.Message):
    __slots__ = ("block_size", "prefix_caching", "hash_algo", "hash_seed", "hash_seed_set", "kv_capacity_tokens", "max_batched_tokens", "kv_connector", "kv_role", "engine_version")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_SET_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    prefix_caching: bool
    hash_algo: str
    hash_seed: str
    hash_seed_set: bool
    kv_capacity_tokens: int
    max_batched_tokens: int
    kv_connector: str
    kv_role: str
    engine_version: str
    def __init__(self, block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., hash_algo: _Optional[str] = ..., hash_seed: _Optional[str] = ..., hash_seed_set: _Optional[bool] = ..., kv_capacity_tokens: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., kv_connector: _Optional[str] = ..., kv_role: _Optional[str] = ..., engine_version: _Optional[str] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("seq", "request_id", "model", "leg", "prompt_tokens", "max_tokens", "exclude_workers", "explain", "body", "path", "engine_request_id", "num_prompts", "block_hashes", "ttft_slo_ms", "tpot_slo_ms", "trace_headers", "placed_on", "ended")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    PLACED_ON_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    request_id: str
    model: str
    leg: Leg
    prompt_tokens: int
    max_tokens: int
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    explain: bool
    body: bytes
    path: str
    engine_request_id: str
    num_prompts: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    ttft_slo_ms: float
    tpot_slo_ms: float
    trace_headers: _containers.ScalarMap[str, str]
    placed_on: str
    ended: LifecycleEvent
    def __init__(self, seq: _Optional[int] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., leg: _Optional[_Union[Leg, str]] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., explain: _Optional[bool] = ..., body: _Optional[bytes] = ..., path: _Optional[str] = ..., engine_request_id: _Optional[str] = ..., num_prompts: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., ttft_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., placed_on: _Optional[str] = ..., ended: _Optional[_Union[LifecycleEvent, _Mapping]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("seq", "request_id", "flow", "prefill", "decode", "explanation", "error", "error_message", "metaserver_url", "retry_after_s", "queued_ms")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METASERVER_URL_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    request_id: str
    flow: Flow
    prefill: Endpoint
    decode: Endpoint
    explanation: str
    error: ErrorCode
    error_message: str
    metaserver_url: str
    retry_after_s: float
    queued_ms: float
    def __init__(self, seq: _Optional[int] = ..., request_id: _Optional[str] = ..., flow: _Optional[_Union[Flow, str]] = ..., prefill: _Optional[_Union[Endpoint, _Mapping]] = ..., decode: _Optional[_Union[Endpoint, _Mapping]] = ..., explanation: _Optional[str] = ..., error: _Optional[_Union[ErrorCode, str]] = ..., error_message: _Optional[str] = ..., metaserver_url: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., queued_ms: _Optional[float] = ...) -> None: ...

class LifecycleEvent(_message.Message):
    __slots__ = ("request_id", "kind", "worker_id", "prompt_tokens", "completion_tokens", "ttft_ms", "latency_ms", "message", "upstream_status", "streamed", "retry_after_s", "first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_STATUS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: EventKind
    worker_id: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    latency_ms: float
    message: str
    upstream_status: int
    streamed: bool
    retry_after_s: float
    first_token: bool
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., latency_ms: _Optional[float] = ..., message: _Optional[str] = ..., upstream_status: _Optional[int] = ..., streamed: _Optional[bool] = ..., retry_after_s: _Optional[float] = ..., first_token: _Optional[bool] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("node_id", "live_requests", "batches", "token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    live_requests: _containers.RepeatedScalarFieldContainer[str]
    batches: bool
    token: str
    def __init__(self, node_id: _Optional[str] = ..., live_requests: _Optional[_Iterable[str]] = ..., batches: _Optional[bool] = ..., token: _Optional[str] = ...) -> None: ...

class DataPlaneMessage(_message.Message):
    __slots__ = ("open", "place", "event", "batch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    place: PlaceRequest
    event: LifecycleEvent
    batch: DataPlaneBatch
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., place: _Optional[_Union[PlaceRequest, _Mapping]] = ..., event: _Optional[_Union[LifecycleEvent, _Mapping]] = ..., batch: _Optional[_Union[DataPlaneBatch, _Mapping]] = ...) -> None: ...

class DataPlaneBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[DataPlaneMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[DataPlaneMessage, _Mapping]]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("pd_flow", "parallel_protocol", "kv_hash", "batches", "local_placement", "folds_first_token", "folds_placement")
    PD_FLOW_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    KV_HASH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    FOLDS_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FOLDS_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    pd_flow: Flow
    parallel_protocol: str
    kv_hash: KVHashConfig
    batches: bool
    local_placement: bool
    folds_first_token: bool
    folds_placement: bool
    def __init__(self, pd_flow: _Optional[_Union[Flow, str]] = ..., parallel_protocol: _Optional[str] = ..., kv_hash: _Optional[_Union[KVHashConfig, _Mapping]] = ..., batches: _Optional[bool] = ..., local_placement: _Optional[bool] = ..., folds_first_token: _Optional[bool] = ..., folds_placement: _Optional[bool] = ...) -> None: ...

class KVHashConfig(_message.Message):
    __slots__ = ("enabled", "block_size", "algo", "seed", "seed_set", "lora_key_format")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALGO_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_SET_FIELD_NUMBER: _ClassVar[int]
    LORA_KEY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    block_size: int
    algo: str
    seed: str
    seed_set: bool
    lora_key_format: str
    def __init__(self, enabled: _Optional[bool] = ..., block_size: _Optional[int] = ..., algo: _Optional[str] = ..., seed: _Optional[str] = ..., seed_set: _Optional[bool] = ..., lora_key_format: _Optional[str] = ...) -> None: ...

class FleetSnapshot(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[KnownWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[KnownWorker, _Mapping]]] = ...) -> None: ...

class KnownWorker(_message.Message):
    __slots__ = ("endpoint", "model", "loras", "weight")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    model: str
    loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    weight: float
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., model: _Optional[str] = ..., loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., weight: _Optional[float] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ControlPlaneMessage(_message.Message):
    __slots__ = ("placement", "info", "fleet", "batch", "refused")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    info: SessionInfo
    fleet: FleetSnapshot
    batch: ControlPlaneBatch
    refused: str
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., info: _Optional[_Union[SessionInfo, _Mapping]] = ..., fleet: _Optional[_Union[FleetSnapshot, _Mapping]] = ..., batch: _Optional[_Union[ControlPlaneBatch, _Mapping]] = ..., refused: _Optional[str] = ...) -> None: ...

class SessionEndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEndpoint(_message.Message):
    __slots__ = ("port", "tls")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    port: int
    tls: bool
    def __init__(self, port: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class ControlPlaneBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ControlPlaneMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ControlPlaneMessage, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "healthy_workers", "workers", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    healthy_workers: int
    workers: int
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., healthy_workers: _Optional[int] = ..., workers: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("url", "role", "model", "weight", "worker_id", "labels", "bootstrap_port", "heartbeat_ttl_s", "kv_events", "kv_replay", "dp_size", "replace", "require_check", "engine", "owner_key")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_REPLAY_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_CHECK_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    url: str
    role: Role
    model: str
    weight: float
    worker_id: str
    labels: _containers.ScalarMap[str, str]
    bootstrap_port: int
    heartbeat_ttl_s: float
    kv_events: str
    kv_replay: str
    dp_size: int
    replace: bool
    require_check: bool
    engine: EngineFacts
    owner_key: str
    def __init__(self, url: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., model: _Optional[str] = ..., weight: _Optional[float] = ..., worker_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., bootstrap_port: _Optional[int] = ..., heartbeat_ttl_s: _Optional[float] = ..., kv_events: _Optional[str] = ..., kv_replay: _Optional[str] = ..., dp_size: _Optional[int] = ..., replace: _Optional[bool] = ..., require_check: _Optional[bool] = ..., engine: _Optional[_Union[EngineFacts, _Mapping]] = ..., owner_key: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "owner_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    owner_key: str
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., owner_key: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "running", "waiting", "owner_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running: int
    waiting: int
    owner_key: str
    def __init__(self, worker_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., owner_key: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "owner_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    owner_key: str
    def __init__(self, worker_id: _Optional[str] = ..., owner_key: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "policy")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    policy: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., policy: _Optional[str] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class SetWeightRequest(_message.Message):
    __slots__ = ("worker_id", "weight")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    weight: float
    def __init__(self, worker_id: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class WorkerResponse(_message.Message):
    __slots__ = ("worker", "check_error", "checked", "persistence")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CHECK_ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    PERSISTENCE_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    check_error: str
    checked: bool
    persistence: str
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., check_error: _Optional[str] = ..., checked: _Optional[bool] = ..., persistence: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerEvents(_message.Message):
    __slots__ = ("worker_id", "counters", "last_seq", "exact", "untracked_reason")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    UNTRACKED_REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    counters: _containers.ScalarMap[str, int]
    last_seq: int
    exact: bool
    untracked_reason: str
    def __init__(self, worker_id: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., last_seq: _Optional[int] = ..., exact: _Optional[bool] = ..., untracked_reason: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("policy", "placements_by_leg", "placements_by_worker", "errors", "sessions", "queue_depth", "kv_hash", "events", "workers", "routable_workers", "placement_count", "placement_seconds_sum")
    class PlacementsByLegEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PlacementsByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SessionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_BY_LEG_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_HASH_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    policy: str
    placements_by_leg: _containers.ScalarMap[str, int]
    placements_by_worker: _containers.ScalarMap[str, int]
    errors: _containers.ScalarMap[str, int]
    sessions: _containers.ScalarMap[str, int]
    queue_depth: int
    kv_hash: KVHashConfig
    events: _containers.RepeatedCompositeFieldContainer[WorkerEvents]
    workers: int
    routable_workers: int
    placement_count: int
    placement_seconds_sum: float
    def __init__(self, policy: _Optional[str] = ..., placements_by_leg: _Optional[_Mapping[str, int]] = ..., placements_by_worker: _Optional[_Mapping[str, int]] = ..., errors: _Optional[_Mapping[str, int]] = ..., sessions: _Optional[_Mapping[str, int]] = ..., queue_depth: _Optional[int] = ..., kv_hash: _Optional[_Union[KVHashConfig, _Mapping]] = ..., events: _Optional[_Iterable[_Union[WorkerEvents, _Mapping]]] = ..., workers: _Optional[int] = ..., routable_workers: _Optional[int] = ..., placement_count: _Optional[int] = ..., placement_seconds_sum: _Optional[float] = ...) -> None: ...
