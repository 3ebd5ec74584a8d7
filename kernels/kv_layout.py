"""The paged KV cache layout every kernel and every worker agrees on.

One tensor per layer::

    kv: (2, num_blocks, block_size, num_kv_heads, head_dim)    # [0] = keys, [1] = values

A token at position ``p`` of a sequence with block table ``bt`` lives at slot
``bt[p // block_size] * block_size + p % block_size``; ``slot_mapping`` tensors carry
those flat slot numbers. Block ``b`` of a layer is the contiguous pair ``kv[:, b]``, which is
what pack/unpack move between workers.

int8 pools: ``k_scale`` / ``v_scale`` hold one float32 scale per (kv head, channel), static
(calibrated, or ones). Optionally K and/or V also carry a dynamic scale per (token, kv head),
computed when the token is written and stored beside the blocks in ``k_token_scale`` /
``v_token_scale``: ``(num_blocks, block_size, num_kv_heads)`` float16, so slot ``s`` of head
``h`` is ``[s // block_size, s % block_size, h]`` (the same slot numbering as ``kv``)::

    real = int8 * scale[h, d] * token_scale[slot, h]      (token_scale = 1 when absent)

On write, ``y = x / scale`` per channel,
``token_scale = fp16(clamp(max_d |y| / 127, 2**-14, 65504))`` and
``int8 = round_half_even(clamp(y / token_scale, -127, 127))``, so the token's largest
channel maps to +-127 and nothing saturates; the upper clamp (float16's largest finite value)
keeps a token scale finite even for a value the channel scales could never have foreseen (it
saturates instead of becoming inf, whose product with 0 is NaN). Token scales travel with
their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_SCALE_DTYPE = torch.float16  # dynamic per-(token, head) scales as stored
MIN_TOKEN_SCALE = 2.0 ** -14  # smallest normal float16: an all-zero row gets this scale
MAX_TOKEN_SCALE = 65504.0  # largest finite float16: a token scale never overflows to inf


@dataclass
class KVCacheLayer:
    """One layer's paged KV pool (see the module docstring for the layout)."""

    kv: torch.Tensor  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    k_scale: torch.Tensor | None = None  # (num_kv_heads, head_dim) float32, iff kv is int8
    v_scale: torch.Tensor | None = None  # (num_kv_heads, head_dim) float32, iff kv is int8
    k_token_scale: torch.Tensor | None = None  # (num_blocks, block_size, kv_heads) fp16: dynamic K
    v_token_scale: torch.Tensor | None = None  # (num_blocks, block_size, kv_heads) fp16: dynamic V

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[0] != 2:
            raise ValueError("kv must be (2, blocks, block_size, kv_heads, head_dim), "
                             f"got {tuple(self.kv.shape)}")
        quantized = self.kv.dtype == torch.int8
        if quantized != (self.k_scale is not None and self.v_scale is not None):
            raise ValueError("k_scale and v_scale must be given exactly when kv is int8")
        for name in ("k_token_scale", "v_token_scale"):
            scale = getattr(self, name)
            if scale is None:
                continue
            if not quantized:
                raise ValueError(f"{name} needs an int8 kv pool")
            if tuple(scale.shape) != tuple(self.kv.shape[1:4]) or scale.dtype != TOKEN_SCALE_DTYPE:
                raise ValueError(f"{name} must be {tuple(self.kv.shape[1:4])} "
                                 f"{TOKEN_SCALE_DTYPE}, got {tuple(scale.shape)} {scale.dtype}")

    @property
    def token_scales(self) -> list[torch.Tensor]:
        """The dynamic scale tensors present, K first (what travels beside the blocks)."""
        return [t for t in (self.k_token_scale, self.v_token_scale) if t is not None]

    @property
    def k(self) -> torch.Tensor:  # (num_blocks, block_size, num_kv_heads, head_dim)
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:  # (num_blocks, block_size, num_kv_heads, head_dim)
        return self.kv[1]

    def slot_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as (num_slots, kv_heads, head_dim) views, slot ``s`` = row ``s``: what
        writes scatter into and gathers read (made once per ``kv`` tensor)."""
        held = self.__dict__.get("_slot_rows")
        if held is None or held[0] is not self.kv:
            rows = self.kv.view(2, -1, *self.kv.shape[3:])
            held = self.__dict__["_slot_rows"] = (self.kv, rows[0], rows[1])
        return held[1], held[2]

    @property
    def is_quantized(self) -> bool:
        return self.kv.dtype == torch.int8

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.kv.shape[2]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs in this layer, its token scales included."""
        return self.kv[:, 0].numel() * self.kv.element_size() + sum(
            t[0].numel() * t.element_size() for t in self.token_scales)
