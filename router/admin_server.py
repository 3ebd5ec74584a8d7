"""The operator front door: ``pdserve.v1.Admin`` (``api/admin.proto``) over an ``AdminBackend``.

It shares the router's ``grpc.aio`` server (``GenerationServer(admin=...)``). The backend is
whatever owns the pools; ``pdserve.cluster`` implements it with its pool manager and the
Redis registry, so this module knows neither Ray nor Redis. Every RPC is one backend call:

* ``ListWorkers`` -> ``list_workers()``; ``GetPools`` -> ``get_pools()``;
* ``DrainWorker`` -> ``drain_worker(worker_id)``: NOT_FOUND for an unknown id
  (:class:`UnknownWorkerError`), FAILED_PRECONDITION for a dead one (:class:`WorkerDeadError`);
* ``SetPoolTarget`` -> ``set_pool_target(role, size)``: INVALID_ARGUMENT on ``ValueError``
  (``size`` < 0 here; above the cluster's ``--max-workers-per-pool`` in the backend);
* ``GetTraces`` -> ``traces(request_ids, limit)``, ``GetConfig`` -> ``config()`` and
  ``GetControlPlane`` -> ``control_plane()``, optional (UNIMPLEMENTED for a backend without
  them);
* ``LoadLoraAdapter`` -> ``load_lora_adapter(name, path)``, ``UnloadLoraAdapter`` ->
  ``unload_lora_adapter(name)``, ``ListLoraAdapters`` -> ``list_lora_adapters()``, optional
  likewise: INVALID_ARGUMENT for an adapter the backend refuses (``ValueError`` naming it),
  NOT_FOUND for an unknown name (:class:`UnknownAdapterError`), FAILED_PRECONDITION without
  LoRA (:class:`LoraDisabledError`). The HTTP door's ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` call the same backend methods.

Every input is bounded before the backend sees it (INVALID_ARGUMENT naming the field): ids and
roles of at most :data:`MAX_NAME_CHARS` characters, at most :data:`MAX_TRACE_IDS` request ids
and a ``limit`` of at most :data:`MAX_TRACE_LIMIT`. Anything else a backend raises is INTERNAL
(logged with its traceback). Who may call is ``pdserve.router.auth``'s business (the admin
key, or a loopback caller).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Protocol

import grpc

from pdserve.api import admin_pb2, admin_pb2_grpc
from pdserve.router.pairing import DecodeRouting, PrefillRouting
from pdserve.router.trace import RequestTrace
from pdserve.worker_api import PrefixSource
from pdserve.worker_api.adapters import AdapterRef

logger = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
WORKER_STATES = ("starting", "ready", "draining", "dead")
_STATE_PB = {state: admin_pb2.WorkerState.Value(f"WORKER_STATE_{state.upper()}")
             for state in WORKER_STATES}
MAX_NAME_CHARS = 128  # a worker_id or role longer than this names nothing
MAX_TRACE_IDS = 10_000  # request ids one GetTraces may ask for
MAX_TRACE_LIMIT = 100_000  # GetTraces' limit, at most
MAX_ADAPTER_NAME_CHARS = 256  # an adapter's name (AdapterRef's bound)
MAX_PATH_CHARS = 4096  # an adapter's folder


class UnknownWorkerError(LookupError):
    """No worker has this id."""


class AdminUnavailableError(Exception):
    """The component that answers this Admin call cannot be reached now (try again)."""


class WorkerDeadError(Exception):
    """The worker is dead: it cannot be drained (the pool manager replaces it)."""


class UnknownAdapterError(LookupError):
    """No LoRA adapter is registered under this name."""


class LoraDisabledError(Exception):
    """The server runs without LoRA (``--enable-lora``): it registers no adapter."""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as an operator sees it (``pdserve status``)."""

    worker_id: str  # e.g. "decode-3"
    role: str  # "prefill" | "decode" | "colocated"
    state: str  # "starting" | "ready" | "draining" | "dead"
    node: str = ""  # IP address of its node ("" until known)
    pid: int = 0  # OS process id on that node (0 until known)
    running: int = 0  # requests in its running batch
    waiting: int = 0  # requests queued or reservations waiting for KV
    kv_used_blocks: int = 0  # KV blocks owned by requests or reservations
    kv_total_blocks: int = 0  # KV blocks in its pool
    heartbeat_age_s: float | None = None  # seconds since its last heartbeat (None: none yet)
    restarts: int = 0  # dead workers its pool slot replaced before it
    error: str = ""  # why it died, or its engine loop's error
    compute_utilization: float = 0.0  # achieved FLOP/s / measured matmul peak (recent steps)
    bandwidth_utilization: float = 0.0  # achieved bytes/s / measured copy bandwidth
    busy_fraction: float = 0.0  # forward seconds / wall seconds (recent steps)
    binding: str = ""  # "compute" | "bandwidth" | "idle" ("" unknown)
    ledger: dict = dataclasses.field(default_factory=dict, hash=False)  # MemoryLedger.to_dict()
    prefix_hit_tokens: int = 0  # prompt tokens its prefix cache served (a counter)
    prefix_query_tokens: int = 0  # prompt tokens it looked up there (a counter)
    lora_slots: int = 0  # LoRA adapter slots in its model (0: it serves no adapters)
    lora_resident: tuple[str, ...] = ()  # digests of the adapters in a slot
    kv_host_blocks: int = 0  # KV blocks it holds in host memory (docs/kv-tiers.md)
    kv_disk_blocks: int = 0  # KV blocks it holds on its disk

    def __post_init__(self) -> None:
        if self.state not in WORKER_STATES:
            raise ValueError(f"state must be one of {WORKER_STATES}, got {self.state!r}")


@dataclass(frozen=True)
class PoolInfo:
    """One pool's target and actual size."""

    role: str  # "prefill" | "decode" | "colocated"
    target: int  # the size the pool manager keeps
    actual: int  # starting + ready workers
    ready: int  # workers taking requests
    starting: int  # workers not ready yet
    draining: int  # workers finishing their streams (not in actual)
    restarts: int  # dead workers replaced (a counter)
    last_error: str = ""  # why the latest failed start failed


@dataclass(frozen=True)
class ControlPlaneInfo:
    """Whether the router reaches the cluster's shared state (Redis)."""

    degraded: bool  # Redis unreachable now: routing goes on with the workers it knows
    degraded_for_s: float = 0.0  # how long it has been (0 when not degraded)
    error: str = ""  # the latest Redis error while degraded
    malformed_records: int = 0  # records skipped because they did not parse (a counter)
    repairs: int = 0  # values put back after Redis lost or spoiled them (a counter)


class AdminBackend(Protocol):
    async def list_workers(self) -> list[WorkerInfo]: ...

    async def drain_worker(self, worker_id: str) -> WorkerInfo: ...

    async def get_pools(self) -> list[PoolInfo]: ...

    async def set_pool_target(self, role: str, size: int) -> PoolInfo: ...

    # Optional (UNIMPLEMENTED without them):
    # async def traces(self, request_ids: list[str], limit: int) -> list[RequestTrace]
    # async def config(self) -> dict  (JSON-serializable)
    # async def control_plane(self) -> ControlPlaneInfo
    # async def load_lora_adapter(self, name: str, path: str) -> AdapterRef
    # async def unload_lora_adapter(self, name: str) -> AdapterRef
    # async def list_lora_adapters(self) -> list[AdapterRef]


# WorkerInfo fields the proto's Worker carries under another name or in another form: (its
# field, the value it takes); it carries every other one under its own name, as it is, and
# leaves an optional one unset for None.
WORKER_PB_ENCODED = {
    "state": ("state", _STATE_PB.__getitem__),
    "ledger": ("ledger_json", lambda ledger: json.dumps(ledger, sort_keys=True)),
}


def worker_pb(info: WorkerInfo) -> admin_pb2.Worker:
    values = {}
    for f in dataclasses.fields(info):
        name, encode = WORKER_PB_ENCODED.get(f.name, (f.name, None))
        value = getattr(info, f.name)
        if value is not None:
            values[name] = value if encode is None else encode(value)
    return admin_pb2.Worker(**values)


def trace_pb(trace: RequestTrace) -> admin_pb2.RequestTrace:
    prefill, decode = trace.prefill_routing, trace.decode_routing
    return admin_pb2.RequestTrace(
        request_id=trace.request_id, ttft_s=trace.ttft, e2e_s=trace.e2e, queue_s=trace.queue,
        prefill_s=trace.prefill, transfer_s=trace.transfer, decode_s=trace.decode,
        prompt_tokens=trace.num_prompt_tokens, output_tokens=trace.num_output_tokens,
        finish_reason=trace.finish_reason or "", retries=trace.num_retries,
        migrations=trace.num_migrations,
        prefill_location=trace.prefill_location.location if trace.prefill_location else "",
        prefill_worker=prefill.worker_id if prefill else "",
        decode_worker=decode.worker_id if decode else "", adapter=trace.adapter or "",
        prefill_adapter_source=_adapter_source(prefill),
        decode_adapter_source=_adapter_source(decode),
        prefix_source=_prefix_source_pb(trace.prefix_source),
        decode_prefix_source=_prefix_source_pb(trace.decode_prefix_source))


def _prefix_source_pb(source: PrefixSource | None) -> admin_pb2.PrefixSource | None:
    if source is None:
        return None
    return admin_pb2.PrefixSource(pool_tokens=source.pool_tokens, host_tokens=source.host_tokens,
                                  disk_tokens=source.disk_tokens, load_s=source.load_s)


def _adapter_source(routing: PrefillRouting | DecodeRouting | None) -> str:
    """Where the request's adapter was on the routed worker ("": no adapter, no worker)."""
    return routing.adapter.source if routing is not None and routing.adapter is not None else ""


def pool_pb(info: PoolInfo) -> admin_pb2.Pool:
    return admin_pb2.Pool(role=info.role, target=info.target, actual=info.actual,
                          ready=info.ready, starting=info.starting, draining=info.draining,
                          restarts=info.restarts, last_error=info.last_error)


_STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (UnknownWorkerError, grpc.StatusCode.NOT_FOUND),
    (UnknownAdapterError, grpc.StatusCode.NOT_FOUND),
    (WorkerDeadError, grpc.StatusCode.FAILED_PRECONDITION),
    (LoraDisabledError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdminUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def _check_name(field: str, value: str) -> None:
    if not value:
        raise ValueError(f"{field} must be set")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{field} must be at most {MAX_NAME_CHARS} characters, got "
                         f"{len(value)}")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, what: str) -> None:
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            logger.info("%s: %s %s", what, code.name, exc)
            await context.abort(code, str(exc))
    logger.error("%s failed", what, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Implements ``pdserve.v1.Admin`` against an :class:`AdminBackend`."""

    def __init__(self, backend: AdminBackend) -> None:
        self._backend = backend

    async def ListWorkers(self, request, context):
        try:
            workers = await self._backend.list_workers()
        except Exception as exc:
            await _abort(context, exc, "ListWorkers")
        return admin_pb2.ListWorkersResponse(workers=[worker_pb(w) for w in workers])

    async def DrainWorker(self, request, context):
        try:
            _check_name("worker_id", request.worker_id)
            worker = await self._backend.drain_worker(request.worker_id)
        except Exception as exc:
            await _abort(context, exc, f"DrainWorker {request.worker_id[:MAX_NAME_CHARS]!r}")
        return worker_pb(worker)

    async def GetPools(self, request, context):
        try:
            pools = await self._backend.get_pools()
        except Exception as exc:
            await _abort(context, exc, "GetPools")
        return admin_pb2.GetPoolsResponse(pools=[pool_pb(p) for p in pools])

    async def SetPoolTarget(self, request, context):
        try:
            _check_name("role", request.role)
            if request.size < 0:
                raise ValueError(f"size must be >= 0, got {request.size}")
            pool = await self._backend.set_pool_target(request.role, int(request.size))
        except Exception as exc:
            await _abort(context, exc, f"SetPoolTarget {request.role[:MAX_NAME_CHARS]!r}")
        return pool_pb(pool)

    async def GetTraces(self, request, context):
        if not hasattr(self._backend, "traces"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server keeps no traces")
        try:
            if not 0 <= request.limit <= MAX_TRACE_LIMIT:
                raise ValueError(f"limit must be in [0, {MAX_TRACE_LIMIT}], got {request.limit}")
            if len(request.request_ids) > MAX_TRACE_IDS:
                raise ValueError(f"request_ids must hold at most {MAX_TRACE_IDS} ids, got "
                                 f"{len(request.request_ids)}")
            traces = await self._backend.traces(list(request.request_ids),
                                                int(request.limit) or 1000)
        except Exception as exc:
            await _abort(context, exc, "GetTraces")
        return admin_pb2.GetTracesResponse(traces=[trace_pb(t) for t in traces])

    async def GetConfig(self, request, context):
        if not hasattr(self._backend, "config"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server shares no config")
        try:
            config = await self._backend.config()
        except Exception as exc:
            await _abort(context, exc, "GetConfig")
        return admin_pb2.GetConfigResponse(config_json=json.dumps(config, sort_keys=True))

    async def GetControlPlane(self, request, context):
        if not hasattr(self._backend, "control_plane"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no control "
                                                               "plane to report")
        try:
            info = await self._backend.control_plane()
        except Exception as exc:
            await _abort(context, exc, "GetControlPlane")
        return admin_pb2.ControlPlane(degraded=info.degraded,
                                      degraded_for_s=info.degraded_for_s, error=info.error,
                                      malformed_records=info.malformed_records,
                                      repairs=info.repairs)


    async def LoadLoraAdapter(self, request, context):
        await self._check_lora(context)
        try:
            _check_lora_name(request.lora_name)
            if not request.lora_path or len(request.lora_path) > MAX_PATH_CHARS:
                raise ValueError(f"lora_path must be set, at most {MAX_PATH_CHARS} characters")
            adapter = await self._backend.load_lora_adapter(request.lora_name,
                                                            request.lora_path)
        except Exception as exc:
            await _abort(context, exc, f"LoadLoraAdapter {request.lora_name[:MAX_NAME_CHARS]!r}")
        return adapter_pb(adapter)

    async def UnloadLoraAdapter(self, request, context):
        await self._check_lora(context)
        try:
            _check_lora_name(request.lora_name)
            adapter = await self._backend.unload_lora_adapter(request.lora_name)
        except Exception as exc:
            await _abort(context, exc,
                         f"UnloadLoraAdapter {request.lora_name[:MAX_NAME_CHARS]!r}")
        return adapter_pb(adapter)

    async def ListLoraAdapters(self, request, context):
        await self._check_lora(context)
        try:
            adapters = await self._backend.list_lora_adapters()
        except Exception as exc:
            await _abort(context, exc, "ListLoraAdapters")
        return admin_pb2.ListLoraAdaptersResponse(adapters=[adapter_pb(a) for a in adapters])

    async def _check_lora(self, context: grpc.aio.ServicerContext) -> None:
        if not hasattr(self._backend, "load_lora_adapter"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this server keeps no LoRA adapter registry")


def _check_lora_name(name: str) -> None:
    if not name:
        raise ValueError("lora_name must be set")
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        raise ValueError(f"lora_name must be at most {MAX_ADAPTER_NAME_CHARS} characters, "
                         f"got {len(name)}")


def adapter_pb(adapter: AdapterRef) -> admin_pb2.LoraAdapter:
    return admin_pb2.LoraAdapter(name=adapter.name, path=adapter.path, digest=adapter.digest)


def add_admin_service(server: grpc.aio.Server, backend: AdminBackend) -> str:
    """Serve ``pdserve.v1.Admin`` on ``server``; returns the service's full name."""
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(backend), server)
    return ADMIN_SERVICE_NAME
