"""The Admin service's backend in a cluster: the pool manager and the Redis registry.

Implements ``pdserve.router.admin_server.AdminBackend`` in the router actor's process: workers
are the pool manager's members (and the dead ones it removed recently), with load and
heartbeat age from the registry; pools are the targets in Redis with the members counted.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.cluster.pool_plan import DEAD, DRAINING, READY, STARTING
from pdserve.cluster.pools import Member, PoolManager
from pdserve.cluster.registry import WorkerRecord
from pdserve.router.admin_server import PoolInfo, UnknownWorkerError, WorkerDeadError, WorkerInfo


def worker_info(member: Member, record: WorkerRecord | None, now: float) -> WorkerInfo:
    """One member as ListWorkers reports it (``record``: its registry record, if any)."""
    rec = member.record
    error = member.error or (record.error if record is not None else "")
    if record is None:
        return WorkerInfo(rec.worker_id, rec.role, member.state, rec.node_ip, rec.pid,
                          restarts=rec.restarts, error=error)
    return WorkerInfo(rec.worker_id, rec.role, member.state, rec.node_ip,
                      rec.pid or record.pid, record.num_running, record.num_waiting,
                      record.used_blocks, record.total_blocks,
                      max(0.0, now - record.heartbeat_time), rec.restarts, error)


class ClusterAdmin:
    """``AdminBackend`` over a :class:`PoolManager`; see the module docstring."""

    def __init__(self, manager: PoolManager):
        self.manager = manager

    async def list_workers(self) -> list[WorkerInfo]:
        records = {r.worker_id: r for r in
                   await asyncio.to_thread(self.manager.registry.workers)}
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
        store = self.manager.store
        targets = await asyncio.to_thread(store.targets)
        restarts = await asyncio.to_thread(store.restarts)
        roles = sorted(set(targets) | {m.role for m in self.manager.members.values()})
        return [self._pool(role, targets.get(role, 0), restarts.get(role, 0)) for role in roles]

    async def set_pool_target(self, role: str, size: int) -> PoolInfo:
        await self.manager.set_target(role, size)
        restarts = await asyncio.to_thread(self.manager.store.restarts)
        return self._pool(role, size, restarts.get(role, 0))

    def _pool(self, role: str, target: int, restarts: int) -> PoolInfo:
        states = [m.state for m in self.manager.members.values() if m.role == role]
        ready, starting = states.count(READY), states.count(STARTING)
        return PoolInfo(role, target, ready + starting, ready, starting, states.count(DRAINING),
                        restarts, self.manager.last_error.get(role, ""))
