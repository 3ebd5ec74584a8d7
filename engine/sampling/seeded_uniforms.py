"""The uniforms behind every seeded draw, keyed by (seed, output position).

The token a seeded request draws at output position ``j`` depends only on its seed, ``j`` and
its row's logits, never on the batch it shares or the worker that samples it: the prefill
worker draws position 0, a decode worker the rest, another one after a migration. The uniform
is ``splitmix64(splitmix64(seed mod 2**64) xor (position mod 2**64))``, top 53 bits.
``draw_uniform`` computes one in Python; ``draw_uniforms`` a batch's as numpy uint64 array ops
(add and multiply wrap mod 2**64, right shifts are logical), bit for bit the same, and
``keyed_uniforms`` the same from the seeds' first round (``seed_key``) kept across steps.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GAMMA, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that picks the token at ``position`` of the stream ``seed``.

    ``splitmix64(splitmix64(seed mod 2**64) xor (position mod 2**64))``, top 53 bits.
    """
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * 2.0**-53


_U64 = np.uint64
_GAMMA64, _MUL1_64, _MUL2_64 = _U64(_GAMMA), _U64(_MUL1), _U64(_MUL2)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` on a uint64 array (its add and multiply wrap mod 2**64)."""
    x = x + _GAMMA64
    x = (x ^ (x >> _U64(30))) * _MUL1_64
    x = (x ^ (x >> _U64(27))) * _MUL2_64
    return x ^ (x >> _U64(31))


def seed_key(seed: int) -> int:
    """``splitmix64(seed mod 2**64)``: the first round of the hash, the same at every position
    of the stream (the persistent decode rows keep it)."""
    return _splitmix64(seed & _MASK64)


def keyed_uniforms(keys: np.ndarray, positions: np.ndarray, device=None) -> torch.Tensor:
    """(rows,) float64: the uniforms of uint64 seed ``keys`` (:func:`seed_key`) at nonnegative
    int64 ``positions``, as uint64 array ops (a quarter of what int64 tensor ops cost at batch
    64)."""
    mixed = _splitmix64_array(keys ^ positions.astype(_U64))
    uniforms = torch.from_numpy((mixed >> _U64(11)).astype(np.float64) * 2.0**-53)
    return uniforms if device is None else uniforms.to(device)


def draw_uniforms(seeds: list[int], positions: list[int], device=None) -> torch.Tensor:
    """(rows,) float64: ``draw_uniform(seeds[i], positions[i])`` for every row, bit for bit."""
    keys = _splitmix64_array(np.array([s & _MASK64 for s in seeds], _U64))
    return keyed_uniforms(keys, np.array([p & _MASK64 for p in positions], _U64), device)
