"""The router as a Ray actor: ``Router`` + the gRPC front door + Prometheus, on one event loop.

Lifecycle:

1. Created by name ("router") in the cluster's Ray namespace with ``num_cpus=0``.
2. ``start()`` reads the model's limits and tokenizer from the checkpoint folder, builds the
   ``Router`` over a :class:`RedisDirectory`, starts the gRPC server (``grpc.aio`` on the
   actor's event loop; health NOT_SERVING until a prefill and a decode worker, or a colocated
   one, are registered) and the metrics HTTP server; returns the bound ports.
3. Requests flow; ``traces()`` and ``worker_stats()`` report what happened (the demo).
4. ``stop()`` reports NOT_SERVING, stops the gRPC server (in-flight calls are cancelled, which
   aborts their KV on the workers) and the router; the launcher then kills the actor.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import ray

from pdserve.cluster.actors import RedisDirectory, cluster_namespace, limit_process_threads
from pdserve.cluster.registry import Registry
from pdserve.router.backend import ModelSpec
from pdserve.router.core import RequestTrace, Router, RouterConfig
from pdserve.router.errors import RequestValidationError
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

ROUTER_NAME = "router"


@dataclass(frozen=True)
class RouterSpec:
    """Everything the router actor is built from."""

    model: str  # checkpoint folder: tokenizer and limits
    redis_url: str  # the registry the workers heartbeat into
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


def model_spec_for(model_dir: str, max_model_len: int | None = None,
                   model_name: str | None = None):
    """(ModelSpec, tokenizer or None) of a checkpoint folder, as the workers will serve it."""
    from pdserve.models.config import ModelConfig
    from pdserve.models.tokenizer import Tokenizer

    mc = ModelConfig.from_dir(model_dir)
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
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
        self.directory: RedisDirectory | None = None
        self._metrics_server = None

    async def start(self) -> dict:
        """Serve; returns {"port", "metrics_port", "pid"}."""
        spec = self.spec
        model, tokenizer = await asyncio.to_thread(model_spec_for, spec.model, spec.max_model_len,
                                                   spec.model_name)

        def tokenize(text: str) -> list[int]:
            if tokenizer is None:
                raise RequestValidationError("text", "the model has no tokenizer; send token_ids")
            return tokenizer.encode(text)

        registry = Registry(spec.redis_url, spec.cluster, spec.ttl_s)
        self.directory = RedisDirectory(registry, cluster_namespace(spec.cluster))
        metrics = RouterMetrics()
        self.router = Router(model, self.directory, tokenize, spec.config, metrics)
        await self.router.start()
        self.server = GenerationServer(self.router, health_poll_interval_s=spec.health_poll_s)
        port = await self.server.start(spec.host, spec.port)
        metrics_port = None
        if spec.metrics_port is not None:
            self._metrics_server, _thread = metrics.start_http(spec.metrics_port, spec.host)
            metrics_port = self._metrics_server.server_port
        logger.info("router serving %s on %s:%d", model.model_name, spec.host, port)
        return {"port": port, "metrics_port": metrics_port, "pid": os.getpid()}

    async def is_serving(self) -> bool:
        return self.server is not None and self.server.is_serving

    async def set_serving(self, serving: bool) -> None:
        if self.server is not None:
            self.server.set_serving(serving)

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
        if self.server is not None:
            await self.server.stop(1.0)
            self.server = None
        if self.router is not None:
            await self.router.stop()
            self.router = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None


def start_router_actor(spec: RouterSpec):
    """Create the router actor (asynchronously); call ``start.remote()`` to serve."""
    return ray.remote(RouterActor).options(
        name=ROUTER_NAME, namespace=cluster_namespace(spec.cluster), num_cpus=0, max_restarts=0,
        max_concurrency=1000).remote(spec)
