"""Blocks between one engine's KV pool and the tiers below it (``engine.kv_cache.tiers``).

:class:`PoolTiers` is what the block manager's ``offload`` is: it copies evicted blocks out of
the pool into the tiers (``save``), reads blocks back into pool blocks (``load``), says which
tier holds a hash and whether loading beats computing (``worth_loading``). Each rank keeps its
own tiers, holding its K/V heads; rank 0's ``PoolTiers`` has every follower do the same save or
load (``TensorParallelRunner.call_ranks``), and a load that fails on any rank is a miss on all.

A block's payload is its K and V of every layer (in the pool's dtype), then, for an int8 pool
with dynamic scales, its token scales: flat bytes, what the tiers store and check. With
``kv_offload_int8`` a float pool's blocks are stored as an int8 pool's would be
(``engine.kv_cache.tier_int8``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from pdserve.engine.kv_cache.tier_int8 import Int8TierStorage
from pdserve.engine.kv_cache.tiers import KVTiers
from pdserve.kernels import KVCacheLayer
from pdserve.worker_api import KV_TIER_ASSUMED_READ_BYTES_PER_S, KV_TIER_HOST

logger = logging.getLogger(__name__)

GIB = 1 << 30
COMPUTE_EMA = 0.2  # weight of the latest step in the running mean of compute time per token
TIER_CALLS = frozenset({"save_tier_blocks", "load_tier_blocks"})  # what rank 0 has followers run


class PoolTiers:
    """One rank's pool and its KV tiers (and, on rank 0 of a tensor parallel group, the
    followers' through ``ranks``)."""

    def __init__(self, caches: list[KVCacheLayer], tiers: KVTiers, block_size: int,
                 ranks=None, int8: Int8TierStorage | None = None):
        self.caches = caches
        self.tiers = tiers
        self.block_size = block_size
        self.ranks = ranks  # TensorParallelRunner (rank 0 of a group) or None
        self.int8 = int8  # stores a float pool's blocks as int8, or None: as they are
        self.compute_s_per_token: float | None = None  # measured prefill time per token

    @classmethod
    def for_config(cls, config, caches: list[KVCacheLayer], rank: int = 0, size: int = 1,
                   events=None, int8: Int8TierStorage | None = None) -> PoolTiers | None:
        """The tiers ``config`` asks for (``kv_offload_*``), or None without them; ``int8``:
        how blocks are stored as int8 (``kv_offload_int8``, checked at start-up)."""
        if not (config.kv_offload_cpu_gib or config.kv_offload_disk_gib):
            return None
        stored = caches if int8 is None else int8.staging(1)  # the layout the payloads have
        tiers = KVTiers(layout_fingerprint(config.model, stored, rank, size),
                        block_nbytes(stored), int(config.kv_offload_cpu_gib * GIB),
                        int(config.kv_offload_disk_gib * GIB), config.kv_offload_dir, events)
        return cls(caches, tiers, config.block_size, int8=int8)

    # ---- what the block manager asks --------------------------------------------------

    def tier_of(self, block_hash: bytes) -> int | None:
        return self.tiers.tier_of(block_hash)

    @property
    def prefetches(self) -> bool:
        """Whether these tiers bring blocks up from disk ahead of admission."""
        return self.tiers.prefetches

    def prefetch(self, hashes: list[bytes]) -> None:
        """Bring these blocks from disk to host memory in the background (rank 0's tiers;
        the followers read theirs when the blocks load)."""
        self.tiers.prefetch(hashes)

    def coming_up(self, hashes: list[bytes]) -> bool:
        """Whether any of ``hashes`` is still being brought up from disk."""
        return bool(hashes) and self.tiers.coming_up(hashes)

    def worth_loading(self, tiers: list[int]) -> int:
        """How many of the leading blocks below the pool, of ``tiers``, are cheaper to load
        than to compute (measured read rates against the measured compute time per token)."""
        per_token = self.compute_s_per_token
        if per_token is None:
            return len(tiers)
        compute_s = per_token * self.block_size
        for i, tier in enumerate(tiers):
            if self.tiers.block_nbytes / self.read_bytes_per_s(tier) >= compute_s:
                return i
        return len(tiers)

    def read_bytes_per_s(self, tier: int) -> float:
        c = self.tiers.counters
        read_bytes, read_s = ((c.host_read_bytes, c.host_read_s) if tier == KV_TIER_HOST
                              else (c.disk_read_bytes, c.disk_read_s))
        if read_s <= 0:
            return KV_TIER_ASSUMED_READ_BYTES_PER_S[tier]
        return read_bytes / read_s

    def note_compute(self, num_tokens: int, seconds: float) -> None:
        """A forward computed ``num_tokens`` tokens in ``seconds`` (a step with prompt
        chunks): the running mean the load rule compares against."""
        if num_tokens <= 0 or seconds <= 0:
            return
        latest = seconds / num_tokens
        mean = self.compute_s_per_token
        self.compute_s_per_token = latest if mean is None else (
            mean + COMPUTE_EMA * (latest - mean))

    # ---- moving blocks ------------------------------------------------------------------

    def save(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Copy the pool's ``block_ids`` (each holding the block of its hash) into the tiers,
        on every rank."""
        self.save_tier_blocks(block_ids, hashes)
        if self.ranks is not None:
            self.ranks.call_ranks(PoolTiers.save_tier_blocks.__name__, block_ids, hashes)

    def load(self, block_ids: list[int], hashes: list[bytes],
             before_write: Callable[[], None]) -> tuple[int, list[int]]:
        """Read the blocks of ``hashes`` from the tiers into the pool's ``block_ids``, in order,
        up to the first one that fails its check or read (on any rank: then none counts).
        ``before_write`` runs between reading and writing into the pool (the saves of what
        those blocks held: they would push the blocks being read down a tier). Returns how
        many loaded and the tier each came from."""
        payloads, tiers = self._read(hashes)
        before_write()
        num_loaded = len(payloads)
        if num_loaded:
            self._unpack(block_ids[:num_loaded], payloads)
        if self.ranks is not None and num_loaded:
            failed = self.ranks.call_ranks_counting(PoolTiers.load_tier_blocks.__name__,
                                                    block_ids[:num_loaded],
                                                    hashes[:num_loaded])
            if failed:
                logger.warning("%d tensor parallel rank(s) could not load %d KV blocks from "
                               "their tiers; the blocks are recomputed", failed, num_loaded)
                for block_hash in hashes[:num_loaded]:
                    self.tiers.forget(block_hash)
                return 0, []
        return num_loaded, tiers

    def save_tier_blocks(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """This rank's part of :meth:`save` (what rank 0 has each follower run)."""
        for block_hash, payload in zip(hashes, self._pack(block_ids), strict=True):
            self.tiers.save(block_hash, payload)

    def load_tier_blocks(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """A follower's part of :meth:`load`: all of them, or RuntimeError (counted by rank
        0 as this rank's failure)."""
        payloads, _ = self._read(hashes)
        if len(payloads) < len(block_ids):
            raise RuntimeError(f"read {len(payloads)} of {len(block_ids)} KV blocks from this "
                               f"rank's tiers")
        self._unpack(block_ids, payloads)

    def _read(self, hashes: list[bytes]) -> tuple[list[np.ndarray], list[int]]:
        """The checked payloads of the leading ``hashes`` the tiers give, and their tiers."""
        payloads: list[np.ndarray] = []
        tiers: list[int] = []
        for block_hash in hashes:
            tier = self.tiers.tier_of(block_hash)
            payload = None if tier is None else self.tiers.read(block_hash)
            if payload is None:
                break
            payloads.append(payload)
            tiers.append(tier)
        return payloads, tiers

    def _pack(self, block_ids: list[int]) -> list[np.ndarray]:
        """The payloads of ``block_ids``, each its own host array: one gather per pool tensor
        for all the blocks, then one copy per block."""
        caches = self.caches
        if self.int8 is not None:  # (block i of the int8 layout holds block_ids[i])
            caches, block_ids = self.int8.quantize(caches, block_ids), range(len(block_ids))
        index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].kv.device)
        packed = torch.cat([rows.index_select(0, index).view(torch.uint8)
                            for rows in _pool_rows(caches)],
                           dim=1).cpu().numpy()  # (blocks, payload bytes)
        return [row.copy() for row in packed]

    def _unpack(self, block_ids: list[int], payloads: list[np.ndarray]) -> None:
        """Write ``payloads`` into the pool's ``block_ids``: one scatter per pool tensor."""
        if self.int8 is None:
            _write_payloads(self.caches, block_ids, payloads)
            return
        staged = self.int8.staging(len(block_ids))
        _write_payloads(staged, list(range(len(block_ids))), payloads)
        self.int8.dequantize_into(staged, self.caches, block_ids)

    def close(self) -> None:
        self.tiers.close()


def _write_payloads(caches: list[KVCacheLayer], block_ids: list[int],
                    payloads: list[np.ndarray]) -> None:
    """Write ``payloads`` into ``caches``' ``block_ids``: one scatter per pool tensor."""
    device = caches[0].kv.device
    index = torch.tensor(block_ids, dtype=torch.int64, device=device)
    data = torch.from_numpy(np.stack(payloads)).to(device)  # (blocks, payload bytes)
    offset = 0
    for rows in _pool_rows(caches):  # (in the pool's dtypes: a byte-wise copy is slow)
        width = rows.shape[1] * rows.element_size()
        rows.index_copy_(0, index, data[:, offset:offset + width].view(rows.dtype))
        offset += width


def _pool_rows(caches: list[KVCacheLayer]) -> list[torch.Tensor]:
    """The pool's tensors in payload order, each viewed as (blocks, its elements per block):
    K and V of every layer, then the token scales of every layer that has them."""
    tensors = [half for c in caches for half in (c.kv[0], c.kv[1])]
    tensors += [t for c in caches for t in c.token_scales]
    return [t.view(t.shape[0], -1) for t in tensors]


def block_nbytes(caches: list[KVCacheLayer]) -> int:
    """One block's payload bytes."""
    return sum(rows.shape[1] * rows.element_size() for rows in _pool_rows(caches))


def layout_fingerprint(model: str, caches: list[KVCacheLayer], rank: int, size: int) -> bytes:
    """What a stored block must have been made by to be loaded here: the model, this rank of
    the group, every layer's block shape and dtype, and an int8 pool's calibrated scales."""
    h = hashlib.sha256(f"pdserve-kv-tier|{model}|{rank}/{size}".encode())
    for c in caches:
        h.update(f"|{tuple(c.kv.shape[2:])}|{c.kv.dtype}|{len(c.token_scales)}".encode())
        for scale in (c.k_scale, c.v_scale):
            if scale is not None:
                h.update(scale.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()
