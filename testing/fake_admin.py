"""An in-memory ``AdminBackend`` for tests of the Admin service and its CLI (no Ray, no Redis).

Pools and workers are plain dataclasses; ``drain_worker`` marks the worker draining and lowers
its pool's target, as the cluster's pool manager does; ``set_pool_target`` only records it;
``control_plane`` reports ``plane`` (set it to show a degraded one). LoRA adapters live in
``adapters`` (a ``ServedAdapters``, what the doors resolve): a load refuses a name in use, a
path outside ``/adapters/`` ("not a folder") and everything without ``lora_enabled``, as the
cluster's registry refuses them.
"""

from __future__ import annotations

import dataclasses

from pdserve.router.adapters import ServedAdapters
from pdserve.router.admin_server import (
    ControlPlaneInfo,
    LoraDisabledError,
    PoolInfo,
    UnknownAdapterError,
    UnknownWorkerError,
    WorkerDeadError,
    WorkerInfo,
)
from pdserve.worker_api import ROLES
from pdserve.worker_api.adapters import AdapterRef


class FakeAdmin:
    def __init__(self, workers: list[WorkerInfo], targets: dict[str, int],
                 adapters: ServedAdapters | None = None, lora_enabled: bool = True):
        self.workers = {w.worker_id: w for w in workers}
        self.targets = dict(targets)
        self.drained: list[str] = []  # worker ids, in the order drain_worker was called
        self.plane = ControlPlaneInfo(degraded=False)  # what control_plane() reports
        self.adapters = ServedAdapters() if adapters is None else adapters
        self.lora_enabled = lora_enabled

    async def load_lora_adapter(self, name: str, path: str) -> AdapterRef:
        if not self.lora_enabled:
            raise LoraDisabledError(f"LoRA adapter {name!r}: start it with --enable-lora")
        if self.adapters.get(name) is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if not path.startswith("/adapters/"):
            raise ValueError(f"LoRA adapter {name!r}: {path} is not a folder")
        ref = AdapterRef(name, path, f"{len(self.adapters):064x}")
        self.adapters.put(ref)
        return ref

    async def unload_lora_adapter(self, name: str) -> AdapterRef:
        ref = self.adapters.get(name)
        if ref is None:
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded")
        self.adapters.remove(name)
        return ref

    async def list_lora_adapters(self) -> list[AdapterRef]:
        return self.adapters.all()

    async def list_workers(self) -> list[WorkerInfo]:
        return sorted(self.workers.values(), key=lambda w: (w.role, w.worker_id))

    async def drain_worker(self, worker_id: str) -> WorkerInfo:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}")
        if worker.state == "dead":
            raise WorkerDeadError(f"worker {worker_id!r} is dead")
        if worker.state != "draining":
            self.targets[worker.role] = max(0, self.targets[worker.role] - 1)
            worker = self.workers[worker_id] = dataclasses.replace(worker, state="draining")
            self.drained.append(worker_id)
        return worker

    async def control_plane(self) -> ControlPlaneInfo:
        return self.plane

    async def get_pools(self) -> list[PoolInfo]:
        return [self._pool(role) for role in sorted(self.targets)]

    async def set_pool_target(self, role: str, size: int) -> PoolInfo:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.targets[role] = size
        return self._pool(role)

    def _pool(self, role: str) -> PoolInfo:
        states = [w.state for w in self.workers.values() if w.role == role]
        ready, starting = states.count("ready"), states.count("starting")
        restarts = sum(w.restarts for w in self.workers.values() if w.role == role)
        return PoolInfo(role, self.targets.get(role, 0), ready + starting, ready, starting,
                        states.count("draining"), restarts)
