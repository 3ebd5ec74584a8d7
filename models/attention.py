"""Per-step attention metadata and the attention layer every decoder block uses.

The engine's model runner builds one :class:`AttentionMetadata` per step and passes it down
the forward call; there is no module-global context.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from pdserve import kernels
from pdserve.kernels import KVCacheLayer
from pdserve.kernels.lora import LoraBatch


@dataclass
class AttentionMetadata:
    """Flat tensors describing one step's batch; sequences are packed in the same order."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot each new token's K/V goes to
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32: query token offsets per sequence
    context_lens: torch.Tensor  # (num_seqs,) int32: tokens in cache after this step, per sequence
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32; unused entries are 0, never read
    max_query_len: int  # longest query run in the batch
    max_context_len: int  # longest context in the batch
    backend: str = "auto"  # kernel backend: "auto" | "torch" | "native" | "triton"
    lora: LoraBatch | None = None  # each row's LoRA adapter slot (None: every row the base's)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence brings exactly one new token (the decode kernel applies)."""
        return self.max_query_len == 1

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @functools.cached_property
    def prompt_bounds(self) -> list[int] | None:
        """``cu_seqlens_q`` as a list where every sequence's queries are its whole context
        (prompts with no cached prefix: the step's K/V are all of theirs), else None; several
        sequences are checked on the CPU only (elsewhere None: no device sync). Asked by every
        layer, computed once."""
        if self.max_query_len != self.max_context_len:  # the longest is no whole prompt
            return None
        if self.num_seqs == 1:
            return [0, self.max_query_len]
        if self.cu_seqlens_q.device.type != "cpu":
            return None
        q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        if not torch.equal(q_lens.to(self.context_lens.dtype), self.context_lens):
            return None
        return self.cu_seqlens_q.tolist()

    def of_rows(self, rows: torch.Tensor) -> AttentionMetadata:
        """The batch's ``rows`` (R,) of the flat batch, each as one query (a decode) at its own
        position over the keys up to it, in its sequence's blocks (their K/V already written)."""
        ends = self.cu_seqlens_q[1:].long()
        seq = torch.searchsorted(ends, rows, right=True)  # the sequence of each row
        context_lens = self.context_lens.long()[seq] - (ends[seq] - 1 - rows)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[rows],
            cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32, device=rows.device),
            context_lens=context_lens.to(torch.int32), block_tables=self.block_tables[seq],
            max_query_len=1, max_context_len=int(context_lens.max()) if len(rows) else 0,
            backend=self.backend, lora=None if self.lora is None else self.lora.of_rows(rows))


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the whole context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer,
                meta: AttentionMetadata,
                rows: tuple[torch.Tensor, AttentionMetadata] | None = None) -> torch.Tensor:
        """q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim);
        returns (num_tokens, num_heads, head_dim). With ``rows`` (the flat batch's rows and
        :meth:`AttentionMetadata.of_rows` of them) every token's K/V is written but only those
        rows' queries attend: returns (len(rows), num_heads, head_dim)."""
        kernels.write_kv(k, v, cache, meta.slot_mapping, backend=meta.backend)
        if rows is not None:
            q, meta = q.index_select(0, rows[0]), rows[1]
            if not len(q):
                return q
        elif (self.sliding_window is None and cache.kv.dtype == k.dtype
                and meta.prompt_bounds is not None):
            # whole prompts, their K/V stored as they are: attend from them, not the cache
            out = self._prompts(q, k, v, meta.prompt_bounds, meta.backend)
            if out is not None:
                return out
        if meta.is_decode_only:
            return kernels.paged_decode_attention(
                q, cache, meta.block_tables, meta.context_lens, self.scale, self.sliding_window,
                backend=meta.backend, max_context_len=meta.max_context_len)
        return kernels.paged_attention(
            q, cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, self.scale,
            self.sliding_window, backend=meta.backend, max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len)

    def _prompts(self, q, k, v, bounds: list[int], backend: str) -> torch.Tensor | None:
        """Each whole prompt of the packed q, k, v (rows ``bounds[i]:bounds[i + 1]``)
        attending to itself (:func:`kernels.prompt_attention`); None where that kernel does not
        serve (Triton reads the cache as fast)."""
        if len(bounds) == 2:
            return kernels.prompt_attention(q, k, v, self.scale, backend=backend)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            out = kernels.prompt_attention(q[start:end], k[start:end], v[start:end], self.scale,
                                           backend=backend)
            if out is None:
                return None
            outs.append(out)
        return torch.cat(outs)
