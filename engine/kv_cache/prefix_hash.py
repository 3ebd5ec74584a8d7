"""Prefix-cache block hashes: salted sha256, chained from block to block.

A block's hash is ``sha256(salt || parent || token ids as little-endian int64)``, where
``parent`` is the previous block's hash (32 zero bytes for the first block). Chaining means a
hit on block ``i`` implies the whole prefix ``[0, (i + 1) * block_size)`` matches.

Why a cryptographic hash with a salt (docs/security.md): with a predictable hash (Python's
``hash`` of a tuple) a tenant can craft a prompt whose block collides with another tenant's
cached block and read the KV computed from someone else's prompt, or probe which prompts are
cached. sha256 makes collisions infeasible; the salt, one per cluster, makes the hashes of one
cluster useless in another. The engine's block manager and the router's prefix-aware pairing
use these same two functions.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = bytes(32)  # parent hash of a sequence's first block (the base model's)
SALT_BYTES = 16  # length of a generated salt


@functools.cache
def _int64_packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def chain_hash(parent_hash: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The 32-byte hash of one full block of ``token_ids`` following ``parent_hash``."""
    words = _int64_packer(len(token_ids)).pack(*token_ids)  # struct.error outside int64
    return hashlib.sha256(salt + parent_hash + words).digest()


def adapter_root_hash(digest: str | None) -> bytes:
    """The parent hash of the first block of a sequence run under the LoRA adapter whose files
    have sha256 ``digest`` (``ROOT_HASH`` for the base model, ``digest`` None): the same
    tokens under two adapters, or under the base model, never share a block."""
    if digest is None:
        return ROOT_HASH
    return hashlib.sha256(b"pdserve-lora-adapter" + bytes.fromhex(digest)).digest()


def chained_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes,
                         root: bytes = ROOT_HASH) -> list[bytes]:
    """Hash of every full block of ``token_ids``, each chained to its predecessor, the first
    to ``root`` (:func:`adapter_root_hash`)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes
