"""Workers of every role, built one way: :func:`build_worker` is the only place a prefill,
decode or colocated worker is made, inside a Ray worker actor (``cluster.actors``) as in this
process (:func:`build_local_workers`: tests, benchmarks, each worker behind a
``workers.host.LocalHandle``). What differs is how KV moves: over torch.distributed pair
groups (:class:`TorchTransfer`) or in-process queues with fault injection
(:class:`InProcTransfer`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.colocated_worker.worker import ColocatedWorker
from pdserve.decode_worker.ranks import DecodeRank
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import compute_threads
from pdserve.engine.config import EngineConfig
from pdserve.engine.parts import EngineParts
from pdserve.engine.tensor_parallel.group import RankRole
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
from pdserve.worker_api import ROLES
from pdserve.workers.host import LocalHandle, Worker, WorkerHost


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


def with_compute_threads(build: Callable[[], Worker], num_threads: int) -> Worker:
    """``build()``'s worker, built on a thread that ends with its OpenMP threads; the worker's
    engine loop thread then computes on ``num_threads`` threads and every other thread of this
    process on one (``engine.compute_threads``: two threads computing would each keep a pool,
    and the process's OpenMP threads would sleep at every barrier)."""
    worker = compute_threads.on_own_thread(build)
    worker.loop.call(compute_threads.claim, num_threads).result()
    torch.set_num_threads(1)  # the calling thread's own count: it only serves calls
    return worker


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
