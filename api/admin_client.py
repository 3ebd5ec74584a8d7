"""A blocking client for ``pdserve.v1.Admin`` (``admin.proto``): the pools behind a router.

```python
from pdserve.api.admin_client import AdminClient
with AdminClient("127.0.0.1:50051") as admin:
    for pool in admin.get_pools():
        print(pool.role, pool.target, pool.ready)
    admin.drain_worker("decode-1")      # leaves routing, finishes its streams, exits
    admin.set_pool_target("decode", 3)  # the pool manager starts one more
```

Replies are the proto messages; :func:`worker_dict` and :func:`pool_dict` turn them into the
plain dicts ``pdserve status --json`` prints. Every failure is a ``PdserveError`` with the
gRPC code (NOT_FOUND for an unknown worker, UNAVAILABLE when the router cannot be reached).
"""

from __future__ import annotations

import json

import grpc

from pdserve.api import admin_pb2, admin_pb2_grpc
from pdserve.api.client import ClientTLS, PdserveError, auth_metadata, open_channel

__all__ = ["AdminClient", "worker_dict", "pool_dict", "state_name", "trace_dict",
           "control_plane_dict"]


def state_name(state: int) -> str:
    """``WORKER_STATE_READY`` -> "ready" ("unspecified" for 0)."""
    return admin_pb2.WorkerState.Name(state).removeprefix("WORKER_STATE_").lower()


def worker_dict(worker: admin_pb2.Worker) -> dict:
    """One worker as ``pdserve status --json`` prints it."""
    return {
        "worker_id": worker.worker_id, "role": worker.role, "node": worker.node,
        "pid": worker.pid, "state": state_name(worker.state), "running": worker.running,
        "waiting": worker.waiting, "kv_used_blocks": worker.kv_used_blocks,
        "kv_total_blocks": worker.kv_total_blocks,
        "heartbeat_age_s": (round(worker.heartbeat_age_s, 3)
                            if worker.HasField("heartbeat_age_s") else None),
        "restarts": worker.restarts,
        "compute_utilization": round(worker.compute_utilization, 4),
        "bandwidth_utilization": round(worker.bandwidth_utilization, 4),
        "busy_fraction": round(worker.busy_fraction, 4), "binding": worker.binding,
        "device": _ledger(worker).get("device", ""),
        "torch_threads": _ledger(worker).get("num_threads", 0),
        "tensor_parallel_size": _ledger(worker).get("tensor_parallel_size", 1),
        "kv_int8": _ledger(worker).get("kv_int8", ""),  # scheme, calibration, start-up check
        "lora_slots": worker.lora_slots, "lora_resident": list(worker.lora_resident),
        "kv_host_blocks": worker.kv_host_blocks, "kv_disk_blocks": worker.kv_disk_blocks,
    }


def _ledger(worker: admin_pb2.Worker) -> dict:
    """The worker's memory ledger ({} before its first heartbeat)."""

    try:
        return json.loads(worker.ledger_json or "{}")
    except ValueError:
        return {}


def trace_dict(trace: admin_pb2.RequestTrace) -> dict:
    """One request's trace (seconds), keyed like ``pdserve.router.trace.RequestTrace``."""
    return {"request_id": trace.request_id, "ttft": trace.ttft_s, "e2e": trace.e2e_s,
            "queue": trace.queue_s, "prefill": trace.prefill_s, "transfer": trace.transfer_s,
            "decode": trace.decode_s, "num_prompt_tokens": trace.prompt_tokens,
            "num_output_tokens": trace.output_tokens,
            "finish_reason": trace.finish_reason or None, "num_retries": trace.retries,
            "num_migrations": trace.migrations,
            "prefill_location": trace.prefill_location or None,
            "prefill_worker": trace.prefill_worker or None,
            "decode_worker": trace.decode_worker or None, "adapter": trace.adapter or None,
            "prefill_adapter_source": trace.prefill_adapter_source or None,
            "decode_adapter_source": trace.decode_adapter_source or None,
            "prefix_source": _prefix_source(trace, "prefix_source"),
            "decode_prefix_source": _prefix_source(trace, "decode_prefix_source")}


def _prefix_source(trace: admin_pb2.RequestTrace, name: str) -> dict | None:
    """{pool_tokens, host_tokens, disk_tokens, load_s} of a trace's prefix source, or None."""
    if not trace.HasField(name):
        return None
    source = getattr(trace, name)
    return {"pool_tokens": source.pool_tokens, "host_tokens": source.host_tokens,
            "disk_tokens": source.disk_tokens, "load_s": source.load_s}


def pool_dict(pool: admin_pb2.Pool) -> dict:
    """One pool as ``pdserve status --json`` prints it (under its role)."""
    return {"target": pool.target, "actual": pool.actual, "ready": pool.ready,
            "starting": pool.starting, "draining": pool.draining, "restarts": pool.restarts,
            "last_error": pool.last_error}


def control_plane_dict(plane: admin_pb2.ControlPlane) -> dict:
    """The control plane as ``pdserve status --json`` prints it (under "control_plane")."""
    return {"degraded": plane.degraded, "degraded_for_s": round(plane.degraded_for_s, 3),
            "error": plane.error, "malformed_records": plane.malformed_records,
            "repairs": plane.repairs}


class AdminClient:
    """``with AdminClient("host:port") as admin: admin.list_workers()``; ``timeout`` (seconds)
    is each call's deadline."""

    def __init__(self, target: str, *, timeout: float | None = 10.0, api_key: str | None = None,
                 tls: ClientTLS | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)  # (a server with an admin key needs it)
        self._channel = open_channel(target, tls)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout,
                                               metadata=self._metadata)
        except grpc.RpcError as exc:
            raise PdserveError(exc.code(), exc.details() or "") from None

    def list_workers(self) -> list[admin_pb2.Worker]:
        return list(self._call("ListWorkers", admin_pb2.ListWorkersRequest()).workers)

    def get_pools(self) -> list[admin_pb2.Pool]:
        return list(self._call("GetPools", admin_pb2.GetPoolsRequest()).pools)

    def drain_worker(self, worker_id: str) -> admin_pb2.Worker:
        return self._call("DrainWorker", admin_pb2.DrainWorkerRequest(worker_id=worker_id))

    def set_pool_target(self, role: str, size: int) -> admin_pb2.Pool:
        return self._call("SetPoolTarget", admin_pb2.SetPoolTargetRequest(role=role, size=size))

    def get_traces(self, request_ids: list[str] | None = None,
                   limit: int = 0) -> list[admin_pb2.RequestTrace]:
        """The router's traces of ``request_ids`` (those it still keeps), or its latest
        ``limit`` (0: 1000)."""
        request = admin_pb2.GetTracesRequest(request_ids=list(request_ids or ()), limit=limit)
        return list(self._call("GetTraces", request).traces)

    def get_control_plane(self) -> admin_pb2.ControlPlane:
        """Whether the router reaches Redis (``GetControlPlane``)."""
        return self._call("GetControlPlane", admin_pb2.GetControlPlaneRequest())

    def get_config(self) -> dict:
        """Each pool's engine settings and the router's (``GetConfig``)."""
        return json.loads(self._call("GetConfig", admin_pb2.GetConfigRequest()).config_json)

    def load_lora_adapter(self, name: str, path: str) -> admin_pb2.LoraAdapter:
        """Register the PEFT folder ``path`` (as the workers see it) under ``name``."""
        request = admin_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return self._call("LoadLoraAdapter", request)

    def unload_lora_adapter(self, name: str) -> admin_pb2.LoraAdapter:
        """Unregister an adapter: new requests for it are refused, those in flight finish."""
        return self._call("UnloadLoraAdapter", admin_pb2.UnloadLoraAdapterRequest(lora_name=name))

    def list_lora_adapters(self) -> list[admin_pb2.LoraAdapter]:
        return list(self._call("ListLoraAdapters", admin_pb2.ListLoraAdaptersRequest()).adapters)
