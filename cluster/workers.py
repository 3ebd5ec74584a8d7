"""Workers of every role, built one way: :func:`build_worker` is the only place a prefill,
decode or colocated worker is made, inside a Ray worker actor (``cluster.actors``) as in this
process (:func:`build_local_workers`: tests, benchmarks). What differs is how KV moves: over
torch.distributed pair groups (:class:`TorchTransfer`) or in-process queues with fault
injection (:class:`InProcTransfer`). :class:`WorkerHost` makes a worker's calls awaitable, the
calling router named on each (a Ray worker actor is one in its own process);
:class:`LocalHandle` is the worker protocol (``worker_api.WorkerHandle``) over a host in this
process, for one router."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

from pdserve.colocated_worker.worker import ColocatedWorker
from pdserve.decode_worker.ranks import DecodeRank
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.parts import EngineParts
from pdserve.engine.tensor_parallel import RankRole
from pdserve.kv_transfer import (
    FaultPlan,
    InProcConnector,
    InProcEndpoint,
    InProcHub,
    TorchDistConnector,
    TransferEndpoint,
)
from pdserve.prefill_worker.ranks import PrefillRank
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.streaming_worker.mailboxes import MailboxSizes
from pdserve.streaming_worker.worker import StreamingWorker
from pdserve.worker_api import (
    ROLES,
    KVEvents,
    KVSnapshot,
    PrefillResult,
    Reservation,
    StepDeltas,
    WorkerHandle,
    WorkerStats,
    WorkRequest,
)

Worker: TypeAlias = PrefillWorker | DecodeWorker | ColocatedWorker  # what build_worker makes
W = TypeVar("W")


@dataclass(frozen=True)
class TorchTransfer:
    """KV over 2-rank torch.distributed groups (gloo on CPU, NCCL on CUDA), as between
    processes and nodes."""

    host: str = "127.0.0.1"  # the decode endpoint's address
    device: str = "cpu"
    join_token: str = field(default="", repr=False)  # decode endpoints accept only holders

    def endpoint(self, name: str, sink) -> TransferEndpoint:
        return TransferEndpoint(sink, self.host, 0, self.device, join_token=self.join_token)

    def connector(self, name: str) -> TorchDistConnector:
        return TorchDistConnector(name, self.host, self.device, join_token=self.join_token)


@dataclass(frozen=True)
class InProcTransfer:
    """KV through in-process queues shared by every worker of one ``hub``; ``fault_plan``
    injects transfer faults on the prefill side."""

    hub: InProcHub = field(default_factory=InProcHub)
    fault_plan: FaultPlan | None = None

    def endpoint(self, name: str, sink) -> InProcEndpoint:
        return InProcEndpoint(self.hub, name, sink)

    def connector(self, name: str) -> InProcConnector:
        return InProcConnector(self.hub, name, fault_plan=self.fault_plan)


def build_worker(role: str, worker_id: str, config: EngineConfig,
                 transfer: TorchTransfer | InProcTransfer | None = None, *,
                 lease_s: float = 60.0, orphan_timeout_s: float = 30.0,
                 prefill_kwargs: dict | None = None) -> Worker:
    """The plain worker of ``role``, its engine built from ``config`` in this process;
    ``transfer`` moves the KV of a prefill or decode worker (a colocated one moves none)."""
    if role == "colocated":
        return ColocatedWorker(worker_id, EngineParts.build(config),
                               orphan_timeout_s=orphan_timeout_s)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if transfer is None:
        raise ValueError(f"transfer: a {role} worker moves KV, it needs one (got None)")
    if role == "decode":
        parts = EngineParts.build(config, _rank_role(role, worker_id, config, transfer))
        return DecodeWorker(worker_id, parts, functools.partial(transfer.endpoint, worker_id),
                            lease_s=lease_s, orphan_timeout_s=orphan_timeout_s)
    parts = EngineParts.build(PrefillWorker.config_for(config),
                              _rank_role(role, worker_id, config, transfer))
    return PrefillWorker(worker_id, parts, transfer.connector(worker_id),
                         **(prefill_kwargs or {}))


def _rank_role(role: str, worker_id: str, config: EngineConfig,
               transfer: TorchTransfer | InProcTransfer) -> RankRole | None:
    """What the follower ranks of a tensor parallel prefill or decode worker do: move their
    own K/V heads, over the real transport (in-process queues do not cross processes)."""
    if config.tensor_parallel_size == 1:
        return None
    if not isinstance(transfer, TorchTransfer):
        raise ValueError("a tensor parallel prefill or decode worker moves KV from every rank's "
                         "process: it needs the torch.distributed transport")
    if role == "decode":
        return RankRole.of(DecodeRank, transfer.host, transfer.join_token)
    return RankRole.of(PrefillRank, worker_id, transfer.host, transfer.join_token)


class WorkerHost:
    """A worker in this process with its calls made awaitable and the calling router named on
    each: what a worker actor serves (``cluster.actors.WorkerActor``) and what the
    :class:`LocalHandle` of every router in this process calls. Polls run one at a time on
    the host's thread, whichever router asks. A call the worker's role does not answer raises
    TypeError."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.worker_id = worker.worker_id
        self.role = worker.role
        self._poller = ThreadPoolExecutor(1, thread_name_prefix=f"poll-{self.worker_id}")

    def _of_role(self, kind: type[W], call: str) -> W:
        if not isinstance(self.worker, kind):
            raise TypeError(f"{call}: worker {self.worker_id} is a {self.role} worker")
        return self.worker

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self.worker.abort(request_id))

    async def reserve(self, request: WorkRequest, router: str) -> Reservation:
        worker = self._of_role(DecodeWorker, "reserve")
        return await asyncio.wrap_future(worker.reserve(request, router))

    async def renew(self, request_id: str) -> float | None:
        worker = self._of_role(DecodeWorker, "renew")
        return await asyncio.wrap_future(worker.renew(request_id))

    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult:
        worker = self._of_role(PrefillWorker, "prefill")
        return await asyncio.wrap_future(worker.prefill(request, reservation))

    async def submit(self, request: WorkRequest, router: str) -> None:
        worker = self._of_role(StreamingWorker, "submit")
        await asyncio.wrap_future(worker.submit(request, router))

    async def poll(self, timeout: float, router: str) -> StepDeltas:
        """``router``'s deltas."""
        worker = self._of_role(StreamingWorker, "poll")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._poller, functools.partial(
            worker.poll, timeout, router=router))

    async def kv_snapshot(self) -> KVSnapshot | None:
        """Every block hash the worker's prefix cache holds (read on its engine loop)."""
        return await asyncio.wrap_future(self.worker.loop.call(self.worker.engine.kv_snapshot))

    async def drain_kv_events(self) -> KVEvents | None:
        """The worker's prefix-cache changes since the last drain (as the next batch)."""
        return self.worker.engine.drain_kv_events()

    async def mailbox_sizes(self) -> MailboxSizes | None:
        """What the worker's per-router mailboxes hold (None: a prefill worker has none)."""
        if not isinstance(self.worker, StreamingWorker):
            return None
        return self.worker.mailbox_sizes()

    async def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Test hook: the worker's next engine step raises or stalls (``EngineLoop``)."""
        self.worker.loop.inject_fault(kind, seconds)

    def stop(self) -> None:
        """Stop the poll thread and the worker."""
        self._poller.shutdown(wait=False, cancel_futures=True)
        self.worker.close()


class LocalHandle(WorkerHandle):
    """A worker in this process as the router named ``router`` reaches it (several routers
    share a decode or colocated worker; each polls its own requests' deltas); one router in a
    process leaves it "". :meth:`for_router` is the same worker as another router reaches
    it."""

    def __init__(self, host: WorkerHost, router: str = ""):
        self.host = host
        self.router = router
        self.worker = host.worker
        self.worker_id = host.worker_id
        self.role = host.role

    def for_router(self, router: str) -> LocalHandle:
        return LocalHandle(self.host, router)

    async def stats(self) -> WorkerStats:
        return await self.host.stats()

    async def abort(self, request_id: str) -> None:
        await self.host.abort(request_id)

    async def reserve(self, request: WorkRequest) -> Reservation:
        return await self.host.reserve(request, self.router)

    async def renew(self, request_id: str) -> float | None:
        return await self.host.renew(request_id)

    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult:
        return await self.host.prefill(request, reservation)

    async def submit(self, request: WorkRequest) -> None:
        await self.host.submit(request, self.router)

    async def poll(self, timeout: float) -> StepDeltas:
        return await self.host.poll(timeout, self.router)

    async def kv_snapshot(self) -> KVSnapshot | None:
        return await self.host.kv_snapshot()

    async def drain_kv_events(self) -> KVEvents | None:
        return await self.host.drain_kv_events()

    def close(self) -> None:
        """Stop the worker (for every router's handle of it)."""
        self.host.stop()


def build_local_workers(config: EngineConfig, num_prefill: int = 1, num_decode: int = 1,
                        colocated: bool = False, transport: str = "inproc",
                        prefill_kwargs: dict | None = None, fault_plan: FaultPlan | None = None,
                        lease_s: float = 60.0,
                        orphan_timeout_s: float = 30.0) -> list[LocalHandle]:
    """Workers in this process behind handles: ``num_decode`` colocated ones, or
    ``num_decode`` decode and ``num_prefill`` prefill ones whose KV moves by ``transport``,
    "inproc" (queues; ``fault_plan`` injects faults) or "torch" (gloo/NCCL pairs over
    loopback, as between processes)."""
    transfer = InProcTransfer(fault_plan=fault_plan) if transport == "inproc" else \
        TorchTransfer(device=str(config.resolve_device()))
    roles = ([("colocated", num_decode)] if colocated
             else [("decode", num_decode), ("prefill", num_prefill)])
    return [LocalHandle(WorkerHost(build_worker(role, f"{role}-{i}", config, transfer,
                                                lease_s=lease_s,
                                                orphan_timeout_s=orphan_timeout_s,
                                                prefill_kwargs=prefill_kwargs)))
            for role, count in roles for i in range(count)]
