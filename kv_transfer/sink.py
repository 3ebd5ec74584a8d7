"""A ready-made :class:`KVReceiveSink` over one decode worker's KV pool.

The decode worker calls ``expect(key, block_ids)`` when it reserves blocks and ``forget(key)``
when the reservation ends for its own reasons (lease expiry, client cancel). Frames for any
other key are refused (drained and dropped by the receive loop). Exactly one of
``on_complete(key, first_token_id)`` / ``on_failure(key, error)`` is called per expected key,
unless the worker forgets it first; after either, the key is forgotten, so later frames for it
never touch the blocks (they may already belong to the running request or to someone else).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer.base import TransferError, TransferKey
from pdserve.kv_transfer.framing import layers_nbytes, unpack_layers

logger = logging.getLogger(__name__)


@dataclass
class _Expected:
    """One reservation waiting for its KV."""

    block_ids: torch.Tensor  # int64 ids of the reserved blocks, on the pool's device
    layers: set[int] = field(default_factory=set)  # layers written so far
    bytes_received: int = 0  # payload bytes written so far


class ReservedBlocksSink:
    """Scatters received layers into reserved blocks of ``caches``; thread-safe."""

    def __init__(self, caches: list[KVCacheLayer],
                 on_complete: Callable[[TransferKey, int], None] | None = None,
                 on_failure: Callable[[TransferKey, TransferError], None] | None = None,
                 on_peer_lost: Callable[[str, TransferError], None] | None = None,
                 backend: str = "auto") -> None:
        if not caches:
            raise ValueError("caches must hold at least one layer")
        self.caches = caches
        self.num_layers = len(caches)
        self.device = caches[0].kv.device
        self._on_complete = on_complete
        self._on_failure = on_failure
        self._on_peer_lost = on_peer_lost
        self._backend = backend
        self._lock = threading.Lock()
        self._expected: dict[TransferKey, _Expected] = {}
        self._local = threading.local()  # per receive-loop thread staging buffer

    # -- decode worker side ---------------------------------------------------------------
    def expect(self, key: TransferKey, block_ids: torch.Tensor | list[int]) -> None:
        """Accept frames for ``key`` into ``block_ids`` (the reservation's blocks)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"block_ids must be a non-empty 1-D list, got {tuple(ids.shape)}")
        num_blocks = self.caches[0].num_blocks
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise ValueError(f"block_ids must be in [0, {num_blocks})")
        with self._lock:
            if key in self._expected:
                raise ValueError(f"key {key} is already expected")
            self._expected[key] = _Expected(ids)

    def forget(self, key: TransferKey) -> bool:
        """Stop accepting frames for ``key``; True if it was expected. Idempotent."""
        with self._lock:
            return self._expected.pop(key, None) is not None

    @property
    def num_expected(self) -> int:
        with self._lock:
            return len(self._expected)

    # -- KVReceiveSink ----------------------------------------------------------------------
    def payload_buffer(self, key: TransferKey, layer_start: int, layer_end: int,
                       nbytes: int) -> torch.Tensor | None:
        with self._lock:
            entry = self._expected.get(key)
        if entry is None:
            return None
        if not 0 <= layer_start < layer_end <= self.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) outside the pool's "
                             f"{self.num_layers} layers")
        expected = layers_nbytes(self.caches, entry.block_ids.numel(), layer_start, layer_end)
        if nbytes != expected:
            raise ValueError(f"payload of {nbytes} bytes, expected {expected} for "
                             f"{entry.block_ids.numel()} blocks x {layer_end - layer_start} "
                             "layers")
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._local.buf = buf
        return buf[:nbytes]

    def on_layers(self, key: TransferKey, layer_start: int, layer_end: int,
                  buffer: torch.Tensor) -> None:
        with self._lock:
            entry = self._expected.get(key)
        if entry is None:  # forgotten between payload_buffer and now: drop
            return
        unpack_layers(buffer, self.caches, entry.block_ids, layer_start, layer_end,
                      backend=self._backend)
        with self._lock:
            entry.layers.update(range(layer_start, layer_end))
            entry.bytes_received += buffer.numel()

    def on_commit(self, key: TransferKey, first_token_id: int) -> None:
        with self._lock:
            entry = self._expected.pop(key, None)
        if entry is None:
            return
        if len(entry.layers) != self.num_layers:
            missing = sorted(set(range(self.num_layers)) - entry.layers)
            self._fail(key, TransferError(f"{key} committed with layers {missing} missing"))
            return
        if self._on_complete is not None:
            self._on_complete(key, first_token_id)

    def on_abort(self, key: TransferKey) -> None:
        if self.forget(key):
            self._fail(key, TransferError(f"{key} aborted by the prefill worker"))

    def on_failed(self, key: TransferKey, error: TransferError) -> None:
        if self.forget(key):
            self._fail(key, error)

    def on_peer_lost(self, peer_id: str, error: TransferError) -> None:
        logger.warning("lost prefill peer %s: %s", peer_id, error)
        if self._on_peer_lost is not None:
            self._on_peer_lost(peer_id, error)

    def _fail(self, key: TransferKey, error: TransferError) -> None:
        if self._on_failure is not None:
            self._on_failure(key, error)
