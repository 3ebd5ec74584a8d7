"""The cluster's registry of LoRA adapters: name -> ``AdapterRef``, shared by its routers.

Who holds what (as for the pools: Redis is a cache of the truth, not the truth,
docs/failure-handling.md):

* The truth is the memory of the router that runs the pools (``router``):
  :class:`AdapterRegistry`. Every load and unload, whichever door or router it came through,
  ends there (other routers forward Admin calls to it: ``cluster.admin.ForwardingAdmin``).
* The copy is one signed value in Redis, ``pdserve:<cluster>:lora_adapters`` (the JSON list of
  every adapter, tagged under the cluster's key: ``cluster.record_auth``), which the registry
  writes after each change and writes back at every :meth:`AdapterRegistry.sync` (each
  ``SYNC_S``) when Redis lost it or holds something else (FLUSHALL, a Redis restarted empty,
  garbage). A router restarted by Ray adopts the copy; a copy nobody wrote yet (a new cluster)
  is seeded from ``--lora-modules``.
* Every other router reads the copy at each sync into its own ``ServedAdapters``
  (:class:`AdapterMirror`). A missing, malformed or untrusted copy is "unknown", never "no
  adapters": the mirror keeps what it had until the registry writes the copy back.

Registering checks the adapter before anything changes (:func:`check_adapter`): the name
(not in use, not the base model's), then the files checked against the base model and
``max_lora_rank`` by ``models.lora_files.inspect_adapter`` (missing files, ranks, target
modules, shapes, from the files' headers: the router never reads the weights), each refusal a
ValueError naming the adapter. Without ``--enable-lora`` every load is refused
(``LoraDisabledError``). Workers need nothing pushed: each request carries its ``AdapterRef``
and a worker reads the files on first use, checking the digest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import redis

from pdserve.cluster.control_plane import REDIS_DOWN, ControlPlaneHealth
from pdserve.cluster.options import ClusterOptions, parse_lora_modules
from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.registry import redis_client
from pdserve.engine.config import EngineConfig
from pdserve.models.checkpoint import open_checkpoint
from pdserve.models.config import ModelConfig
from pdserve.models.lora_files import inspect_adapter
from pdserve.router.adapters import ServedAdapters
from pdserve.router.admin_server import LoraDisabledError, UnknownAdapterError
from pdserve.worker_api.adapters import AdapterRef

logger = logging.getLogger(__name__)

SYNC_S = 1.0  # how often the registry repairs the copy and the mirrors read it
_PURPOSE = "lora-adapters"  # what the copy's tag covers
FAMILY = "lora_adapters"  # the copy's key family (malformed and repair counters)


@dataclass(frozen=True)
class LoraSettings:
    """What registering an adapter is checked against."""

    enabled: bool  # the workers run with enable_lora
    max_rank: int  # their max_lora_rank
    model_config: ModelConfig | None  # the base model's (None: LoRA off)
    base_names: tuple[str, ...]  # names requests give the base model: no adapter takes one


def check_adapter(name: str, path: str, settings: LoraSettings,
                  taken: Iterable[str] = ()) -> AdapterRef:
    """The adapter ``name`` at ``path`` as the cluster would register it; LoraDisabledError
    without LoRA, ValueError naming it for a name in use (``taken``) or the base model's, or
    anything ``models.lora_files.inspect_adapter`` refuses. Reads the files: call it off the
    loop."""
    if not settings.enabled or settings.model_config is None:
        raise LoraDisabledError(f"LoRA adapter {name!r}: this server runs without LoRA; start "
                                f"it with --enable-lora")
    if name in settings.base_names:
        raise ValueError(f"LoRA adapter {name!r}: the name is the base model's; choose another")
    if name in set(taken):
        raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first or choose "
                         f"another name")
    folder = os.path.abspath(path)
    files = inspect_adapter(name, folder, settings.model_config, settings.max_rank)
    return AdapterRef(name, folder, files.digest)


def check_lora_modules(options: ClusterOptions, model_dir: str) -> list[AdapterRef]:
    """The ``--lora-modules`` adapters, each checked as a load at run time is (files, ranks,
    modules, shapes, names) against the model in ``model_dir``; ValueError naming the first
    the cluster cannot serve. Reads their files."""
    modules = parse_lora_modules(options.lora_modules)
    if not modules:
        return []
    config = EngineConfig(model=model_dir, **options.engine)
    settings = LoraSettings(config.enable_lora, config.max_lora_rank,
                            open_checkpoint(model_dir).model_config,
                            (Path(model_dir).name, model_dir))
    refs: list[AdapterRef] = []
    for name, path in modules:
        refs.append(check_adapter(name, path, settings, [r.name for r in refs]))
    return refs


class AdapterStore:
    """The registry's copy in Redis: one signed JSON list (see the module docstring)."""

    def __init__(self, redis_url: str, cluster: str, auth: RecordAuth,
                 health: ControlPlaneHealth | None = None) -> None:
        self.client = redis_client(redis_url)
        self.key = f"pdserve:{cluster}:lora_adapters"
        self.auth = auth
        self.health = health

    def encode(self, adapters: Iterable[AdapterRef]) -> str:
        body = json.dumps([[a.name, a.path, a.digest] for a in adapters], separators=(",", ":"))
        return json.dumps({"adapters": body, "tag": self.auth.tag(_PURPOSE, self.key, body)})

    def read(self) -> list[AdapterRef] | None:
        """The adapters of the copy; None when there is none, or it is malformed or untrusted
        (counted): "unknown". Raises what Redis raises when it is away."""
        raw = self.client.get(self.key)
        if raw is None:
            return None
        try:
            outer = json.loads(raw)
            body, tag = outer["adapters"], outer["tag"]
            if not isinstance(body, str) or not isinstance(tag, str):
                raise TypeError("adapters and tag must be strings")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError):
            self._count("malformed")
            return None
        if not self.auth.verifies(tag, _PURPOSE, self.key, body):
            self._count("untrusted")
            return None
        try:
            return [AdapterRef(*entry) for entry in json.loads(body)]
        except (ValueError, TypeError):
            self._count("malformed")
            return None

    def write(self, adapters: Iterable[AdapterRef]) -> None:
        self.client.set(self.key, self.encode(adapters))

    def _count(self, what: str) -> None:
        if self.health is None:
            return
        if what == "untrusted":
            self.health.count_untrusted(FAMILY)
        else:
            self.health.count_malformed(FAMILY)


class _Synced:
    """What the registry and its mirrors share: ``sync()`` every ``SYNC_S`` once started."""

    _task: asyncio.Task | None = None

    async def sync(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SYNC_S)
            try:
                await self.sync()
            except redis.RedisError:
                logger.exception("syncing the LoRA adapters with Redis failed")


class AdapterRegistry(_Synced):
    """The truth (see the module docstring): the adapters of the cluster, in the memory of the
    router that runs the pools, mirrored into ``served`` (what its own doors resolve) and
    into Redis. Use it on one event loop."""

    def __init__(self, store: AdapterStore, settings: LoraSettings, served: ServedAdapters,
                 health: ControlPlaneHealth | None = None) -> None:
        self.store = store
        self.settings = settings
        self.served = served
        self.health = health
        self._adapters: dict[str, AdapterRef] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time: checks see the last one

    async def start(self, seeds: Iterable[tuple[str, str]] = ()) -> None:
        """Adopt the copy in Redis, or (none yet) register ``seeds`` (name, path), checked;
        then keep the copy repaired. A seed the cluster cannot serve raises ValueError."""
        adopted = await asyncio.to_thread(self.store.read)
        if adopted is not None:
            self._adapters = {a.name: a for a in adopted}
            logger.info("adopted %d LoRA adapter(s) from Redis", len(adopted))
        else:
            for name, path in seeds:
                ref = await asyncio.to_thread(check_adapter, name, path, self.settings,
                                              self._adapters)
                self._adapters[name] = ref
            await self._publish()
        self.served.replace(self._adapters.values())
        self._task = asyncio.create_task(self._run())

    def list(self) -> list[AdapterRef]:
        return [self._adapters[name] for name in sorted(self._adapters)]

    async def load(self, name: str, path: str) -> AdapterRef:
        """Register an adapter, checked first (nothing changes when it is refused)."""
        async with self._lock:
            ref = await asyncio.to_thread(check_adapter, name, path, self.settings,
                                          list(self._adapters))
            self._adapters[name] = ref
            self.served.put(ref)
            await self._publish()
        logger.info("LoRA adapter %r loaded from %s (sha256 %s...)", name, ref.path,
                    ref.digest[:12])
        return ref

    async def unload(self, name: str) -> AdapterRef:
        """Unregister an adapter: new requests for it are refused, those in flight finish."""
        async with self._lock:
            ref = self._adapters.pop(name, None)
            if ref is None:
                raise UnknownAdapterError(f"LoRA adapter {name[:256]!r} is not loaded")
            self.served.remove(name)
            await self._publish()
        logger.info("LoRA adapter %r unloaded", name)
        return ref

    async def sync(self) -> None:
        """Write the copy back when Redis lost it or holds another (counted as a repair)."""
        if self.health is not None and not self.health.can_try():
            return
        try:
            stored = await asyncio.to_thread(self.store.read)
            if stored != self.list():
                await asyncio.to_thread(self.store.write, self.list())
                if self.health is not None:
                    self.health.count_repairs([FAMILY])
        except REDIS_DOWN as exc:
            if self.health is not None:
                self.health.failed(exc)

    async def _publish(self) -> None:
        """Write the copy now; a Redis that is away gets it at a later sync."""
        try:
            await asyncio.to_thread(self.store.write, self.list())
        except REDIS_DOWN as exc:
            logger.warning("LoRA adapters not written to Redis (%s); a later sync will", exc)
            if self.health is not None:
                self.health.failed(exc)



class AdapterMirror(_Synced):
    """A router that does not run the pools: ``served`` follows the copy in Redis (a missing
    or bad one changes nothing). Use it on one event loop."""

    def __init__(self, store: AdapterStore, served: ServedAdapters,
                 health: ControlPlaneHealth | None = None) -> None:
        self.store = store
        self.served = served
        self.health = health

    async def start(self) -> None:
        await self.sync()
        self._task = asyncio.create_task(self._run())

    async def sync(self) -> None:
        if self.health is not None and not self.health.can_try():
            return
        try:
            adapters = await asyncio.to_thread(self.store.read)
        except REDIS_DOWN as exc:
            if self.health is not None:
                self.health.failed(exc)
            return
        if adapters is not None:
            self.served.replace(adapters)
