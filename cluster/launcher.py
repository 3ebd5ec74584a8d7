"""The embedded cluster: Ray, Redis, worker actors and the router actor, started and stopped
as one thing (``pdserve serve``, ``pdserve demo``, the e2e tests).

Start order (:meth:`EmbeddedCluster.start`): Ray (local on loopback unless ``ray_address``),
redis-server child (unless ``redis_url``), the router actor (gRPC up, NOT_SERVING; it runs the
pool manager), the pool targets: the pool manager creates the worker actors (each heartbeats
into Redis once built; the router picks them up and turns SERVING) and replaces any that dies
while the cluster runs. The launcher never creates a worker actor itself.

Actors: workers are always detached (they outlive a router restart; the restarted router's
pool manager adopts them by name). The router is restarted by Ray when its process dies; it is
detached too with ``detached`` (default: with ``ray_address``), and then a later launcher with
the same ``cluster_name`` (default "default" there) and Redis adopts the running router and
pools instead of starting new ones.

:meth:`EmbeddedCluster.stop` undoes what was started, in reverse, and is idempotent: router
stopped, every worker of the cluster (replacements included) closed and killed, the cluster's
Redis keys deleted, Ray shut down only if this cluster started it, Redis stopped only if this
cluster started it (``detach_on_stop`` leaves a detached router and its pools running instead).
Processes it started (actor processes, replacements included, the redis-server child, and a
local Ray's own processes) are listed by :meth:`started_pids`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import replace

import grpc
import ray

from pdserve.api.client import PdserveClient, PdserveError
from pdserve.cluster.actors import WorkerSpec, cluster_namespace
from pdserve.cluster.adapters import check_lora_modules
from pdserve.cluster.credentials import resolve_secrets
from pdserve.cluster.named_actors import adoptable_router, named_workers
from pdserve.cluster.node_placement import (
    WorkerResources,
    actor_resources,
    check_pool_devices,
    resolve_device,
    worker_resources,
)
from pdserve.cluster.options import ClusterOptions, parse_lora_modules
from pdserve.cluster.pools.manager import WorkerStartError
from pdserve.cluster.pools.settings import PoolSettings
from pdserve.cluster.pools.store import PoolStore
from pdserve.cluster.processes import (
    Deadline,
    child_pids,
    end_processes,
    pids_naming,
    quiet_value,
    quietly,
)
from pdserve.cluster.ray_env import init_ray
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.router_actor import RouterSpec, router_name, start_router_actor
from pdserve.engine.config import EngineConfig
from pdserve.models import tiny_model_dir
from pdserve.router.auth import TLSConfig

logger = logging.getLogger(__name__)
END_GRACE_S = 2.0  # SIGTERM -> SIGKILL for a stopped cluster's processes still running


class EmbeddedCluster:
    """``with EmbeddedCluster(ClusterOptions(...)) as c: c.wait_ready(); c.target``. The key
    and password files the options name are read here (``credentials.resolve_secrets``; the
    environment is the command line's to read)."""

    def __init__(self, options: ClusterOptions | None = None):
        self.options = resolve_secrets(options or ClusterOptions(), {})
        opts = self.options
        self.detached = opts.detached if opts.detached is not None else bool(opts.ray_address)
        self.cluster_name = opts.cluster_name or ("default" if self.detached
                                                  else f"pd{uuid.uuid4().hex[:8]}")
        self.model: str | None = None
        self.redis_url: str | None = None
        self.port: int | None = None  # bound gRPC port
        self.metrics_port: int | None = None  # bound metrics port
        self.http_port: int | None = None  # bound HTTP port (None: off)
        self._secret = secrets.token_hex(16)  # this cluster's: prefix-cache salt, join token,
        # the key of what workers and the pool manager write to Redis
        self.router = None  # the first router actor's handle (it runs the pools)
        self.routers: list = []  # every router actor's handle, the first one first
        self.ports: list[int] = []  # each router's bound gRPC port, in that order
        self.workers: dict[str, object] = {}  # worker_id -> actor handle (live ones)
        self.worker_info: dict[str, dict] = {}  # worker_id -> {worker_id, role, pid, node_ip},
        # every worker seen (refresh_workers), so stop can check each process is gone
        self.store: PoolStore | None = None  # the cluster's pool state in Redis
        self._ray = None
        self._owns_ray = False
        self._redis: RedisServer | None = None
        self._ray_pids: set[int] = set()
        self._ray_temp_dir: str | None = None  # a local Ray's session dir, removed on stop
        self._router_pids: set[int] = set()  # every router pid seen (Ray restarts it)
        self._worker_pids: set[int] = set()  # every worker pid the pool manager recorded
        self._stopped = False

    # -- start ----------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> EmbeddedCluster:
        try:
            self.start_infra()
            self.start_router(timeout)
            self.start_workers(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_infra(self) -> None:
        """Ray and Redis (started or joined) and the model folder."""

        opts = self.options
        self._owns_ray = not ray.is_initialized() and not opts.ray_address
        before = child_pids()
        if self._owns_ray:  # short: Ray's socket paths live under it
            self._ray_temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
        num_cpus = opts.local_ray_cpus() if self._owns_ray else opts.ray_num_cpus
        self._ray = init_ray(opts.ray_address, self._ray_temp_dir, num_cpus)
        if self._owns_ray:
            self._ray_pids = child_pids() - before
        if opts.redis_url:
            self.redis_url = opts.redis_url
        else:
            self._redis = RedisServer(password=opts.redis_password).start()
            self.redis_url = self._redis.url
        self.store = PoolStore(self.redis_url, self.cluster_name)
        if opts.model is None:

            self.model = str(tiny_model_dir())
            logger.info("no --model: serving the built-in tiny model (random weights) from %s",
                        self.model)
        else:
            self.model = str(opts.model)
        check_lora_modules(self.options, self.model)  # before any router registers them

    def derived_secret(self, purpose: str) -> str:
        """A secret of this cluster for one purpose ("prefix-cache", "kv-join",
        "redis-records"): workers of a router started by this launcher share it; another
        cluster's differs."""
        return hashlib.sha256(f"{self._secret}/{purpose}".encode()).hexdigest()[:32]

    def _engine_config(self) -> EngineConfig:
        engine = {"prefix_cache_salt": self.derived_secret("prefix-cache"), **self.options.engine}
        return EngineConfig(model=self.model, **engine)

    def start_router(self, timeout: float = 60.0) -> None:
        """Start the router actors (or adopt detached ones of this cluster); wait until they
        serve (NOT_SERVING until the pools have workers). The first runs the pool manager."""
        opts = self.options
        # Routers are placed as the pools are (--pool-placement), by pdserve_router.
        placed = actor_resources(WorkerResources(placement=opts.pool_placement), "router",
                                 self._ray.cluster_resources())["resources"]
        for index in range(opts.num_routers):
            spec = self._router_spec(index, placed)
            router = adoptable_router(self._ray, spec.name, self.cluster_name, self.redis_url,
                                      timeout) or start_router_actor(spec, self.detached)
            self.routers.append(router)
        infos = self._ray.get([r.start.remote() for r in self.routers], timeout=timeout)
        self.router = self.routers[0]
        self.ports = [info["port"] for info in infos]
        self.port, self.metrics_port = infos[0]["port"], infos[0]["metrics_port"]
        self.http_port = infos[0].get("http_port")
        self._router_pids.update(info["pid"] for info in infos)

    def _router_spec(self, index: int, resources: dict) -> RouterSpec:
        """Router ``index``'s spec: the first one runs the pools (and the autoscaler)."""
        opts = self.options
        first = index == 0
        return RouterSpec(self.model, self.redis_url, self.cluster_name, opts.host, opts.port,
                          opts.metrics_port, opts.engine.get("max_model_len"), None, opts.router,
                          ttl_s=opts.ttl_s, log_level=opts.log_level,
                          pools=(PoolSettings(tuple(self.worker_specs()), detached=True,
                                              max_workers_per_pool=opts.max_workers_per_pool)
                                 if first else None),
                          http_port=opts.http_port, api_key=opts.api_key,
                          admin_api_key=opts.admin_api_key,
                          priority_api_keys=opts.priority_api_keys, tls=self.tls(),
                          prefix_cache_salt=self._engine_config().prefix_cache_salt,
                          record_key=self.derived_secret("redis-records"),
                          reflection=opts.reflection, tool_call_parser=opts.tool_call_parser,
                          max_concurrent_rpcs=opts.max_concurrent_rpcs,
                          autoscale=opts.autoscale if opts.autoscale.enabled and first else None,
                          name=router_name(index), resources=resources,
                          enable_lora=self._engine_config().enable_lora,
                          max_lora_rank=self._engine_config().max_lora_rank,
                          lora_modules=tuple((name, os.path.abspath(path)) for name, path
                                             in parse_lora_modules(opts.lora_modules)))

    def worker_specs(self) -> list[WorkerSpec]:
        """One template per pool role: the pool manager gives each worker a fresh id."""
        opts, config = self.options, self._engine_config()
        # Loopback for a local Ray; on a joined (maybe multi-node) cluster each worker
        # announces its node's address.
        transfer_host = "127.0.0.1" if opts.ray_address is None else ""
        # Each pool's device, decided once here (pdserve.cluster.node_placement): a CUDA
        # worker asks Ray for its GPU, so it can see one.
        cluster = self._ray.cluster_resources() if self._ray is not None else {}
        roles = list(self.pool_targets())
        asked = {role: opts.device_of(role, config.device) for role in roles}
        check_pool_devices(asked)
        devices = {role: resolve_device(device, cluster) for role, device in asked.items()}
        check_pool_devices(devices)
        if "cuda" in devices.values() and self._owns_ray:
            opts.check_local_gpus(int(cluster.get("GPU", 0)),
                                  [role for role, device in devices.items() if device == "cuda"])
        return [WorkerSpec(role, role, replace(config, device=devices[role],
                                               tensor_parallel_size=opts.ranks_of(role)),
                           self.redis_url,
                           self.cluster_name, transfer_host, opts.heartbeat_s, opts.ttl_s,
                           opts.lease_s, orphan_timeout_s=opts.orphan_timeout_s,
                           log_level=opts.log_level, join_token=self.derived_secret("kv-join"),
                           record_key=self.derived_secret("redis-records"),
                           resources=worker_resources(devices[role], opts.worker_cpus_of(role),
                                                      opts.pool_placement, opts.worker_gpus,
                                                      opts.ranks_of(role)))
                for role in roles]

    def pool_targets(self) -> dict[str, int]:
        """role -> the pool size the options ask for (to start with, when autoscaled)."""
        return self.options.initial_targets()

    def start_workers(self, timeout: float = 180.0) -> None:
        """Set the pool targets (the router's pool manager starts the workers), then wait
        until every pool has its target of ready workers."""
        self._ray.get(self.router.set_pool_targets.remote(self.pool_targets()), timeout=30)
        self.wait_pools(timeout)
        self.refresh_workers()
        logger.info("workers up: %s", ", ".join(sorted(self.workers)))

    def wait_pools(self, timeout: float = 180.0) -> list:
        """Block until each pool has ``target`` ready workers; returns the pools. A failed
        worker start raises :class:`WorkerStartError` with the worker's error."""
        deadline = time.monotonic() + timeout
        while True:
            pools = self._ray.get(self.router.pools_info.remote(), timeout=30)
            failed = [p for p in pools if p.last_error and p.ready < p.target]
            if failed:
                raise WorkerStartError(f"{failed[0].role} worker failed to start: "
                                       f"{failed[0].last_error}")
            if all(p.ready == p.target and not p.starting for p in pools):
                return pools
            if time.monotonic() > deadline:
                raise TimeoutError(f"pools not at their targets after {timeout:.0f} s: {pools}")
            time.sleep(0.1)

    def refresh_workers(self) -> list:
        """Re-read the pools' workers from the router (replacements appear, the dead go);
        returns the router's WorkerInfo list."""
        infos = self._ray.get(self.router.list_workers.remote(), timeout=30)
        live = {w.worker_id: w for w in infos if w.state != "dead"}
        for worker_id in set(self.workers) - set(live):
            del self.workers[worker_id]
        namespace = cluster_namespace(self.cluster_name)
        for worker_id, info in live.items():
            if worker_id not in self.workers:
                try:
                    self.workers[worker_id] = self._ray.get_actor(worker_id, namespace=namespace)
                except ValueError:
                    continue  # gone since the router listed it
            if info.pid:
                self.worker_info[worker_id] = {"worker_id": worker_id, "role": info.role,
                                               "pid": info.pid, "node_ip": info.node}
        return infos

    def tls(self) -> TLSConfig | None:
        """The options' TLS files, read here (ValueError naming the setting)."""
        opts = self.options
        return TLSConfig.from_files(opts.tls_cert, opts.tls_key, opts.tls_client_ca)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until health says SERVING (``PdserveError`` after ``timeout``); with TLS, or
        on a joined cluster (the routers may run on other nodes), or with several routers,
        the router actors are asked instead (this process may hold no client certificate)."""

        opts = self.options
        if opts.tls_cert is None and opts.ray_address is None and len(self.routers) <= 1:
            with PdserveClient(self.target) as client:
                client.wait_ready(timeout)
            return
        deadline = time.monotonic() + timeout
        while not all(self._ray.get([r.is_serving.remote() for r in self.routers],
                                    timeout=timeout)):
            if time.monotonic() > deadline:

                raise PdserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"server not SERVING after {timeout} s")
            time.sleep(0.1)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what it serves -------------------------------------------------------------------
    @property
    def target(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"{host}:{self.port}"

    @property
    def targets(self) -> list[str]:
        """Every router's gRPC address (``target`` is the first's); on one machine."""
        host = self.target.rsplit(":", 1)[0]
        return [f"{host}:{port}" for port in self.ports]

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible HTTP API (``.../v1`` is the client's base_url)."""
        if self.http_port is None:
            return None
        scheme = "https" if self.options.tls_cert else "http"
        return f"{scheme}://{self.target.rsplit(':', 1)[0]}:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.target.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"

    def traces(self, timeout: float = 30.0) -> list:
        return self._ray.get(self.router.traces.remote(), timeout=timeout)

    def worker_stats(self, timeout: float = 30.0) -> dict:
        """worker_id -> WorkerStats, asked of each live worker actor directly."""
        self.refresh_workers()
        refs = {wid: actor.stats.remote() for wid, actor in self.workers.items()}
        out = {}
        for wid, ref in refs.items():
            try:
                out[wid] = self._ray.get(ref, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - a dead worker has no stats
                logger.info("no stats from %s: %s", wid, exc)
        return out

    def kill_worker(self, worker_id: str) -> None:
        """Kill one worker actor abruptly (no close), as a crash would."""
        if worker_id not in self.workers:
            self.refresh_workers()
        self._ray.kill(self.workers.pop(worker_id), no_restart=True)

    def kill_worker_process(self, worker_id: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a (local) worker's OS process, as the kernel or an operator would;
        returns its pid."""
        if worker_id not in self.worker_info:
            self.refresh_workers()
        pid = self.worker_info[worker_id]["pid"]
        os.kill(pid, sig)
        return pid

    def started_pids(self) -> set[int]:
        """Processes this cluster started (local ones): actors (replacement workers and a
        restarted router included), redis child, a local Ray."""
        pids = self._ray_pids | self.actor_pids()
        if self._redis is not None and self._redis.process is not None:
            pids.add(self._redis.process.pid)
        return pids

    def actor_pids(self, timeout: float = 10.0) -> set[int]:
        """Every actor pid seen: workers listed or recorded by the pool manager, and each
        router's (its current one asked now, within ``timeout`` s for them all)."""
        if self.store is not None:
            self._worker_pids.update(pid for _node, pid in quiet_value(self.store.pids, set()))
        deadline = Deadline(timeout)
        for router in self.routers if self._ray is not None else []:
            info = quiet_value(lambda r=router: self._ray.get(r.info.remote(),
                                                              timeout=deadline.left()), None)
            if info is not None:
                self._router_pids.add(info["pid"])
        listed = {info["pid"] for info in self.worker_info.values()}
        return listed | self._worker_pids | self._router_pids

    # -- stop -----------------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> None:
        """Stop everything this cluster started (idempotent) within about ``timeout`` s
        (default ``options.stop_timeout_s``): each step gets what is left, and the local
        processes it started that still run then are killed. A half-started cluster (a
        signal during its start, a local Ray's init included) stops the same way."""
        if self._stopped:
            return
        self._stopped = True
        deadline = Deadline(self.options.stop_timeout_s if timeout is None else timeout)
        keep = self.detached and self.options.detach_on_stop
        local = self.options.ray_address is None and not keep  # actors ran on this machine
        actor_pids = self.actor_pids(deadline.left(0.25)) if local else set()
        if self._ray is not None:
            if keep:
                logger.info("leaving cluster %s running (detach_on_stop)", self.cluster_name)
            else:
                self._stop_actors(deadline)
        if self._owns_ray:
            self._shutdown_local_ray()
        # what a stop left running gets a short grace (a half-started Ray's GCS ignores
        # SIGTERM for long), never more than the budget left
        end_processes(actor_pids | self._ray_pids, min(deadline.left(), END_GRACE_S))
        self._end_session_leftovers()
        if self._ray_temp_dir is not None:
            shutil.rmtree(self._ray_temp_dir, ignore_errors=True)
        if self.store is not None:
            if not keep:
                quietly(self.store.clear, "clearing the cluster's Redis keys")
            self.store.close()
        if self._redis is not None:
            self._redis.stop()
        logger.info("cluster %s stopped", self.cluster_name)

    def _end_session_leftovers(self, rounds: int = 3) -> None:
        """End what still names the local Ray's session folder: a raylet stopped while it
        started spawns its agents late, and they outlive it."""
        for _ in range(rounds if self._owns_ray and self._ray_temp_dir else 0):
            leftovers = pids_naming(self._ray_temp_dir)
            if not leftovers:
                return
            end_processes(leftovers, END_GRACE_S / 2)

    def _shutdown_local_ray(self) -> None:
        """Shut down the Ray this cluster started (a half-started one too); every child
        process but Redis is Ray's, and is ended with the actors."""

        redis = {self._redis.process.pid} if self._redis and self._redis.process else set()
        self._ray_pids |= child_pids() - redis
        quietly(ray.shutdown, "Ray shutdown")
        logger.info("local Ray shut down")

    def _stop_actors(self, deadline: Deadline) -> None:
        ray = self._ray
        # Routers first (half the time left): a pool manager must not replace what goes now.
        routers = [router.stop.remote() for router in self.routers]
        quietly(lambda: ray.wait(routers, num_returns=len(routers), timeout=deadline.left(0.5)),
                "router stop")
        workers = named_workers(ray, self.cluster_name)
        closing = [a.close.remote() for a in workers]
        quietly(lambda: ray.wait(closing, num_returns=len(closing), timeout=deadline.left(0.5)),
                "worker close")
        for actor in [*workers, *self.routers]:
            quietly(lambda actor=actor: ray.kill(actor, no_restart=True), "actor kill")
        self.workers.clear()
        self.routers.clear()
        self.router = None
