"""The router as a Ray actor: ``Router`` + the gRPC front door (Generation and Admin) +
Prometheus + the pool manager, on one event loop.

Lifecycle:

1. Created by name ("router") in the cluster's Ray namespace with ``num_cpus=0`` and
   ``max_restarts=-1``: if its process dies, Ray starts it again (detached on a long-lived
   cluster, so it outlives the ``pdserve serve`` that created it).
   With ``--routers N`` there are N router actors, ``router`` and ``router-1`` ...; only
   ``router`` runs the pool manager (and the autoscaler and Admin); the others serve the same
   pools from the same registry in Redis. Each asks Ray for one unit of ``pdserve_router``
   as a worker asks for its pool's resource (``--pool-placement``): on nodes advertising one
   unit each, every router has a node of its own (one router pod each on Kubernetes).
2. ``start()`` (idempotent) reads the model's limits and tokenizer from the checkpoint folder,
   builds the ``Router`` over a :class:`ResilientDirectory` (``pdserve.cluster.control_plane``:
   it keeps routing to the workers it knows while Redis is away or lost their records, and
   reports degraded), starts the pool manager
   (``pdserve.cluster.pools.manager``; it adopts the live workers Redis lists) and, with
   ``autoscale`` enabled, the autoscaler that moves its targets
   (``pdserve.cluster.autoscale.runner``), the gRPC server
   (``grpc.aio`` on the actor's event loop; health NOT_SERVING until a prefill and a decode
   worker, or a colocated one, are registered; ``pdserve.v1.Admin`` beside Generation), the
   LoRA adapter registry (``pdserve.cluster.adapters``: the first router keeps it, the others
   mirror it from Redis; the doors resolve a request's ``model`` against it), the
   OpenAI-compatible HTTP server when ``http_port`` is set (uvicorn on the same loop, over the
   same ``Router``; chat through the checkpoint's template) and the metrics HTTP server; the
   API and priority keys, TLS, reflection and concurrency settings apply to gRPC and HTTP
   alike, the admin key to Admin and the metrics port (``pdserve.router.auth``); the bound
   gRPC and metrics ports go to Redis; returns the ports.
3. Requests flow; ``traces()`` and ``worker_stats()`` report what happened (the demo);
   ``set_pool_targets`` / ``pools`` / ``list_workers`` are the launcher's view of the pools.
4. A restarted incarnation calls its own ``start()`` from the constructor and binds the ports
   the previous one saved in Redis, so clients reconnect to the same address; only the streams
   that were open on the dead process failed. If it is not serving within
   ``restart_serving_s`` (its start failed or hung), it exits and Ray starts another.
5. ``stop()`` stops the pool manager (the workers keep running for the launcher to remove),
   reports NOT_SERVING, stops the gRPC server (in-flight calls are cancelled, which aborts
   their KV on the workers) and the router; the launcher then kills the actor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import ray

from pdserve.cluster.actors import cluster_namespace, limit_process_threads
from pdserve.cluster.adapters import AdapterMirror, AdapterRegistry, AdapterStore, LoraSettings
from pdserve.cluster.admin import FORWARDED, ClusterAdmin, ForwardingAdmin
from pdserve.cluster.autoscale.config import AutoscaleConfig
from pdserve.cluster.autoscale.runner import AutoscaleRunner
from pdserve.cluster.control_plane import ControlPlaneHealth, ResilientDirectory
from pdserve.cluster.pools.manager import PoolManager
from pdserve.cluster.pools.settings import PoolSettings
from pdserve.cluster.pools.store import PoolStore
from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.registry import Registry
from pdserve.models.chat_template import load_chat_template
from pdserve.models.checkpoint import open_checkpoint
from pdserve.router.adapters import ServedAdapters
from pdserve.router.admin_server import AdminUnavailableError, PoolInfo, WorkerInfo
from pdserve.router.auth import TLSConfig
from pdserve.router.backend import ModelSpec
from pdserve.router.constraints import ConstraintChecker
from pdserve.router.core import RequestTrace, Router, RouterConfig
from pdserve.router.errors import RequestValidationError
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.http_server import HttpServer
from pdserve.router.metrics import RouterMetrics
from pdserve.router.otel import build_tracing
from pdserve.router.tool_calling import parser_for

logger = logging.getLogger(__name__)

ROUTER_NAME = "router"


@dataclass(frozen=True)
class RouterSpec:
    """Everything the router actor is built from."""

    model: str  # checkpoint folder: tokenizer and limits
    redis_url: str = field(repr=False)  # the registry the workers heartbeat into (may hold
    # its password: never shown)
    cluster: str  # registry key prefix and Ray namespace suffix
    host: str = "127.0.0.1"  # gRPC (and metrics) bind address
    port: int = 50051  # gRPC port; 0 = any free port
    metrics_port: int | None = 9400  # Prometheus port; 0 = any free port, None = off
    max_model_len: int | None = None  # the workers' context limit (None = the model's)
    model_name: str | None = None  # reported to clients (default: the folder name)
    config: RouterConfig = field(default_factory=RouterConfig)
    health_poll_s: float = 0.25  # how often health re-checks readiness
    ttl_s: float = 5.0  # registry TTL (the workers' setting)
    log_level: str = "WARNING"  # logging level inside the actor process
    pools: PoolSettings | None = None  # the pool manager's settings (None: no pool manager)
    bind_attempts: int = 20  # tries to bind the ports after a restart (the dead process may
    # still hold them for a moment); a first start tries once
    restart_serving_s: float = 45.0  # a restarted router not serving by then exits, and Ray
    # starts it again (a restart that failed or hung never leaves the port dark for good)
    http_port: int | None = None  # OpenAI-compatible HTTP port; 0 = any free port, None = off
    api_key: str | None = field(default=None, repr=False)  # required on HTTP and gRPC
    # Generation (not health)
    admin_api_key: str | None = field(default=None, repr=False)  # required on Admin and
    # /metrics (None: Admin answers loopback callers only, /metrics is open)
    priority_api_keys: tuple[str, ...] = field(default=(), repr=False)  # inference keys that
    # may also ask priority < 0
    tls: TLSConfig | None = None  # TLS (mutual with a client CA) for gRPC and HTTP
    prefix_cache_salt: str | None = field(default=None, repr=False)  # the workers' salt: the
    # router hashes prompts as they do to read its KV index (None: no prefix-aware choice)
    record_key: str = field(default="", repr=False)  # the cluster's key: workers' records,
    # KV events and drain marks in Redis are signed with it (required to run)
    reflection: bool = True  # gRPC server reflection
    tool_call_parser: str = "auto"  # how chat answers' tool calls are read (tool_calling)
    max_concurrent_rpcs: int | None = None  # gRPC calls / HTTP connections in progress, at most
    autoscale: AutoscaleConfig | None = None  # the autoscaler (needs pools; None or not
    # enabled: fixed targets)
    name: str = ROUTER_NAME  # the actor's name; "router" runs the pools, "router-<i>" serve
    # beside it
    resources: dict = field(default_factory=dict)  # Ray custom resources it asks for
    # ({"pdserve_router": 1} where nodes advertise it)
    enable_lora: bool = False  # the workers serve LoRA adapters (the registry takes loads)
    max_lora_rank: int = 16  # the workers' max_lora_rank: loads above it are refused
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) registered at a cluster's
    # first start (--lora-modules); a restarted router adopts the registry in Redis instead


class ModelPromptTools:
    """``PromptTools`` (pdserve.router.http_server) over the checkpoint's tokenizer."""

    def __init__(self, tokenizer, model_dir: str, tool_call_parser: str = "auto") -> None:
        self._tokenizer = tokenizer
        self._template = load_chat_template(model_dir, tokenizer) if tokenizer else None
        self.has_chat_template = self._template is not None
        self.tool_call_parser = parser_for(tool_call_parser, self._template and
                                           self._template.source)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> list[int]:
        text = self._template.render(messages, add_generation_prompt, tools)
        return self._tokenizer.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return str(token_id)
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def model_spec_for(model_dir: str, max_model_len: int | None = None,
                   model_name: str | None = None):
    """(ModelSpec, tokenizer or None) of a checkpoint folder, as the workers will serve it."""
    checkpoint = open_checkpoint(model_dir)
    mc = checkpoint.model_config
    try:
        tokenizer = checkpoint.tokenizer()
    except (FileNotFoundError, ValueError) as exc:
        logger.warning("no tokenizer (%s): token-id prompts only", exc)
        tokenizer = None
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(mc.eos_token_ids)
    spec = ModelSpec(model_name or Path(model_dir).name,
                     max_model_len or mc.max_position_embeddings, mc.vocab_size,
                     tuple(t for t in eos if 0 <= t < mc.vocab_size))
    return spec, tokenizer


class RouterActor:
    """See the module docstring."""

    def __init__(self, spec: RouterSpec):
        limit_process_threads(spec.log_level)
        self.spec = spec
        self.router: Router | None = None
        self.server: GenerationServer | None = None
        self.http: HttpServer | None = None
        self._tools: ModelPromptTools | None = None
        self.directory: ResilientDirectory | None = None
        self.pools: PoolManager | None = None
        self.autoscaler: AutoscaleRunner | None = None
        self.admin: ClusterAdmin | ForwardingAdmin | None = None
        self.adapters: AdapterRegistry | AdapterMirror | None = None  # the LoRA registry
        # (the first router) or its mirror (the others)
        self._metrics_server = None
        self._info: dict | None = None  # start()'s answer once serving
        self._start_lock: asyncio.Lock | None = None
        context = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray deprecates an attribute this property reads
            warnings.simplefilter("ignore", DeprecationWarning)
            reconstructed = context.was_current_actor_reconstructed
        self._reconstructed = reconstructed  # a restart: the old process may hold the ports
        if reconstructed:
            logger.warning("router restarted by Ray: serving again")
            self._restart = context.current_actor.start.remote()  # runs once __init__ returns
            threading.Thread(target=self._exit_unless_serving, args=(spec.restart_serving_s,),
                             name="restart-watchdog", daemon=True).start()

    def _exit_unless_serving(self, timeout_s: float) -> None:
        time.sleep(timeout_s)
        if self._info is None:
            logger.error("restarted router not serving after %.0f s; exiting so that Ray "
                         "starts it again", timeout_s)
            os._exit(1)

    async def start(self) -> dict:
        """Serve (idempotent); returns {"port", "metrics_port", "pid"}."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._info is None:
                self._info = await self._start()
        return self._info

    async def _start(self) -> dict:
        spec = self.spec
        model, tokenizer = await asyncio.to_thread(model_spec_for, spec.model, spec.max_model_len,
                                                   spec.model_name)

        def tokenize(text: str) -> list[int]:
            if tokenizer is None:
                raise RequestValidationError("text", "the model has no tokenizer; send token_ids")
            return tokenizer.encode(text)

        self._tools = await asyncio.to_thread(ModelPromptTools, tokenizer, spec.model,
                                         spec.tool_call_parser)
        metrics = RouterMetrics()
        health = ControlPlaneHealth(metrics)
        registry = Registry(spec.redis_url, spec.cluster, spec.ttl_s, health.count_malformed,
                            health.count_untrusted, auth=RecordAuth(spec.record_key))
        store = PoolStore(spec.redis_url, spec.cluster, health.count_malformed)
        self.directory = ResilientDirectory(registry, cluster_namespace(spec.cluster), spec.name,
                                            health)
        constraints = None if tokenizer is None else ConstraintChecker(
            tokenizer, model.vocab_size, spec.config.grammar_check_timeout_s)
        # (the OTEL_* environment is this process's: the router pod's on Kubernetes)
        tracing = build_tracing(spec.config.otlp_traces_endpoint, os.environ, metrics)
        self.router = Router(model, self.directory, tokenize, spec.config, metrics,
                             prefix_cache_salt=spec.prefix_cache_salt, constraints=constraints,
                             tracing=tracing)
        await self.router.start()
        served = ServedAdapters()
        await self._start_adapters(model, served, health)
        if spec.pools is not None:
            self.pools = PoolManager(store, registry, spec.pools, cluster_namespace(spec.cluster),
                                     lambda role: metrics.worker_restarts.labels(role).inc(),
                                     lambda m: metrics.set_pools(m.targets, m.counts()),
                                     health=health)
            await self.pools.start()
            if spec.autoscale is not None and spec.autoscale.enabled:
                self.autoscaler = AutoscaleRunner(spec.autoscale, self.pools, metrics)
                await self.autoscaler.start()
            self.admin = ClusterAdmin(self.pools, traces=lambda: self.router.traces,
                                      router_config=spec.config, adapters=self.adapters)
        else:  # Admin answers here too, from the router that runs the pools
            namespace = cluster_namespace(spec.cluster)
            self.admin = ForwardingAdmin(lambda: ray.get_actor(ROUTER_NAME, namespace=namespace),
                                         traces=lambda: self.router.traces, served=served)
        port, metrics_port = await self._serve(store, metrics, served)
        self.directory.keep(functools.partial(store.ensure_router, port, metrics_port, spec.name))
        logger.info("router serving %s on %s:%d", model.model_name, spec.host, port)
        return {"port": port, "metrics_port": metrics_port, "pid": os.getpid(),
                "http_port": None if self.http is None else self.http.port}

    async def _start_adapters(self, model: ModelSpec, served: ServedAdapters,
                              health: ControlPlaneHealth) -> None:
        """The LoRA registry (the router that runs the pools) or its mirror (the others)."""
        spec = self.spec
        store = AdapterStore(spec.redis_url, spec.cluster, RecordAuth(spec.record_key), health)
        if spec.pools is None:
            self.adapters = AdapterMirror(store, served, health)
            await self.adapters.start()
            return
        config = None
        if spec.enable_lora:
            config = (await asyncio.to_thread(open_checkpoint, spec.model)).model_config
        settings = LoraSettings(spec.enable_lora, spec.max_lora_rank, config,
                                (model.model_name, spec.model))
        self.adapters = AdapterRegistry(store, settings, served, health)
        await self.adapters.start(spec.lora_modules)

    async def _serve(self, store: PoolStore, metrics: RouterMetrics,
                     served: ServedAdapters) -> tuple[int, int | None]:
        """Bind gRPC and metrics (the ports a previous incarnation saved, when asked for any)."""
        spec = self.spec
        saved_port, saved_metrics = await asyncio.to_thread(store.router_ports, spec.name)
        port = spec.port or saved_port or 0
        metrics_port = spec.metrics_port
        if metrics_port == 0 and saved_metrics is not None:
            metrics_port = saved_metrics
        attempts = spec.bind_attempts if self._reconstructed else 1
        for attempt in range(1, attempts + 1):
            try:
                self.server = GenerationServer(
                    self.router, admin=self.admin, metrics=metrics,
                    health_poll_interval_s=spec.health_poll_s, api_key=spec.api_key,
                    tls=spec.tls, reflection=spec.reflection,
                    max_concurrent_rpcs=spec.max_concurrent_rpcs,
                    admin_api_key=spec.admin_api_key, priority_api_keys=spec.priority_api_keys,
                    adapters=served)
                port = await self.server.start(spec.host, port)
                if spec.http_port is not None:
                    self.http = HttpServer(self.router, model_root=spec.model,
                                           tools=self._tools,
                                           accepting=self.server.check_accepting,
                                           api_key=spec.api_key, tls=spec.tls,
                                           max_concurrency=spec.max_concurrent_rpcs,
                                           priority_api_keys=spec.priority_api_keys,
                                           adapters=served, admin=self.admin,
                                           admin_api_key=spec.admin_api_key)
                    await self.http.start(spec.host, spec.http_port)
                if metrics_port is not None:
                    self._metrics_server, _thread = metrics.start_http(
                        metrics_port, spec.host, spec.admin_api_key)
                    metrics_port = self._metrics_server.server_port
                break
            except (RuntimeError, OSError) as exc:
                if attempt == attempts:
                    raise
                logger.warning("binding %s:%s failed (%s); retrying", spec.host, port, exc)
                if self.server is not None:
                    await self.server.stop(0)
                if self.http is not None:
                    await self.http.stop(0)
                    self.http = None
                await asyncio.sleep(0.5)
        await asyncio.to_thread(store.save_router, port, metrics_port, spec.name)
        return port, metrics_port

    async def info(self) -> dict:
        """Where this incarnation runs: {"pid", "redis_url", "serving"}."""
        return {"pid": os.getpid(), "redis_url": self.spec.redis_url,
                "serving": await self.is_serving()}

    async def is_serving(self) -> bool:
        return self.server is not None and self.server.is_serving

    async def set_serving(self, serving: bool) -> None:
        if self.server is not None:
            self.server.set_serving(serving)

    async def admin_call(self, method: str, *args):
        """An Admin call forwarded by another router (``cluster.admin.FORWARDED``); only the
        router that runs the pools answers."""
        if method not in FORWARDED:
            raise ValueError(f"{method!r} is not an Admin call routers forward")
        if not isinstance(self.admin, ClusterAdmin):
            raise AdminUnavailableError(f"router {self.spec.name!r} does not run the pools")
        return await getattr(self.admin, method)(*args)

    async def set_pool_targets(self, targets: dict[str, int]) -> None:
        for role, size in targets.items():
            await self.admin.set_pool_target(role, size)

    async def pools_info(self) -> list[PoolInfo]:
        return await self.admin.get_pools() if self.admin is not None else []

    async def list_workers(self) -> list[WorkerInfo]:
        return await self.admin.list_workers() if self.admin is not None else []

    async def traces(self) -> list[RequestTrace]:
        """Finished requests' time split, oldest first."""
        return list(self.router.traces) if self.router is not None else []

    async def worker_stats(self) -> list:
        """Fresh WorkerStats of every live worker, asked directly (not from the registry)."""
        if self.directory is None:
            return []
        handles = self.directory.handles()
        results = await asyncio.gather(*(h.stats() for h in handles), return_exceptions=True)
        return [s for s in results if not isinstance(s, BaseException)]

    async def stop(self) -> None:
        if self.adapters is not None:
            await self.adapters.stop()
            self.adapters = None
        if self.autoscaler is not None:
            await self.autoscaler.stop()
            self.autoscaler = None
        if self.pools is not None:
            await self.pools.stop()
            self.pools = None
        if self.http is not None:
            await self.http.stop(1.0)
            self.http = None
        if self.server is not None:
            await self.server.stop(1.0)
            self.server = None
        if self.router is not None:
            await self.router.stop()
            self.router = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None


def start_router_actor(spec: RouterSpec, detached: bool = False):
    """Create the router actor (asynchronously); call ``start.remote()`` to serve. Ray
    restarts it whenever its process dies; ``detached``: it outlives this process."""
    return ray.remote(RouterActor).options(
        name=spec.name, namespace=cluster_namespace(spec.cluster), num_cpus=0,
        resources=spec.resources, max_restarts=-1, max_concurrency=1000,
        lifetime="detached" if detached else None).remote(spec)


def router_name(index: int) -> str:
    """The actor name of router ``index`` of ``--routers N``: "router", "router-1", ..."""
    return ROUTER_NAME if index == 0 else f"{ROUTER_NAME}-{index}"


def is_router_name(name: str) -> bool:
    return name == ROUTER_NAME or (name.startswith(ROUTER_NAME + "-")
                                   and name[len(ROUTER_NAME) + 1:].isdigit())
