"""Async handles over workers living in this process (tests, single-process serving)."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from pdserve.decode_worker.mailboxes import MailboxSizes
from pdserve.decode_worker.worker import NoCapacityError
from pdserve.engine.messages import StepDeltas, WorkRequest
from pdserve.router.handles import NoCapacity


class LocalHandle:
    """Any worker (prefill, decode, colocated) behind the router's async handle protocol.
    ``router``: the name of the router calling (several routers share a decode or colocated
    worker; each polls its own requests' deltas); one router in a process leaves it ""."""

    def __init__(self, worker):
        self.worker = worker
        self.worker_id = worker.worker_id
        self.role = worker.role
        self._poller = ThreadPoolExecutor(1, thread_name_prefix=f"poll-{self.worker_id}")

    async def stats(self):
        return await asyncio.wrap_future(self.worker.stats())

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self.worker.abort(request_id))

    async def reserve(self, request: WorkRequest, router: str = ""):
        try:
            return await asyncio.wrap_future(self.worker.reserve(request, router))
        except NoCapacityError as exc:
            raise NoCapacity(str(exc)) from exc

    async def renew(self, request_id: str):
        return await asyncio.wrap_future(self.worker.renew(request_id))

    async def prefill(self, request: WorkRequest, reservation):
        return await asyncio.wrap_future(self.worker.prefill(request, reservation))

    async def submit(self, request: WorkRequest, router: str = "") -> None:
        await asyncio.wrap_future(self.worker.submit(request, router))

    async def poll(self, timeout: float, router: str = "") -> StepDeltas:
        """``router``'s deltas, a pure decode step's still compact (the router expands them:
        one object to serialise per step when this handle is an actor's). Polls run one at a
        time, whichever router asks."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._poller, functools.partial(
            self.worker.poll, timeout, compact=True, router=router))

    async def mailbox_sizes(self) -> MailboxSizes | None:
        """What the worker's per-router mailboxes hold (None: a prefill worker has none)."""
        mailboxes = getattr(self.worker, "mailboxes", None)
        return None if mailboxes is None else mailboxes.sizes()

    async def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Test hook: the worker's next engine step raises or stalls (``EngineLoop``)."""
        self.worker.loop.inject_fault(kind, seconds)

    def close(self) -> None:
        self._poller.shutdown(wait=False, cancel_futures=True)
        self.worker.close()


def build_local_workers(config, num_prefill: int = 1, num_decode: int = 1,
                        colocated: bool = False, transport: str = "inproc",
                        prefill_kwargs: dict | None = None, fault_plan=None,
                        lease_s: float = 60.0,
                        orphan_timeout_s: float = 30.0) -> list[LocalHandle]:
    """Workers in this process: ``transport`` is "inproc" (queues; ``fault_plan`` injects
    faults) or "torch" (gloo/NCCL pairs over loopback, as between processes)."""
    from pdserve.decode_worker.colocated import ColocatedWorker
    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.engine.parts import EngineParts
    from pdserve.kv_transfer import (
        InProcConnector,
        InProcEndpoint,
        InProcHub,
        TorchDistConnector,
        TransferEndpoint,
    )
    from pdserve.prefill_worker.worker import PrefillWorker

    if colocated:
        return [LocalHandle(ColocatedWorker(f"colocated-{i}", EngineParts.build(config),
                                            orphan_timeout_s=orphan_timeout_s))
                for i in range(num_decode)]
    hub = InProcHub()
    handles = []
    for i in range(num_decode):
        name = f"decode-{i}"
        if transport == "inproc":
            make = lambda sink, name=name: InProcEndpoint(hub, name, sink)  # noqa: E731
        else:
            make = lambda sink: TransferEndpoint(sink, "127.0.0.1", 0)  # noqa: E731
        parts = EngineParts.build(DecodeWorker.config_for(config))
        handles.append(LocalHandle(DecodeWorker(name, parts, make, lease_s=lease_s,
                                                orphan_timeout_s=orphan_timeout_s)))
    for i in range(num_prefill):
        name = f"prefill-{i}"
        connector = (InProcConnector(hub, name, fault_plan=fault_plan) if transport == "inproc"
                     else TorchDistConnector(name))
        parts = EngineParts.build(PrefillWorker.config_for(config))
        handles.append(LocalHandle(PrefillWorker(name, parts, connector,
                                                 **(prefill_kwargs or {}))))
    return handles
