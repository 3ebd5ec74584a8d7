"""A ready-made :class:`KVReceiveSink` over one decode worker's KV pool.

The decode worker calls ``expect(key, block_ids)`` when it reserves blocks and ``forget(key)``
when the reservation ends for its own reasons (lease expiry, client cancel). Frames for any
other key are refused (drained and dropped by the receive loop). Exactly one of
``on_complete(key, first_token_id, num_stand_ins)`` / ``on_failure(key, error)`` is called per
expected key, unless the worker forgets it first; after either, the key is forgotten, so later
frames for it never touch the blocks (they may already belong to the running request or to
someone else). ``num_stand_ins`` is the COMMIT's: how many leading blocks of the key hold no
KV (the sender's stand-ins for blocks it freed, which the worker frees); a COMMIT naming every
block (or more) fails the key.

Scattering runs on one unpack thread, so a receive loop takes the next frame while the last one
is being written: each loop alternates between two payload buffers and waits only when the
buffer it is about to reuse is still being unpacked. Commit, abort and failure notices go
through the same thread, so they follow every scatter queued before them. Scatters happen under
a write lock that ``forget`` also takes: once ``forget`` returns, nothing writes that key's
blocks any more.

Tensor parallel pools (``first_head``: the model's K/V head the pool's first head is) take
head-sliced frames from several senders: a key completes once every head of every layer has
arrived and its COMMIT has (a sharded COMMIT may come first and waits for the rest), or, for a
rank that never sees the COMMIT (``complete_on_heads``), once every head has arrived.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer.base import TransferError, TransferKey
from pdserve.kv_transfer.framing import layers_nbytes, unpack_layers

logger = logging.getLogger(__name__)


@dataclass
class _Expected:
    """One reservation waiting for its KV."""

    block_ids: torch.Tensor  # int64 ids of the reserved blocks, on the pool's device
    covered: torch.Tensor  # (num_layers, kv_heads) bool: what has been written so far
    bytes_received: int = 0  # payload bytes written so far
    first_token_id: int | None = None  # from a sharded COMMIT that came before every head
    num_stand_ins: int = 0  # from the COMMIT: leading blocks that hold no KV


class ReservedBlocksSink:
    """Scatters received layers into reserved blocks of ``caches``; thread-safe."""

    def __init__(self, caches: list[KVCacheLayer],
                 on_complete: Callable[[TransferKey, int | None, int], None] | None = None,
                 on_failure: Callable[[TransferKey, TransferError], None] | None = None,
                 on_peer_lost: Callable[[str, TransferError], None] | None = None,
                 backend: str = "auto", first_head: int = 0,
                 complete_on_heads: bool = False) -> None:
        if not caches:
            raise ValueError("caches must hold at least one layer")
        self.caches = caches
        self.num_layers = len(caches)
        self.first_head = first_head  # the model's K/V head this pool's head 0 is
        self.num_heads = caches[0].kv.shape[3]
        self.complete_on_heads = complete_on_heads  # complete without a COMMIT (a TP rank)
        self.device = caches[0].kv.device
        self._on_complete = on_complete
        self._on_failure = on_failure
        self._on_peer_lost = on_peer_lost
        self._backend = backend
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # held while scattering; forget() waits for it
        self._expected: dict[TransferKey, _Expected] = {}
        self._local = threading.local()  # per receive loop: two staging buffers, pending scatters
        self._unpacker = ThreadPoolExecutor(1, thread_name_prefix="kv-unpack")

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
            self._expected[key] = _Expected(ids, torch.zeros(self.num_layers, self.num_heads,
                                                             dtype=torch.bool))

    def forget(self, key: TransferKey) -> bool:
        """Stop accepting frames for ``key``; True if it was expected. Idempotent. After it
        returns no scatter into the key's blocks is running or will start."""
        with self._write_lock, self._lock:
            return self._expected.pop(key, None) is not None

    def close(self) -> None:
        """Finish queued scatters and stop the unpack thread (idempotent)."""
        self._unpacker.shutdown(wait=True)

    @property
    def max_payload_bytes(self) -> int:
        """The largest frame any reservation could take: every block of every layer."""
        return layers_nbytes(self.caches, self.caches[0].num_blocks, 0, self.num_layers)

    @property
    def num_expected(self) -> int:
        with self._lock:
            return len(self._expected)

    # -- KVReceiveSink ----------------------------------------------------------------------
    def _pool_heads(self, heads: tuple[int, int] | None) -> tuple[int, int] | None:
        """A frame's heads (model numbering) as this pool's; ValueError when not all here."""
        if heads is None:
            return None
        local = (heads[0] - self.first_head, heads[1] - self.first_head)
        if not 0 <= local[0] < local[1] <= self.num_heads:
            raise ValueError(f"K/V heads {list(heads)} are not all in this pool (heads "
                             f"{self.first_head}..{self.first_head + self.num_heads - 1})")
        return local

    def payload_buffer(self, key: TransferKey, layer_start: int, layer_end: int,
                       nbytes: int, heads: tuple[int, int] | None = None
                       ) -> torch.Tensor | None:
        with self._lock:
            entry = self._expected.get(key)
        if entry is None:
            return None
        if not 0 <= layer_start < layer_end <= self.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) outside the pool's "
                             f"{self.num_layers} layers")
        expected = layers_nbytes(self.caches, entry.block_ids.numel(), layer_start, layer_end,
                                 self._pool_heads(heads))
        if nbytes != expected:
            raise ValueError(f"payload of {nbytes} bytes, expected {expected} for "
                             f"{entry.block_ids.numel()} blocks x {layer_end - layer_start} "
                             "layers")
        local = self._local
        if not hasattr(local, "bufs"):
            local.bufs, local.pending, local.slot = [None, None], [None, None], 1
        local.slot ^= 1
        pending: Future | None = local.pending[local.slot]
        if pending is not None:
            pending.result()  # this buffer's previous payload is scattered: reuse it
        buf = local.bufs[local.slot]
        if buf is None or buf.numel() < nbytes:
            buf = local.bufs[local.slot] = torch.empty(nbytes, dtype=torch.uint8,
                                                       device=self.device)
        return buf[:nbytes]

    def on_layers(self, key: TransferKey, layer_start: int, layer_end: int,
                  buffer: torch.Tensor, heads: tuple[int, int] | None = None) -> None:
        future = self._unpacker.submit(self._scatter, key, layer_start, layer_end, buffer,
                                       self._pool_heads(heads))
        if hasattr(self._local, "pending"):
            self._local.pending[self._local.slot] = future
        else:  # a buffer the sink did not lend (direct callers): wait, it may be reused
            future.result()

    def _scatter(self, key: TransferKey, layer_start: int, layer_end: int,
                 buffer: torch.Tensor, heads: tuple[int, int] | None = None) -> None:
        """On the unpack thread (``heads``: this pool's numbering)."""
        with self._write_lock:
            with self._lock:
                entry = self._expected.get(key)
            if entry is None:  # forgotten meanwhile: drop
                return
            try:
                unpack_layers(buffer, self.caches, entry.block_ids, layer_start, layer_end,
                              backend=self._backend, heads=heads)
                error = None
            except Exception as exc:  # noqa: BLE001 - fail the key, keep the thread
                logger.exception("scatter failed for %s", key)
                error = TransferError(f"scatter into blocks failed: {exc}")
            with self._lock:
                mark_covered(entry, layer_start, layer_end, heads)
                entry.bytes_received += buffer.numel()
        if error is not None:
            self._fail_now(key, error)
        else:
            self._complete_if_whole(key)

    def on_commit(self, key: TransferKey, first_token_id: int, sharded: bool = False,
                  num_stand_ins: int = 0) -> None:
        self._unpacker.submit(self._commit, key, first_token_id, sharded, num_stand_ins)

    def _commit(self, key: TransferKey, first_token_id: int, sharded: bool = False,
                num_stand_ins: int = 0) -> None:
        with self._lock:
            entry = self._expected.get(key)
            if entry is None:
                return
            entry.first_token_id, entry.num_stand_ins = first_token_id, num_stand_ins
            error = _commit_error(key, entry, sharded)
            if error is not None:
                del self._expected[key]
        if error is not None:
            self._fail(key, error)
            return
        self._complete_if_whole(key)  # (a sharded commit waits for the other shares)

    def _complete_if_whole(self, key: TransferKey) -> None:
        """Complete ``key`` once every head of every layer is in and its COMMIT came (or, with
        ``complete_on_heads``, on the heads alone)."""
        with self._lock:
            entry = self._expected.get(key)
            if entry is None or not bool(entry.covered.all()):
                return
            if entry.first_token_id is None and not self.complete_on_heads:
                return
            del self._expected[key]
        if self._on_complete is not None:
            self._on_complete(key, entry.first_token_id, entry.num_stand_ins)

    def on_abort(self, key: TransferKey) -> None:
        self.on_failed(key, TransferError(f"{key} aborted by the prefill worker"))

    def on_failed(self, key: TransferKey, error: TransferError) -> None:
        self._unpacker.submit(self._fail_now, key, error)  # after the scatters queued before it

    def _fail_now(self, key: TransferKey, error: TransferError) -> None:
        if self.forget(key):
            self._fail(key, error)

    def on_peer_lost(self, peer_id: str, error: TransferError) -> None:
        logger.warning("lost prefill peer %s: %s", peer_id, error)
        if self._on_peer_lost is not None:
            self._on_peer_lost(peer_id, error)

    def _fail(self, key: TransferKey, error: TransferError) -> None:
        if self._on_failure is not None:
            self._on_failure(key, error)


def _commit_error(key: TransferKey, entry: _Expected, sharded: bool) -> TransferError | None:
    """Why ``key``'s COMMIT cannot complete it (None: it can, now or, sharded, once every
    head is in). The last block expected always holds KV: it holds the last tokens computed."""
    num_blocks = entry.block_ids.numel()
    if not 0 <= entry.num_stand_ins < num_blocks:
        return TransferError(f"{key} committed with num_stand_ins {entry.num_stand_ins}, "
                             f"outside [0, {num_blocks}) for {num_blocks} blocks expected")
    missing = (~entry.covered.all(dim=1)).nonzero().flatten().tolist()
    if missing and not sharded:
        return TransferError(f"{key} committed with layers {missing} missing")
    return None


def mark_covered(entry: _Expected, layer_start: int, layer_end: int,
                 heads: tuple[int, int] | None) -> None:
    """Record layers ``[layer_start, layer_end)`` (``heads`` of them, None: all) as written."""
    if heads is None:
        entry.covered[layer_start:layer_end] = True
    else:
        entry.covered[layer_start:layer_end, heads[0]:heads[1]] = True
