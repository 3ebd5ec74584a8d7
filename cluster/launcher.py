"""The embedded cluster: Ray, Redis, worker actors and the router actor, started and stopped
as one thing (``pdserve serve``, ``pdserve demo``, the e2e tests).

Start order (:meth:`EmbeddedCluster.start`): Ray (local on loopback unless ``ray_address``),
redis-server child (unless ``redis_url``), the router actor (gRPC up, NOT_SERVING), the worker
actors (each heartbeats into Redis once built; the router picks them up and turns SERVING).
:meth:`EmbeddedCluster.stop` undoes exactly what was started, in reverse, and is idempotent:
router stopped, workers closed and killed, Ray shut down only if this cluster started it,
Redis stopped only if this cluster started it. Processes it started (actor processes, the
redis-server child, and a local Ray's own processes) are listed by :meth:`started_pids`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import psutil

from pdserve.cluster.actors import WorkerSpec, start_worker_actor
from pdserve.cluster.ray_env import init_ray
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.router_actor import RouterSpec, start_router_actor
from pdserve.engine.config import EngineConfig
from pdserve.router.core import RouterConfig

logger = logging.getLogger(__name__)


@dataclass
class ClusterOptions:
    """What ``pdserve serve`` is asked for (DESIGN.md section 4), plus test knobs."""

    model: str | None = None  # checkpoint folder; None = the built-in tiny model
    num_prefill: int = 1  # prefill worker actors (disaggregated mode)
    num_decode: int = 1  # decode worker actors, or colocated workers with ``colocated``
    colocated: bool = False  # one pool of workers doing both phases
    host: str = "127.0.0.1"  # gRPC and metrics bind address
    port: int = 50051  # gRPC port; 0 = any free port
    metrics_port: int | None = 9400  # Prometheus port; 0 = any free port, None = off
    ray_address: str | None = None  # join this Ray cluster instead of starting one
    redis_url: str | None = None  # use this Redis instead of starting a child
    engine: dict = field(default_factory=dict)  # EngineConfig overrides for every worker
    router: RouterConfig = field(default_factory=RouterConfig)
    cluster_name: str = ""  # registry prefix / Ray namespace suffix; "" = a fresh one
    heartbeat_s: float = 1.0  # worker registry heartbeat period
    ttl_s: float = 5.0  # registry record TTL: a worker without heartbeat this long is gone
    lease_s: float = 60.0  # decode reservation lease: KV must arrive within it
    log_level: str = "WARNING"  # logging level inside actor processes
    ray_num_cpus: int | None = None  # CPUs a local Ray advertises (None = all)

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if not self.colocated and self.num_prefill < 1:
            raise ValueError(f"num_prefill must be >= 1, got {self.num_prefill}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be > 0 and < ttl_s "
                             f"({self.ttl_s})")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


class EmbeddedCluster:
    """``with EmbeddedCluster(ClusterOptions(...)) as c: c.wait_ready(); c.target``."""

    def __init__(self, options: ClusterOptions | None = None):
        self.options = options or ClusterOptions()
        self.cluster_name = self.options.cluster_name or f"pd{uuid.uuid4().hex[:8]}"
        self.model: str | None = None
        self.redis_url: str | None = None
        self.port: int | None = None  # bound gRPC port
        self.metrics_port: int | None = None  # bound metrics port
        self.router = None  # router actor handle
        self.workers: dict[str, object] = {}  # worker_id -> actor handle
        self.worker_info: dict[str, dict] = {}  # worker_id -> ready() answer (pid, role, ...)
        self._ray = None
        self._owns_ray = False
        self._redis: RedisServer | None = None
        self._ray_pids: set[int] = set()
        self._ray_temp_dir: str | None = None  # a local Ray's session dir, removed on stop
        self._router_pid: int | None = None
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
        import ray

        opts = self.options
        self._owns_ray = not ray.is_initialized() and not opts.ray_address
        before = _child_pids()
        if self._owns_ray:  # short: Ray's socket paths live under it
            self._ray_temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
        self._ray = init_ray(opts.ray_address, self._ray_temp_dir, opts.ray_num_cpus)
        if self._owns_ray:
            self._ray_pids = _child_pids() - before
        if opts.redis_url:
            self.redis_url = opts.redis_url
        else:
            self._redis = RedisServer().start()
            self.redis_url = self._redis.url
        if opts.model is None:
            from pdserve.models import tiny_model_dir

            self.model = str(tiny_model_dir())
            logger.info("no --model: serving the built-in tiny model (random weights) from %s",
                        self.model)
        else:
            self.model = str(opts.model)

    def _engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, **self.options.engine)

    def start_router(self, timeout: float = 60.0) -> None:
        opts = self.options
        spec = RouterSpec(self.model, self.redis_url, self.cluster_name, opts.host, opts.port,
                          opts.metrics_port, opts.engine.get("max_model_len"), None, opts.router,
                          ttl_s=opts.ttl_s, log_level=opts.log_level)
        self.router = start_router_actor(spec)
        info = self._ray.get(self.router.start.remote(), timeout=timeout)
        self.port, self.metrics_port = info["port"], info["metrics_port"]
        self._router_pid = info["pid"]

    def worker_specs(self) -> list[WorkerSpec]:
        opts, config = self.options, self._engine_config()
        # Loopback for a local Ray; on a joined (maybe multi-node) cluster each worker
        # announces its node's address.
        transfer_host = "127.0.0.1" if opts.ray_address is None else ""
        roles = (["colocated"] * opts.num_decode if opts.colocated
                 else ["prefill"] * opts.num_prefill + ["decode"] * opts.num_decode)
        counts: dict[str, int] = {}
        specs = []
        for role in roles:
            index = counts[role] = counts.get(role, -1) + 1
            specs.append(WorkerSpec(f"{role}-{index}", role, config, self.redis_url,
                                    self.cluster_name, transfer_host, opts.heartbeat_s,
                                    opts.ttl_s, opts.lease_s, log_level=opts.log_level))
        return specs

    def start_workers(self, timeout: float = 180.0) -> None:
        """Create every worker actor at once, then wait until each has registered."""
        specs = self.worker_specs()
        for spec in specs:
            self.workers[spec.worker_id] = start_worker_actor(spec)
        answers = self._ray.get([a.ready.remote() for a in self.workers.values()],
                                timeout=timeout)
        for answer in answers:
            self.worker_info[answer["worker_id"]] = answer
        logger.info("workers up: %s", ", ".join(self.worker_info))

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until health says SERVING (``PdserveError`` after ``timeout``)."""
        from pdserve.api.client import PdserveClient

        with PdserveClient(self.target) as client:
            client.wait_ready(timeout)

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
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.target.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"

    def traces(self, timeout: float = 30.0) -> list:
        return self._ray.get(self.router.traces.remote(), timeout=timeout)

    def worker_stats(self, timeout: float = 30.0) -> dict:
        """worker_id -> WorkerStats, asked of each live worker actor directly."""
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
        self._ray.kill(self.workers.pop(worker_id), no_restart=True)

    def started_pids(self) -> set[int]:
        """Processes this cluster started (local ones): actors, redis child, a local Ray."""
        pids = set(self._ray_pids)
        pids.update(info["pid"] for info in self.worker_info.values())
        if self._router_pid is not None:
            pids.add(self._router_pid)
        if self._redis is not None and self._redis.process is not None:
            pids.add(self._redis.process.pid)
        return pids

    # -- stop -----------------------------------------------------------------------------
    def stop(self, timeout: float = 20.0) -> None:
        """Stop everything this cluster started (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        actor_pids = set()
        if self.options.ray_address is None:  # actors ran on this machine
            actor_pids = {info["pid"] for info in self.worker_info.values()}
            if self._router_pid is not None:
                actor_pids.add(self._router_pid)
        if self._ray is not None:
            self._stop_actors(timeout)
            if self._owns_ray:  # every child but Redis is Ray's now, and goes with it
                redis = {self._redis.process.pid} if self._redis and self._redis.process else set()
                self._ray_pids |= _child_pids() - redis
                self._ray.shutdown()
                logger.info("local Ray shut down")
        wait_gone(actor_pids | self._ray_pids, timeout)
        if self._ray_temp_dir is not None:
            shutil.rmtree(self._ray_temp_dir, ignore_errors=True)
        if self._redis is not None:
            self._redis.stop()
        logger.info("cluster %s stopped", self.cluster_name)

    def _stop_actors(self, timeout: float) -> None:
        ray = self._ray
        if self.router is not None:
            _quietly(lambda: ray.get(self.router.stop.remote(), timeout=timeout), "router stop")
        closing = [a.close.remote() for a in self.workers.values()]
        _quietly(lambda: ray.wait(closing, num_returns=len(closing), timeout=timeout),
                 "worker close")
        for actor in [*self.workers.values(), self.router]:
            if actor is not None:
                _quietly(lambda actor=actor: ray.kill(actor, no_restart=True), "actor kill")
        self.workers.clear()
        self.router = None


def _quietly(fn, what: str) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - stopping goes on whatever failed
        logger.warning("%s failed: %s", what, exc)


def _child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); returns the survivors."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if is_running(pid)}
        if alive:
            time.sleep(0.05)
    if alive:
        logger.warning("processes still running after stop: %s", sorted(alive))
    return alive


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
