"""The LoRA adapters one engine serves: a fixed pool of ``max_loras`` slots in the model's
projections (``models.lora``) and the last ``max_cpu_loras`` adapters read, kept in host
memory so that putting one back in a slot reads no file.

A sequence holds its adapter's slot (pinned) from the moment it joins the running batch, or
a decode worker reserves blocks for it, until it leaves them; a slot no sequence pins is
reused least recently used first, so the KV pool never moves for adapters. When every slot
is pinned by another adapter, a waiting sequence for a new adapter waits (the scheduler asks
:meth:`AdapterSlots.can_take` first) and a decode reservation is refused for now.

An adapter is read (and checked against the base model) when a request for it arrives
(:meth:`AdapterSlots.read`), so a bad adapter fails that request alone, before it queues.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig
from pdserve.models import ModelConfig
from pdserve.models.lora import LoraAdapter, init_lora_slots, read_adapter, write_lora_slot
from pdserve.models.tensor_parallel import TensorShard
from pdserve.worker_api.adapters import AdapterRef

logger = logging.getLogger(__name__)


@dataclass
class AdapterCounters:
    """What an engine's adapters did since it started."""

    disk_reads: int = 0  # adapters read from their files
    slot_loads: int = 0  # adapters put into a slot (from host memory)
    evictions: int = 0  # adapters taken out of a slot for another
    disk_read_s: float = 0.0  # time spent reading and checking files
    slot_load_s: float = 0.0  # time spent copying into slots


class AdapterSlots:
    """See the module docstring."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int, shard: TensorShard | None = None):
        self.model, self.model_config, self.shard = model, model_config, shard
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.slot_bytes = init_lora_slots(model, max_loras, max_lora_rank)
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # digest -> adapter, LRU
        self._slot_of: dict[str, int] = {}  # digest -> its slot
        self._slots: list[AdapterRef | None] = [None] * max_loras
        self._pins = [0] * max_loras
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._lock = threading.Lock()  # read() runs off the engine loop (a request's arrival)
        self.counters = AdapterCounters()
        self.requests = Counter[str]()  # sequences admitted, by adapter name
        # tensor parallelism: rank 0's slots have the followers fill theirs alike
        self.on_load: Callable[[int, AdapterRef], None] | None = None

    @classmethod
    def for_config(cls, config: EngineConfig, model: torch.nn.Module,
                   model_config: ModelConfig, shard: TensorShard | None) -> AdapterSlots | None:
        """The model's LoRA slots when ``config`` serves adapters (None otherwise)."""
        if not config.enable_lora:
            return None
        slots = cls(model, model_config, config.max_loras, config.max_lora_rank,
                    config.max_cpu_loras or config.max_loras, shard)
        logger.info("LoRA: %d slots of rank <= %d (%.1f MiB)", config.max_loras,
                    config.max_lora_rank, slots.slot_bytes / (1 << 20))
        return slots

    # -- host memory ------------------------------------------------------------------------

    def read(self, ref: AdapterRef) -> LoraAdapter:
        """``ref``'s adapter, from host memory or its files (then kept, LRU). ValueError naming
        it when its files are missing, changed since registration, or do not fit the model."""
        with self._lock:
            adapter = self._host.get(ref.digest)
            if adapter is not None:
                self._host.move_to_end(ref.digest)
                return adapter
        start = time.perf_counter()
        adapter = read_adapter(ref.name, ref.path, self.model_config, self.max_lora_rank,
                               digest=ref.digest)
        with self._lock:
            self.counters.disk_reads += 1
            self.counters.disk_read_s += time.perf_counter() - start
            self._host[ref.digest] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        logger.info("read LoRA adapter %s (rank %d, %s) from %s", ref.name, adapter.rank,
                    ", ".join(adapter.target_modules), ref.path)
        return adapter

    def holds(self, ref: AdapterRef) -> bool:
        """Whether ``ref``'s adapter is read in host memory (:meth:`read` reads no file)."""
        with self._lock:
            return ref.digest in self._host

    # -- slots ------------------------------------------------------------------------------

    def can_take(self, ref: AdapterRef) -> bool:
        """Whether :meth:`acquire` of ``ref`` succeeds now."""
        return ref.digest in self._slot_of or bool(self._idle)

    def acquire(self, ref: AdapterRef) -> int:
        """Pin ``ref``'s slot, loading it into the least recently used idle slot when it holds
        none; RuntimeError when every slot is pinned by other adapters."""
        slot = self._slot_of.get(ref.digest)
        if slot is None:
            if not self._idle:
                raise RuntimeError(f"all {self.max_loras} LoRA slots are in use by other "
                                   f"adapters (max_loras)")
            slot, _ = self._idle.popitem(last=False)
            self.load_slot(slot, ref)
        else:
            self._idle.pop(slot, None)
        self._pins[slot] += 1
        self.requests[ref.name] += 1
        return slot

    def release(self, slot: int) -> None:
        """Unpin ``slot`` once (its adapter stays there until the slot is needed)."""
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._idle[slot] = None

    def load_slot(self, slot: int, ref: AdapterRef) -> None:
        """Put ``ref``'s adapter in ``slot`` (what :meth:`acquire` does, and a tensor
        parallel follower when rank 0 does)."""
        if self.on_load is not None:
            self.on_load(slot, ref)
        adapter = self.read(ref)
        start = time.perf_counter()
        old = self._slots[slot]
        if old is not None:
            del self._slot_of[old.digest]
            self.counters.evictions += 1
            logger.info("LoRA slot %d: %s evicted for %s", slot, old.name, ref.name)
        write_lora_slot(self.model, slot, adapter, self.model_config, self.shard)
        self._slots[slot], self._slot_of[ref.digest] = ref, slot
        self.counters.slot_loads += 1
        self.counters.slot_load_s += time.perf_counter() - start

    def resident_digests(self) -> tuple[str, ...]:
        """The digests of the adapters in a slot, pinned or not."""
        return tuple(ref.digest for ref in self._slots if ref is not None)

    def host_digests(self) -> tuple[str, ...]:
        """The digests of the adapters read in host memory."""
        with self._lock:
            return tuple(self._host)
