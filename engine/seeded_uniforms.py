"""The uniforms behind every seeded draw, keyed by (seed, output position).

The token a seeded request draws at output position ``j`` depends only on its seed, ``j`` and
its row's logits, never on the batch it shares or the worker that samples it: the prefill
worker draws position 0, a decode worker the rest, another one after a migration. The uniform
is ``splitmix64(splitmix64(seed mod 2**64) xor (position mod 2**64))``, top 53 bits.
``draw_uniform`` computes one in Python; ``draw_uniforms`` a batch's as int64 tensor ops (add
and multiply wrap mod 2**64, right shifts masked to be logical), bit for bit the same.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that picks the token at ``position`` of the stream ``seed``.

    ``splitmix64(splitmix64(seed mod 2**64) xor (position mod 2**64))``, top 53 bits.
    """
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * 2.0**-53


def _as_int64(value: int) -> int:
    """The 64-bit pattern of ``value`` as a signed int64 (what a torch int64 tensor holds)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors read as uint64 (``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` on an int64 tensor: int64 add and multiply wrap mod 2**64."""
    x = x + _as_int64(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _as_int64(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _as_int64(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def draw_uniforms(seeds: list[int], positions: list[int], device=None) -> torch.Tensor:
    """(rows,) float64: ``draw_uniform(seeds[i], positions[i])`` for every row, bit for bit,
    computed as tensor ops (one host copy) instead of a Python hash per row."""
    keys = torch.tensor([[_as_int64(s) for s in seeds], [_as_int64(p) for p in positions]],
                        dtype=torch.int64, device=device)
    mixed = _splitmix64_tensor(_splitmix64_tensor(keys[0]) ^ keys[1])
    return _shift_right(mixed, 11).to(torch.float64) * 2.0**-53
