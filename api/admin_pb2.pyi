from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DEAD: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DEAD: WorkerState

class Worker(_message.Message):
    __slots__ = ("worker_id", "role", "node", "pid", "state", "running", "waiting", "kv_used_blocks", "kv_total_blocks", "heartbeat_age_s", "restarts", "error", "compute_utilization", "bandwidth_utilization", "busy_fraction", "binding", "ledger_json", "prefix_hit_tokens", "prefix_query_tokens", "lora_slots", "lora_resident", "kv_host_blocks", "kv_disk_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    LEDGER_JSON_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    node: str
    pid: int
    state: WorkerState
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    heartbeat_age_s: float
    restarts: int
    error: str
    compute_utilization: float
    bandwidth_utilization: float
    busy_fraction: float
    binding: str
    ledger_json: str
    prefix_hit_tokens: int
    prefix_query_tokens: int
    lora_slots: int
    lora_resident: _containers.RepeatedScalarFieldContainer[str]
    kv_host_blocks: int
    kv_disk_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., restarts: _Optional[int] = ..., error: _Optional[str] = ..., compute_utilization: _Optional[float] = ..., bandwidth_utilization: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., binding: _Optional[str] = ..., ledger_json: _Optional[str] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., lora_slots: _Optional[int] = ..., lora_resident: _Optional[_Iterable[str]] = ..., kv_host_blocks: _Optional[int] = ..., kv_disk_blocks: _Optional[int] = ...) -> None: ...

class RequestTrace(_message.Message):
    __slots__ = ("request_id", "ttft_s", "e2e_s", "queue_s", "prefill_s", "transfer_s", "decode_s", "prompt_tokens", "output_tokens", "finish_reason", "retries", "migrations", "prefill_location", "prefill_worker", "decode_worker", "adapter", "prefill_adapter_source", "decode_adapter_source", "prefix_source", "decode_prefix_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADAPTER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADAPTER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ttft_s: float
    e2e_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    decode_s: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    retries: int
    migrations: int
    prefill_location: str
    prefill_worker: str
    decode_worker: str
    adapter: str
    prefill_adapter_source: str
    decode_adapter_source: str
    prefix_source: PrefixSource
    decode_prefix_source: PrefixSource
    def __init__(self, request_id: _Optional[str] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., retries: _Optional[int] = ..., migrations: _Optional[int] = ..., prefill_location: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., adapter: _Optional[str] = ..., prefill_adapter_source: _Optional[str] = ..., decode_adapter_source: _Optional[str] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ..., decode_prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("pool_tokens", "host_tokens", "disk_tokens", "load_s")
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    pool_tokens: int
    host_tokens: int
    disk_tokens: int
    load_s: float
    def __init__(self, pool_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., disk_tokens: _Optional[int] = ..., load_s: _Optional[float] = ...) -> None: ...

class GetTracesRequest(_message.Message):
    __slots__ = ("request_ids", "limit")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    limit: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., limit: _Optional[int] = ...) -> None: ...

class GetTracesResponse(_message.Message):
    __slots__ = ("traces",)
    TRACES_FIELD_NUMBER: _ClassVar[int]
    traces: _containers.RepeatedCompositeFieldContainer[RequestTrace]
    def __init__(self, traces: _Optional[_Iterable[_Union[RequestTrace, _Mapping]]] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetControlPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlPlane(_message.Message):
    __slots__ = ("degraded", "degraded_for_s", "error", "malformed_records", "repairs")
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_FIELD_NUMBER: _ClassVar[int]
    degraded: bool
    degraded_for_s: float
    error: str
    malformed_records: int
    repairs: int
    def __init__(self, degraded: _Optional[bool] = ..., degraded_for_s: _Optional[float] = ..., error: _Optional[str] = ..., malformed_records: _Optional[int] = ..., repairs: _Optional[int] = ...) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("config_json",)
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    def __init__(self, config_json: _Optional[str] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("role", "target", "actual", "ready", "starting", "draining", "restarts", "last_error")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    role: str
    target: int
    actual: int
    ready: int
    starting: int
    draining: int
    restarts: int
    last_error: str
    def __init__(self, role: _Optional[str] = ..., target: _Optional[int] = ..., actual: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., draining: _Optional[int] = ..., restarts: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class GetPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ...) -> None: ...

class SetPoolTargetRequest(_message.Message):
    __slots__ = ("role", "size")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    role: str
    size: int
    def __init__(self, role: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...
