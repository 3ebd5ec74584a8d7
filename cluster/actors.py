"""Workers as Ray actors, the handle the router drives them through, and the Redis directory.

Lifecycle of a worker actor (``WorkerActor``, one plain worker per actor process):

1. Created by name (``worker_id``) in the cluster's Ray namespace, asking Ray for the CPUs,
   GPU and pool resource of its :class:`~pdserve.cluster.node_placement.WorkerResources`
   (``pdserve.cluster.node_placement``); the constructor sets torch to that many threads (one when
   it asks for no CPU), then builds the worker (prefill, decode or
   colocated) from a :class:`WorkerSpec` inside the actor process: model, KV pool, transfer
   endpoint (decode) or connector (prefill).
2. ``ready()`` writes the first heartbeat to the Redis registry and starts the heartbeat task
   (every ``heartbeat_s``, TTL ``ttl_s``): a :class:`WorkerRecord` made from the worker's
   ``WorkerStats``. Only now does the router see the worker. The heartbeat never waits on the
   engine loop: it sends the stats the loop published after its latest step (``snapshot``),
   so a step longer than the TTL never makes a live worker look dead (a step past the engine's
   step bound does: the snapshot then carries the error). ``ping()`` (liveness for the pool
   manager: pid, node, whether the engine loop serves) also answers on the actor's event loop.
3. The router calls ``reserve`` / ``prefill`` / ``submit`` / ``poll`` / ``abort`` / ``stats``
   through a :class:`RayHandle`, which names the router on ``reserve``, ``submit`` and
   ``poll``: with several routers each polls its own requests' deltas, and a router silent
   for ``orphan_timeout_s`` has its requests freed (``pdserve.streaming_worker.mailboxes``).
   The worker's futures are awaited with ``asyncio.wrap_future`` and the blocking ``poll``
   runs on its own thread, so the actor's event loop never blocks. Polls and submits, the
   calls made for every step that streams and every request placed, go around Ray once the
   handle has opened the actor's worker channel (``workers.worker_channel``: a socket of the
   worker's, its address and key handed over Ray); Ray carries them where the channel cannot
   be reached.
4. ``close()`` stops the heartbeat, removes the record, closes the worker; the launcher then
   kills the actor. A worker that dies stops heartbeating: its record expires after ``ttl_s``
   and the handle marks it dead at once on the first failed call.

The router finds workers through :class:`RedisDirectory` (records with a live TTL whose tags
verify under the cluster's key, each with a cached actor handle looked up by name); load,
memory and the pool manager's drain marks come from the records.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
import redis
from ray.exceptions import RayActorError, RayTaskError

from pdserve.cluster.kv_streams import KVStreams
from pdserve.cluster.node_placement import WorkerResources, actor_resources
from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.registry import Registry, WorkerRecord
from pdserve.worker_api import (
    ROLES,
    KVEvents,
    KVSnapshot,
    PrefillResult,
    Refusal,
    RequestFaultError,
    Reservation,
    StepDeltas,
    WorkerHandle,
    WorkerStats,
    WorkRequest,
)
from pdserve.workers.host import Worker, WorkerHost
from pdserve.workers.worker_channel import (
    ANSWER_GRACE_S,
    ChannelClient,
    ChannelLost,
    ChannelServer,
)

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig

logger = logging.getLogger(__name__)

# Set in every worker process before any process group exists.
WORKER_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


KV_EVENTS_S = 0.1  # how often a worker actor publishes its KV events (cluster/kv_streams.py)


def cluster_namespace(cluster: str) -> str:
    """The Ray namespace holding one cluster's named actors."""
    return f"pdserve-{cluster}"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker actor builds its worker from."""

    worker_id: str  # unique in the cluster; the actor's name and the registry key
    role: str  # "prefill" | "decode" | "colocated"
    config: EngineConfig  # the engine (decode workers get prefix caching turned off)
    redis_url: str = field(repr=False)  # the registry (may hold its password: never shown)
    cluster: str  # registry key prefix and Ray namespace suffix
    transfer_host: str = "127.0.0.1"  # KV transfer endpoint address; "" = this node's IP
    heartbeat_s: float = 1.0  # registry refresh period
    ttl_s: float = 5.0  # a record without heartbeat for this long disappears
    lease_s: float = 60.0  # decode: reservation lease
    orphan_timeout_s: float = 30.0  # decode, colocated: the requests of a router that has not
    # polled for this long are freed (per router)
    log_level: str = "WARNING"  # logging level inside the actor process
    join_token: str = field(default="", repr=False)  # KV rendezvous: decode endpoints
    # accept only prefill peers holding it
    record_key: str = field(default="", repr=False)  # the cluster's key for what it writes
    # to Redis: its registry record and KV events are signed with it (required to run)
    resources: WorkerResources = WorkerResources()  # what it asks Ray for, its torch threads

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id must be non-empty without spaces, got {self.worker_id!r}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be > 0 and < ttl_s "
                             f"({self.ttl_s})")


def limit_process_threads(log_level: str = "WARNING", num_threads: int = 1) -> None:
    """``num_threads`` OpenMP/MKL threads for this process and its children, and its logging:
    a worker computes on the CPUs it asked Ray for, the router (which never imports torch) on
    one."""
    os.environ.update(WORKER_ENV)
    os.environ.update({"OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads)})
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def limit_torch_threads(num_threads: int) -> None:
    """``num_threads`` torch threads in this (a worker actor's) process, one inter-op thread."""
    import torch  # lazy: the router imports this module to start worker actors, without torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran
        pass


def build_spec_worker(spec: WorkerSpec) -> Worker:
    """The plain worker a spec describes, in this (the actor's) process."""
    # lazy: the engine and torch load in the worker actor's process; the router process
    # imports this module to start worker actors and never builds a worker
    from pdserve.workers.build import TorchTransfer, build_worker

    host = spec.transfer_host or ray.util.get_node_ip_address()
    transfer = TorchTransfer(host, str(spec.config.resolve_device()), spec.join_token)
    return build_worker(spec.role, spec.worker_id, spec.config, transfer, lease_s=spec.lease_s,
                        orphan_timeout_s=spec.orphan_timeout_s)


class WorkerActor(WorkerHost):
    """Hosts one worker; see the module docstring. Create with :func:`worker_actor_options`.
    The calls a :class:`RayHandle` makes (stats, reserve, prefill, submit, poll, abort, ...,
    each naming the calling router where it matters) are :class:`WorkerHost`'s, run on the
    actor's event loop."""

    def __init__(self, spec: WorkerSpec):
        threads = spec.resources.torch_threads
        limit_process_threads(spec.log_level, threads)
        limit_torch_threads(threads)
        from pdserve.workers.build import with_compute_threads  # lazy: torch, as above

        super().__init__(with_compute_threads(functools.partial(build_spec_worker, spec),
                                              threads))
        self.spec = spec
        self.registry = Registry(spec.redis_url, spec.cluster, spec.ttl_s,
                                 auth=RecordAuth(spec.record_key))
        self.kv_streams = KVStreams(self.registry.client, spec.cluster, self.registry.ttl_ms,
                                    auth=self.registry.auth)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="registry")
        self._heartbeat: asyncio.Task | None = None
        self._kv_publisher: asyncio.Task | None = None
        self._kv_published = 0  # the last KV event batch this actor tried to publish
        self._channel: ChannelServer | None = None
        self._closed = False

    async def ready(self) -> dict:
        """First heartbeat written and the heartbeat task running; returns where it lives."""
        if self._heartbeat is None:
            await self._beat()
            self._heartbeat = asyncio.create_task(self._heartbeat_loop())
            self._kv_publisher = asyncio.create_task(self._kv_loop())
        return self._where()

    async def ping(self) -> dict:
        """Liveness for the pool manager, answered without touching the engine loop:
        {worker_id, role, pid, node_ip, loop_alive, error}. ``loop_alive`` is false, and
        ``error`` says why, when the loop died, a part it needs is gone, or it is stuck in a
        step past its step bound (``EngineLoop.failure``): the pool replaces the worker."""
        loop = getattr(self.worker, "loop", None)
        error = getattr(loop, "failure", None)  # a dead rank or a stuck step shows here
        alive = bool(getattr(loop, "is_alive", True)) and error is None
        return {**self._where(), "loop_alive": alive,
                "error": None if error is None else str(error)}

    async def worker_channel(self) -> tuple[tuple[str, int], bytes]:
        """Where this worker serves polls and submits beside Ray, and the key that opens it
        (``workers.worker_channel``); started at the first ask."""
        if self._channel is None:  # on the address its KV transfers advertise
            host = self.spec.transfer_host or ray.util.get_node_ip_address()
            self._channel = ChannelServer({"poll": self.poll_blocking,
                                           "submit": self.submit_blocking}, host)
        return self._channel.address, self._channel.authkey

    def _where(self) -> dict:
        return {"worker_id": self.spec.worker_id, "role": self.spec.role, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address()}

    async def _beat(self) -> None:
        stats = self.worker.snapshot()  # what the engine loop published last: no wait on it
        if stats is None:  # nothing published yet
            return
        record = WorkerRecord.from_stats(stats, os.getpid())
        await asyncio.get_running_loop().run_in_executor(self._io, self._write_record, record)

    def _write_record(self, record: WorkerRecord) -> None:
        """On the registry thread, after every batch published before it, so the record never
        names a batch (``kv_events_number``) that a reader of the stream could not have seen."""
        record.kv_events_number = self._kv_published
        self.registry.heartbeat(record)

    async def _kv_loop(self) -> None:
        """Publish the engine's KV events every KV_EVENTS_S (the routers' index lags by about
        that plus their stats refresh)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(KV_EVENTS_S)
            try:
                events = await self.drain_kv_events()
                if events is not None:
                    await loop.run_in_executor(self._io, self._publish_kv, events)
            except Exception as exc:  # noqa: BLE001 - the routers resync what is lost
                logger.info("%s: KV events not published: %s", self.spec.worker_id, exc)

    def _publish_kv(self, events: KVEvents) -> None:
        try:
            self.kv_streams.publish(self.spec.worker_id, events)
        finally:  # (published or lost: a reader behind this number resyncs)
            self._kv_published = events.number

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.heartbeat_s)
            try:
                await self._beat()
            except Exception as exc:  # noqa: BLE001 - Redis or the engine may recover
                logger.warning("%s: heartbeat failed: %s", self.spec.worker_id, exc)

    # -- management ---------------------------------------------------------------------------
    async def close(self) -> None:
        """Leave the registry and stop the worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for task in (self._heartbeat, self._kv_publisher):
            if task is not None:
                task.cancel()
        if self._channel is not None:
            self._channel.close()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._io, self.registry.remove, self.spec.worker_id)
        except Exception as exc:  # noqa: BLE001 - the record expires by TTL anyway
            logger.warning("%s: could not leave the registry: %s", self.spec.worker_id, exc)
        await loop.run_in_executor(None, self.stop)


def worker_actor_options(spec: WorkerSpec, detached: bool = False,
                         cluster_resources: dict[str, float] | None = None) -> dict:
    """Ray options for a worker actor: named, in the cluster namespace, asking for its CPUs,
    GPU and pool resource (``cluster_resources``: ``ray.cluster_resources()``, which decides
    whether its pool has nodes of its own; see ``pdserve.cluster.node_placement``). Never restarted
    by Ray: the pool manager replaces a dead worker under a new name. ``detached``: it
    outlives the process that created it (the router actor)."""
    return dict(name=spec.worker_id, namespace=cluster_namespace(spec.cluster),
                max_restarts=0, max_concurrency=1000,
                lifetime="detached" if detached else None,
                **actor_resources(spec.resources, spec.role, cluster_resources))


def start_worker_actor(spec: WorkerSpec, detached: bool = False,
                       cluster_resources: dict[str, float] | None = None):
    """Create the actor (asynchronously); call ``ready.remote()`` to wait for it. Only the
    pool manager (``pdserve.cluster.pools.manager``) calls this in a cluster."""
    options = worker_actor_options(spec, detached, cluster_resources)
    return ray.remote(WorkerActor).options(**options).remote(spec)


class RayHandle(WorkerHandle):
    """The worker protocol (``worker_api.WorkerHandle``) over a worker actor: the worker's
    refusals and request faults reach the router as their own types, unwrapped from Ray's;
    ``router``: the name of the router actor holding it (its deltas are its own). Polls and
    submits go through the actor's worker channel (``workers.worker_channel``), each on a
    connection and a thread of the handle's own, or through Ray where the channel cannot be
    opened."""

    def __init__(self, actor, worker_id: str, role: str, router: str = ""):
        self.actor = actor
        self.worker_id = worker_id
        self.role = role
        self.router = router
        self.dead_at: float | None = None  # time.time() of the first call that found it dead
        self.polls: ChannelClient | None = None  # the channel's connections, once open
        self.submits: ChannelClient | None = None
        self._opening: asyncio.Future | None = None  # (once: where it fails, Ray carries all)
        self._poll_thread = ThreadPoolExecutor(1, thread_name_prefix=f"poll-{worker_id}")
        self._submit_thread = ThreadPoolExecutor(1, thread_name_prefix=f"submit-{worker_id}")

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError:
            self._died("is dead")
            raise
        except (Refusal, RequestFaultError) as exc:  # a RayTaskError subclassing the cause
            raise _cause(exc) from None

    def _died(self, why: str) -> None:
        if self.dead_at is None:
            self.dead_at = time.time()
            logger.warning("worker %s %s", self.worker_id, why)

    async def stats(self) -> WorkerStats:
        return await self._call("stats")

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def reserve(self, request: WorkRequest) -> Reservation:
        return await self._call("reserve", request, self.router)

    async def renew(self, request_id: str) -> float | None:
        return await self._call("renew", request_id)

    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult:
        return await self._call("prefill", request, reservation)

    async def submit(self, request: WorkRequest) -> None:
        await self._channel_opened()
        if self.submits is None:
            await self._call("submit", request, self.router)
        else:
            await self._through_channel(self._submit_thread, self.submits.submit, request)

    async def poll(self, timeout: float) -> StepDeltas:
        await self._channel_opened()
        if self.polls is None:
            return await self._call("poll", timeout, self.router)
        return await self._through_channel(self._poll_thread, self.polls.poll, timeout)

    async def _through_channel(self, thread: ThreadPoolExecutor, call, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(thread, call, *args)
        except ChannelLost:
            self._died("lost its worker channel")
            raise

    async def _channel_opened(self) -> None:
        """Open the worker channel for this handle's polls and submits, at the first call that
        asks; those that wait for it get what opening raised (later ones find no channel and
        call through Ray)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open_channel())
        if not self._opening.done():
            await asyncio.shield(self._opening)

    async def _open_channel(self) -> None:
        """Connect to the actor's worker channel, once for polls and once for submits; where
        that fails but the actor answers (an address this router cannot reach), both stay
        on Ray."""
        address, authkey = await self._call("worker_channel")  # a dead actor raises here
        loop = asyncio.get_running_loop()
        opened = []
        try:
            for thread in (self._poll_thread, self._submit_thread):
                opened.append(await asyncio.wait_for(loop.run_in_executor(
                    thread, ChannelClient, address, authkey, self.router), ANSWER_GRACE_S))
        except OSError as exc:  # (a handshake past the grace is a TimeoutError, one too)
            logger.warning("worker %s: worker channel at %s not reachable (%s); polling and "
                           "submitting through Ray", self.worker_id, address, exc)
            for client in opened:
                client.close()
            return
        self.polls, self.submits = opened

    async def kv_snapshot(self) -> KVSnapshot | None:
        return await self._call("kv_snapshot")

    async def drain_kv_events(self) -> None:
        """None: a worker actor publishes its KV events itself, to its Redis stream, where
        every router reads them (``RedisDirectory.kv_events``); draining them here would take
        them from that stream."""
        return None


def _cause(exc: BaseException) -> BaseException:
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


class RedisDirectory:
    """WorkerDirectory over the Redis registry: live records + cached actor handles by name."""

    def __init__(self, registry: Registry, namespace: str, router: str = ""):
        self.registry = registry
        self.namespace = namespace
        self.router = router  # the router actor's name, given to every handle
        self._handles: dict[str, RayHandle] = {}
        self.kv_streams = KVStreams(registry.client, registry.cluster, registry.ttl_ms,
                                    auth=registry.auth, on_malformed=registry.on_malformed,
                                    on_untrusted=registry.on_untrusted)
        # worker_id -> (heartbeat_time, stats): the same object until a newer heartbeat, so
        # the router keeps counting what it sent since (WorkerLoad.refresh)
        self._stats: dict[str, tuple[float, WorkerStats]] = {}

    def _stats_of(self, record: WorkerRecord) -> WorkerStats:
        cached = self._stats.get(record.worker_id)
        if cached is None or cached[0] != record.heartbeat_time:
            cached = self._stats[record.worker_id] = (record.heartbeat_time, record.to_stats())
        return cached[1]

    async def snapshot(self) -> list[tuple[RayHandle, WorkerStats]]:
        records = await asyncio.to_thread(self.registry.workers)
        live = []
        for record in records:
            handle = self._handles.get(record.worker_id)
            if handle is not None and handle.dead_at is not None:
                if record.heartbeat_time <= handle.dead_at:
                    continue  # the record of a dead incarnation, not expired yet
                handle = None  # a new actor under the same name
            if handle is None:
                handle = await asyncio.to_thread(self._lookup, record)
                if handle is None:
                    continue
                self._handles[record.worker_id] = handle
            live.append((handle, self._stats_of(record)))
        return live

    async def kv_events(self, worker_ids: list[str]) -> list[tuple[str, KVEvents]]:
        """New batches from the workers' KV event streams (none while Redis is away: the
        index then resyncs what it missed)."""
        try:
            return await asyncio.to_thread(self.kv_streams.read, worker_ids)
        except redis.RedisError as exc:
            logger.info("KV event streams unread: %s", exc)
            return []

    def _lookup(self, record: WorkerRecord) -> RayHandle | None:
        try:
            actor = ray.get_actor(record.worker_id, namespace=self.namespace)
        except ValueError:
            logger.info("worker %s is registered but has no live actor", record.worker_id)
            return None
        return RayHandle(actor, record.worker_id, record.role, self.router)

    def handles(self) -> list[RayHandle]:
        """The live handles seen so far."""
        return [h for h in self._handles.values() if h.dead_at is None]
