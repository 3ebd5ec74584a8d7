"""What an embedded cluster is started with (``ClusterOptions``): the engine and router
configs, the pools' shape and placement, Ray and Redis, security, and their cross-checks.
``pdserve serve`` builds it from its flags (cli/settings.py); the launcher
(cluster/launcher.py) starts what it describes."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.cluster.autoscale.config import SCALED_ROLES, AutoscaleConfig
from pdserve.cluster.node_placement import (
    PLACEMENTS,
)
from pdserve.cluster.pools.plan import MAX_WORKERS_PER_POOL
from pdserve.router.auth import Access
from pdserve.router.core import RouterConfig
from pdserve.router.tool_calling import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

POOL_DEVICES = ("auto", "cpu", "cuda")  # ClusterOptions.prefill_device / decode_device


@dataclass
class ClusterOptions:
    """What ``pdserve serve`` is asked for (docs/interfaces.md), plus test knobs."""

    model: str | None = None  # checkpoint folder; None = the built-in tiny model
    num_prefill: int = 1  # prefill worker actors (disaggregated mode)
    num_decode: int = 1  # decode worker actors, or colocated workers with ``colocated``
    colocated: bool = False  # one pool of workers doing both phases
    host: str = "127.0.0.1"  # gRPC, HTTP and metrics bind address (0.0.0.0: every interface)
    port: int = 50051  # gRPC port; 0 = any free port
    metrics_port: int | None = 9400  # Prometheus port; 0 = any free port, None = off
    http_port: int | None = None  # OpenAI-compatible HTTP port; 0 = any free port, None = off
    api_key_file: str | None = None  # file holding the inference API key: clients must send
    # "Authorization: Bearer KEY" on HTTP and gRPC Generation (health stays open); default:
    # $PDSERVE_API_KEY
    admin_api_key_file: str | None = None  # file holding the admin key: pdserve.v1.Admin
    # (pdserve status, drain) and /metrics need it; without one Admin answers only loopback
    # callers and /metrics is open; default: $PDSERVE_ADMIN_API_KEY
    priority_api_key_file: str | None = None  # file of keys (one a line) that may also ask
    # priority < 0 (ahead of the default); default: $PDSERVE_PRIORITY_API_KEYS (comma-separated)
    api_key: str | None = field(default=None, repr=False)  # the inference key itself (from
    # api_key_file or the environment; never a flag)
    admin_api_key: str | None = field(default=None, repr=False)  # the admin key itself
    priority_api_keys: tuple[str, ...] = field(default=(), repr=False)  # the priority keys
    tls_cert: str | None = None  # PEM certificate chain file: gRPC and HTTP speak TLS
    tls_key: str | None = None  # PEM private key file of tls_cert
    tls_client_ca: str | None = None  # PEM CA file: clients need a certificate it signed (mTLS)
    reflection: bool = True  # gRPC server reflection (grpcurl lists the services)
    tool_call_parser: str = "auto"  # how chat answers' tool calls are read: hermes (Qwen 2.5,
    # Hermes), llama3_json, mistral, none, or auto (from the chat template)
    max_concurrent_rpcs: int | None = 4096  # gRPC calls (and HTTP connections) in progress
    ray_address: str | None = None  # join this Ray cluster instead of starting one
    redis_url: str | None = field(default=None, repr=False)  # use this Redis instead of
    # starting a child; default: $PDSERVE_REDIS_URL (the only place a URL may hold a password)
    redis_password_file: str | None = None  # file holding the Redis password: of ``redis_url``,
    # or of the embedded Redis (default: $PDSERVE_REDIS_PASSWORD, else a generated one)
    redis_password: str | None = field(default=None, repr=False)  # the password itself
    max_workers_per_pool: int = MAX_WORKERS_PER_POOL  # no pool target above this: Admin's
    # SetPoolTarget (INVALID_ARGUMENT beyond), the autoscaler's maxima, --prefill, --decode
    engine: dict = field(default_factory=dict)  # EngineConfig overrides for every worker
    router: RouterConfig = field(default_factory=RouterConfig)
    cluster_name: str = ""  # registry prefix / Ray namespace suffix; "" = a fresh one, or
    # "default" when detached (so the next launcher finds the running cluster)
    num_routers: int = 1  # router actors serving the same pools through Redis (the first one
    # runs them), placed by the Ray resource pdserve_router as the pools are by theirs
    heartbeat_s: float = 1.0  # worker registry heartbeat period
    ttl_s: float = 5.0  # registry record TTL: a worker without heartbeat this long is gone
    lease_s: float = 60.0  # decode reservation lease: KV must arrive within it
    stop_timeout_s: float = 6.0  # stopping (SIGTERM, Ctrl-C) takes about this long at most:
    # routers and workers get what is left of it, then the processes still running are killed
    orphan_timeout_s: float = 30.0  # a decode or colocated worker frees the requests of a router
    # that has not polled it for this long (whatever other routers do)
    log_level: str = "WARNING"  # logging level inside actor processes
    ray_num_cpus: int | None = None  # CPUs a local Ray advertises (None: this machine's cores,
    # or what the pools ask for at their largest if that is more: they then share the cores)
    worker_cpus: int = 1  # CPUs each worker asks Ray for; a CPU worker runs that many torch
    # threads (0: asks for none and runs one)
    worker_gpus: float = 1.0  # GPUs each CUDA worker asks Ray for (0.5: two share one GPU,
    # each with its own --memory-budget-mib)
    prefill_worker_cpus: int | None = None  # CPUs (and torch threads) of each prefill
    # worker (None: worker_cpus): prefill is bound by compute
    decode_worker_cpus: int | None = None  # of each decode or colocated worker (None:
    # worker_cpus): decode is bound by memory bandwidth, which more threads share
    prefill_device: str | None = None  # auto | cpu | cuda for the prefill pool (None: device)
    decode_device: str | None = None  # for the decode or colocated pool (None: device)
    prefill_tensor_parallel_size: int | None = None  # ranks of each prefill worker (None:
    # the engine's tensor_parallel_size): prefill gains FLOPs from more devices
    decode_tensor_parallel_size: int | None = None  # ranks of each decode or colocated
    # worker (None: the engine's tensor_parallel_size)
    pool_placement: str = "auto"  # auto: each pool on the nodes advertising its Ray resource
    # pdserve_<role> when any does, else anywhere; require: only there; any: anywhere
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # pool autoscaler
    lora_modules: tuple[str, ...] = ()  # LoRA adapters served from the start, each NAME=PATH
    # (a PEFT folder) or {"name": NAME, "path": PATH}; needs enable_lora. More are loaded at
    # run time: POST /v1/load_lora_adapter, or pdserve admin lora load
    detached: bool | None = None  # the router actor outlives this process, so a later launcher
    # with the same cluster name and Redis adopts it and its pools (None: with --ray-address)
    detach_on_stop: bool = False  # stopping leaves a detached router and its pools running

    def __post_init__(self) -> None:
        self.lora_modules = tuple(self.lora_modules)
        if self.lora_modules and not self.engine.get("enable_lora"):
            raise ValueError("lora_modules needs enable_lora (the workers' adapter slots)")
        parse_lora_modules(self.lora_modules)
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if not self.colocated and self.num_prefill < 1:
            raise ValueError(f"num_prefill must be >= 1, got {self.num_prefill}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        Access(() if self.api_key is None else (self.api_key,), self.admin_api_key,
               self.priority_api_keys)  # ValueError for a malformed or shared key
        self._check_pool_sizes()
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1 or none, got "
                             f"{self.max_concurrent_rpcs}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be > 0 and < ttl_s "
                             f"({self.ttl_s})")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        fixed = [p for p in (self.port, self.metrics_port, self.http_port) if p]
        if self.num_routers > 1 and self.ray_address is None and fixed:
            raise ValueError(f"num_routers ({self.num_routers}) on one local node would bind "
                             f"port {fixed[0]} twice: give port, metrics_port and http_port 0 "
                             f"(any free port) or none, or join a cluster whose nodes advertise "
                             f"pdserve_router (ray_address)")
        for name in ("lease_s", "stop_timeout_s", "orphan_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.worker_cpus < 0:
            raise ValueError(f"worker_cpus must be >= 0, got {self.worker_cpus}")
        if not 0 < self.worker_gpus <= 1:
            raise ValueError(f"worker_gpus must be in (0, 1], got {self.worker_gpus}")
        self._check_pool_settings()
        self._check_tensor_parallel()
        if self.pool_placement not in PLACEMENTS:
            raise ValueError(f"pool_placement must be one of {PLACEMENTS}, "
                             f"got {self.pool_placement!r}")
        if self.autoscale.enabled and self.colocated:
            raise ValueError("autoscale scales prefill and decode pools: it needs "
                             "disaggregated mode (not colocated)")
        if self.autoscale.enabled and sum(self.initial_targets().values()) \
                > self.autoscale.budget:
            raise ValueError(f"num_prefill + num_decode ({self.num_prefill + self.num_decode}) "
                             f"exceed the autoscaler's max_workers ({self.autoscale.budget})")

    def _check_pool_settings(self) -> None:
        """Each pool's own CPUs and device, where given."""
        for role in ("prefill", "decode"):
            cpus, device = getattr(self, f"{role}_worker_cpus"), getattr(self, f"{role}_device")
            if cpus is not None and cpus < 0:
                raise ValueError(f"{role}_worker_cpus must be >= 0, got {cpus}")
            if device is not None and device not in POOL_DEVICES:
                raise ValueError(f"{role}_device must be one of {', '.join(POOL_DEVICES)}, "
                                 f"got {device!r}")

    def _check_tensor_parallel(self) -> None:
        """Each pool's group size; tensor parallel ranks take whole GPUs."""
        for role in ("prefill", "decode"):
            own = getattr(self, f"{role}_tensor_parallel_size")
            if own is not None and (isinstance(own, bool) or not isinstance(own, int)
                                    or own < 1):
                raise ValueError(f"{role}_tensor_parallel_size must be a positive integer, "
                                 f"got {own!r}")
        ranks = max(self.ranks_of(role) for role in ("prefill", "decode"))
        if ranks > 1 and self.worker_gpus != 1:
            raise ValueError(f"tensor_parallel_size ({ranks}) gives each rank a whole GPU: "
                             f"worker_gpus must be 1, got {self.worker_gpus}")

    def ranks_of(self, role: str) -> int:
        """Processes (tensor parallel ranks) each worker of pool ``role`` runs, each on its
        pool's CPUs (and one GPU on CUDA): the pool's own size, else the engine's
        tensor_parallel_size (a colocated pool takes decode's)."""
        own = (self.prefill_tensor_parallel_size if role == "prefill"
               else self.decode_tensor_parallel_size)
        return int(self.engine.get("tensor_parallel_size", 1)) if own is None else own

    def _check_pool_sizes(self) -> None:
        if self.max_workers_per_pool < 1:
            raise ValueError(f"max_workers_per_pool must be >= 1, got {self.max_workers_per_pool}")
        sizes = {"num_decode": self.num_decode}
        if not self.colocated:
            sizes["num_prefill"] = self.num_prefill
        if self.autoscale.enabled:
            sizes.update((f"autoscale max_{role}", self.autoscale.bounds(role)[1])
                         for role in SCALED_ROLES)
        for name, size in sizes.items():
            if size > self.max_workers_per_pool:
                raise ValueError(f"{name} ({size}) exceeds max_workers_per_pool "
                                 f"({self.max_workers_per_pool}): lower it, or raise "
                                 f"max_workers_per_pool")

    def worker_cpus_of(self, role: str) -> int:
        """CPUs each worker of pool ``role`` asks for (a colocated pool takes decode's)."""
        own = self.prefill_worker_cpus if role == "prefill" else self.decode_worker_cpus
        return self.worker_cpus if own is None else own

    def device_of(self, role: str, device: str) -> str:
        """The device setting of pool ``role`` ("auto" | "cpu" | "cuda", not resolved yet);
        ``device``: the engine's, which a pool without its own follows."""
        own = self.prefill_device if role == "prefill" else self.decode_device
        return device if own is None else own

    def initial_targets(self) -> dict[str, int]:
        """role -> the pool size to start with (within the autoscaler's bounds when on)."""
        if self.colocated:
            return {"colocated": self.num_decode}
        sizes = {"prefill": self.num_prefill, "decode": self.num_decode}
        if self.autoscale.enabled:
            for role in SCALED_ROLES:
                low, high = self.autoscale.bounds(role)
                sizes[role] = min(high, max(low, sizes[role]))
        return sizes

    def max_workers(self) -> int:
        """Workers the pools may hold at once (the autoscaler's budget when on)."""
        if self.autoscale.enabled:
            return self.autoscale.budget
        return sum(self.initial_targets().values())

    def local_ray_cpus(self, cores: int | None = None) -> int:
        """CPUs a local Ray (no ``ray_address``) advertises: ``ray_num_cpus``, or the
        machine's ``cores`` raised to what the pools ask for at their largest. ValueError when
        an explicit ``ray_num_cpus`` cannot hold them (workers would wait forever)."""
        per_worker = max(self.worker_cpus_of(role) * self.ranks_of(role)
                         for role in self.initial_targets())
        needed = per_worker * self.max_workers()  # (any mix of the pools the budget allows)
        if self.ray_num_cpus is not None:
            if self.ray_num_cpus < needed:
                raise ValueError(
                    f"ray_num_cpus ({self.ray_num_cpus}) cannot hold {self.max_workers()} "
                    f"workers asking up to {per_worker} CPU(s) each (worker_cpus and the "
                    f"pools' own): raise ray_num_cpus to {needed}, or lower them")
            return self.ray_num_cpus
        cores = cores or os.cpu_count() or 1
        if needed > cores:
            logger.warning("%d workers x up to %d CPU(s) (--worker-cpus) on %d cores: the local "
                           "Ray advertises %d CPUs and the workers share the cores",
                           self.max_workers(), per_worker, cores, needed)
        return max(cores, needed)

    def check_local_gpus(self, gpus: int, roles: Iterable[str] | None = None) -> None:
        """ValueError when a local Ray's ``gpus`` cannot hold the CUDA pools (``roles``;
        default: every pool) at their largest (a worker that finds no GPU would wait
        forever)."""
        roles = set(self.initial_targets()) if roles is None else set(roles)
        if not roles:
            return
        workers = (self.max_workers() if roles >= set(self.initial_targets())
                   else sum(self.initial_targets()[role] for role in roles))
        ranks = max(self.ranks_of(role) for role in roles)
        needed = self.worker_gpus * workers * ranks
        if needed > gpus + 1e-9:
            if ranks > 1:  # tensor parallel ranks take whole GPUs
                raise ValueError(f"{workers} workers of {ranks} tensor parallel ranks need "
                                 f"{needed:g} GPUs and this machine has {gpus}: run fewer "
                                 f"workers, or smaller groups")
            share = max(0.01, gpus / workers)
            raise ValueError(
                f"{workers} workers asking {self.worker_gpus:g} GPU each "
                f"(worker_gpus) need {needed:g} GPUs and this machine has {gpus}: lower "
                f"worker_gpus to {share:.2g} (workers share a GPU; give each a "
                f"memory_budget_bytes), or run fewer workers")


def parse_lora_module(text: str) -> tuple[str, str]:
    """(name, path) of one ``--lora-modules`` entry: ``NAME=PATH`` or vLLM's JSON form
    ``{"name": NAME, "path": PATH}``; ValueError saying what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules entry {text[:80]!r} is not JSON: {exc}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("path"), str):
            raise ValueError(f"lora_modules entry {text[:80]!r} must be an object with "
                             f"string fields name and path")
        name, path = value["name"], value["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"lora_modules entry {text[:80]!r} must be NAME=PATH or "
                             f'{{"name": NAME, "path": PATH}}')
    if not name or not path:
        raise ValueError(f"lora_modules entry {text[:80]!r} needs a non-empty name and path")
    if len(name) > 256:
        raise ValueError(f"lora_modules entry {name[:40]!r}...: a name has at most 256 "
                         f"characters")
    return name, path


def parse_lora_modules(entries: Iterable[str]) -> list[tuple[str, str]]:
    """Every entry of ``--lora-modules`` parsed; ValueError for a bad one or a name twice."""
    pairs = [parse_lora_module(entry) for entry in entries]
    names = [name for name, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"lora_modules names {', '.join(map(repr, twice))} more than once")
    return pairs
