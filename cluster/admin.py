"""The Admin service's backend in a cluster: the pool manager and the Redis registry.

Implements ``pdserve.router.admin_server.AdminBackend`` in the router actor's process: workers
are the pool manager's members (and the dead ones it removed recently), with load and
heartbeat age from the registry (the latest records the manager read while Redis is
unreachable); pools are the manager's targets (Redis holds their copy) with the members
counted; traces are the router's, the config is each pool's engine settings (secrets hidden)
and the router's, the control plane is whether Redis answers
(``pdserve.cluster.control_plane``), and LoRA adapters are the cluster's registry
(``pdserve.cluster.adapters``).

Only the first router ("router") runs the pool manager. Every other router serves Admin too,
through :class:`ForwardingAdmin`: pools, workers, drains, targets, config, control plane and
adapter loads are asked of the first router's actor, so a Service that spreads operators over
the routers answers alike everywhere; traces stay each router's own (the requests it served).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable

from pdserve.cluster.adapters import AdapterRegistry
from pdserve.cluster.control_plane import REDIS_DOWN
from pdserve.cluster.pools.manager import Member, PoolManager
from pdserve.cluster.pools.plan import DEAD, DRAINING, READY, STARTING
from pdserve.cluster.registry import WorkerRecord
from pdserve.router.adapters import ServedAdapters
from pdserve.router.admin_server import (
    AdminUnavailableError,
    ControlPlaneInfo,
    LoraDisabledError,
    PoolInfo,
    UnknownAdapterError,
    UnknownWorkerError,
    WorkerDeadError,
    WorkerInfo,
)
from pdserve.router.trace import RequestTrace
from pdserve.worker_api import WorkerStats
from pdserve.worker_api.adapters import AdapterRef

SECRET_FIELDS = ("prefix_cache_salt",)  # engine settings GetConfig never shows


def _public(engine: dict) -> dict:
    return {k: ("<secret>" if k in SECRET_FIELDS and v else v) for k, v in engine.items()}


def select_traces(traces: Iterable[RequestTrace], request_ids: list[str],
                  limit: int) -> list[RequestTrace]:
    """The traces of ``request_ids``, or the latest ``limit`` when none are named."""
    kept = list(traces)
    if not request_ids:
        return kept[-limit:]
    wanted = set(request_ids)
    return [t for t in kept if t.request_id in wanted]


# WorkerInfo fields the pool manager's member fills (its pid and error, when it has none, and
# the heartbeat's age from the worker's registry record).
INFO_FROM_MEMBER = ("worker_id", "role", "state", "node", "pid", "restarts", "error",
                    "heartbeat_age_s")
# WorkerInfo fields read from the worker's stats under another name; every WorkerInfo field
# named in none of these three is the stats field of its own name.
INFO_FROM_STATS = {"running": "num_running", "waiting": "num_waiting",
                   "kv_used_blocks": "used_blocks", "kv_total_blocks": "total_blocks"}
# WorkerInfo fields read from what binds the worker (the stats' Utilization).
INFO_FROM_UTILIZATION = {"compute_utilization": "compute",
                         "bandwidth_utilization": "bandwidth", "binding": "binding"}


def worker_info(member: Member, record: WorkerRecord | None, now: float) -> WorkerInfo:
    """One member as ListWorkers reports it (``record``: its registry record, if any)."""
    rec = member.record
    own = {"worker_id": rec.worker_id, "role": rec.role, "state": member.state,
           "node": rec.node_ip, "pid": rec.pid, "restarts": rec.restarts,
           "error": member.error or (record.error if record is not None else "")}
    if record is None:
        return WorkerInfo(**own)
    own.update(pid=rec.pid or record.pid, heartbeat_age_s=max(0.0, now - record.heartbeat_time))
    return WorkerInfo(**own, **_load(record.to_stats()))


def _load(stats: WorkerStats) -> dict:
    """The WorkerInfo fields a worker's stats fill (all but ``INFO_FROM_MEMBER``)."""
    util = stats.utilization
    values = {}
    for f in dataclasses.fields(WorkerInfo):
        if f.name in INFO_FROM_UTILIZATION:
            values[f.name] = getattr(util, INFO_FROM_UTILIZATION[f.name])
        elif f.name not in INFO_FROM_MEMBER:
            values[f.name] = getattr(stats, INFO_FROM_STATS.get(f.name, f.name))
    return values


class ClusterAdmin:
    """``AdminBackend`` over a :class:`PoolManager`; see the module docstring. ``traces``
    returns the router's finished-request traces (oldest first); ``router_config`` is what
    ``GetConfig`` reports beside the pools' engine settings; ``adapters`` the cluster's LoRA
    registry."""

    def __init__(self, manager: PoolManager,
                 traces: Callable[[], Iterable[RequestTrace]] | None = None,
                 router_config: object | None = None,
                 adapters: AdapterRegistry | None = None):
        self.manager = manager
        self._traces = traces
        self._router_config = router_config
        self.adapters = adapters

    async def load_lora_adapter(self, name: str, path: str) -> AdapterRef:
        return await self._registry().load(name, path)

    async def unload_lora_adapter(self, name: str) -> AdapterRef:
        return await self._registry().unload(name)

    async def list_lora_adapters(self) -> list[AdapterRef]:
        return self.adapters.list() if self.adapters is not None else []

    def _registry(self) -> AdapterRegistry:
        if self.adapters is None:
            raise LoraDisabledError("this server keeps no LoRA adapters; start it with "
                                    "--enable-lora")
        return self.adapters

    async def traces(self, request_ids: list[str], limit: int) -> list[RequestTrace]:
        return select_traces(self._traces() if self._traces is not None else [],
                             request_ids, limit)

    async def config(self) -> dict:
        targets = self.manager.targets
        pools = {spec.role: {"target": targets.get(spec.role, 0),
                             "engine": _public(dataclasses.asdict(spec.config))}
                 for spec in self.manager.settings.templates}
        router = (dataclasses.asdict(self._router_config)
                  if dataclasses.is_dataclass(self._router_config) else {})
        return {"pools": pools, "router": router}

    async def list_workers(self) -> list[WorkerInfo]:
        try:
            records = {r.worker_id: r for r in
                       await asyncio.to_thread(self.manager.registry.workers)}
        except REDIS_DOWN:  # the latest the pool manager read
            records = dict(self.manager.records)
        now = time.time()
        members = [*self.manager.members.values(), *self.manager.dead]
        members.sort(key=lambda m: (m.role, m.record.created_time))
        return [worker_info(m, records.get(m.worker_id) if m.state != DEAD else None, now)
                for m in members]

    async def drain_worker(self, worker_id: str) -> WorkerInfo:
        try:
            member = await self.manager.drain(worker_id)
        except KeyError:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}") from None
        if member.state == DEAD:
            raise WorkerDeadError(f"worker {worker_id!r} is dead: {member.error}")
        return worker_info(member, self.manager.records.get(worker_id), time.time())

    async def get_pools(self) -> list[PoolInfo]:
        targets, restarts = self.manager.targets, self.manager.restart_counts
        roles = sorted(set(targets) | {m.role for m in self.manager.members.values()})
        return [self._pool(role, targets.get(role, 0), restarts.get(role, 0)) for role in roles]

    async def set_pool_target(self, role: str, size: int) -> PoolInfo:
        await self.manager.set_target(role, size)
        return self._pool(role, size, self.manager.restart_counts.get(role, 0))

    async def control_plane(self) -> ControlPlaneInfo:
        health = self.manager.health
        return ControlPlaneInfo(health.degraded, health.degraded_for_s, health.error,
                                health.malformed, health.repairs)

    def _pool(self, role: str, target: int, restarts: int) -> PoolInfo:
        states = [m.state for m in self.manager.members.values() if m.role == role]
        ready, starting = states.count(READY), states.count(STARTING)
        return PoolInfo(role, target, ready + starting, ready, starting, states.count(DRAINING),
                        restarts, self.manager.last_error.get(role, ""))


# What a router without the pool manager asks of the one that runs it (RouterActor.admin_call).
FORWARDED = ("list_workers", "drain_worker", "get_pools", "set_pool_target", "config",
             "control_plane", "load_lora_adapter", "unload_lora_adapter", "list_lora_adapters")
FORWARD_TIMEOUT_S = 10.0


class ForwardingAdmin:
    """``AdminBackend`` of a router that does not run the pools: every call but ``traces``
    goes to the first router's actor (``lookup()`` finds its handle; looked up again after a
    failure, as Ray may have restarted it). Its errors come back as raised there (unknown
    worker, bad size, a refused adapter); an unreachable first router is
    :class:`AdminUnavailableError`. An adapter loaded or unloaded through it is in (or out of)
    ``served`` at once, before the router's mirror reads Redis again."""

    def __init__(self, lookup: Callable[[], object],
                 traces: Callable[[], Iterable[RequestTrace]] | None = None,
                 timeout_s: float = FORWARD_TIMEOUT_S, served: ServedAdapters | None = None):
        self._lookup = lookup
        self._handle = None
        self._traces = traces
        self._timeout_s = timeout_s
        self._served = served

    async def _call(self, method: str, *args):
        try:
            if self._handle is None:
                self._handle = await asyncio.to_thread(self._lookup)
            ref = self._handle.admin_call.remote(method, *args)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._timeout_s)
        except (UnknownWorkerError, WorkerDeadError, ValueError, UnknownAdapterError,
                LoraDisabledError) as exc:
            if not _unreachable(exc):  # the first router's answer: raise it as it was raised
                raise getattr(exc, "cause", None) or exc from None
            error = exc
        except Exception as exc:  # noqa: BLE001 - actor gone, timed out, Ray unreachable
            error = exc
        self._handle = None
        raise AdminUnavailableError(
            f"the router that runs the pools (the first, 'router') did not answer "
            f"({type(error).__name__}: {error}); try again, or ask it directly") from error

    async def list_workers(self) -> list[WorkerInfo]:
        return await self._call("list_workers")

    async def drain_worker(self, worker_id: str) -> WorkerInfo:
        return await self._call("drain_worker", worker_id)

    async def get_pools(self) -> list[PoolInfo]:
        return await self._call("get_pools")

    async def set_pool_target(self, role: str, size: int) -> PoolInfo:
        return await self._call("set_pool_target", role, size)

    async def config(self) -> dict:
        return await self._call("config")

    async def control_plane(self) -> ControlPlaneInfo:
        return await self._call("control_plane")

    async def traces(self, request_ids: list[str], limit: int) -> list[RequestTrace]:
        return select_traces(self._traces() if self._traces is not None else [],
                             request_ids, limit)

    async def load_lora_adapter(self, name: str, path: str) -> AdapterRef:
        ref = await self._call("load_lora_adapter", name, path)
        if self._served is not None:
            self._served.put(ref)
        return ref

    async def unload_lora_adapter(self, name: str) -> AdapterRef:
        ref = await self._call("unload_lora_adapter", name)
        if self._served is not None:
            self._served.remove(name)
        return ref

    async def list_lora_adapters(self) -> list[AdapterRef]:
        return await self._call("list_lora_adapters")


def _unreachable(exc: Exception) -> bool:
    """Whether a ValueError is Ray's "no such actor" (the first router is not up)."""
    return isinstance(exc, ValueError) and "Failed to look up actor" in str(exc)
