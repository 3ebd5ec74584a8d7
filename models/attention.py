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
    def whole_prompts(self) -> WholePrompts | None:
        """The step's sequences whose queries are their whole context (prompts with no cached
        prefix: the step's K/V are all of theirs), apart from the others; None when there is
        none. Several sequences are checked on the CPU only (elsewhere None: no device sync).
        Asked by every layer, computed once."""
        if self.num_seqs == 1:
            if self.max_query_len != self.max_context_len:
                return None
            return WholePrompts([(0, self.max_query_len)])
        if self.cu_seqlens_q.device.type != "cpu":
            return None
        q_lens = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).to(self.context_lens.dtype)
        whole = q_lens == self.context_lens
        if not bool(whole.any()):
            return None
        starts = self.cu_seqlens_q[:-1]
        prompts = list(zip(starts[whole].tolist(), (starts + q_lens)[whole].tolist(),
                           strict=True))
        if bool(whole.all()):
            return WholePrompts(prompts)
        seqs = (~whole).nonzero().flatten()
        rest_lens = q_lens[seqs].long()
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(rest_lens, 0, out=cu[1:])
        rows = torch.arange(int(cu[-1])) + torch.repeat_interleave(
            starts[seqs].long() - cu[:-1], rest_lens)
        context_lens = self.context_lens[seqs]
        rest = AttentionMetadata(
            slot_mapping=self.slot_mapping[rows], cu_seqlens_q=cu.to(self.cu_seqlens_q.dtype),
            context_lens=context_lens, block_tables=self.block_tables[seqs],
            max_query_len=int(rest_lens.max()), max_context_len=int(context_lens.max()),
            backend=self.backend)
        return WholePrompts(prompts, rows, rest)

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


@dataclass(frozen=True)
class WholePrompts:
    """A step's whole prompts (:attr:`AttentionMetadata.whole_prompts`), which attend from
    their own K/V, and the rest of its sequences (decodes, later chunks of prompts, prompts
    after a cached prefix), which attend over the paged pool."""

    bounds: list[tuple[int, int]]  # each whole prompt's rows of the flat batch, start to end
    rest_rows: torch.Tensor | None = None  # (R,) int64: the other sequences' rows (None: none)
    rest: AttentionMetadata | None = None  # their metadata, as a batch of their own


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
                and meta.whole_prompts is not None):
            # whole prompts, their K/V stored as they are: attend from them, not the cache
            out = self._whole_prompts(q, k, v, cache, meta.whole_prompts, meta.backend)
            if out is not None:
                return out
        return self._paged(q, cache, meta)

    def _paged(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata
               ) -> torch.Tensor:
        """Every query of ``meta``'s batch over the K/V in the paged pool."""
        if meta.is_decode_only:
            return kernels.paged_decode_attention(
                q, cache, meta.block_tables, meta.context_lens, self.scale, self.sliding_window,
                backend=meta.backend, max_context_len=meta.max_context_len)
        return kernels.paged_attention(
            q, cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, self.scale,
            self.sliding_window, backend=meta.backend, max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len)

    def _whole_prompts(self, q, k, v, cache: KVCacheLayer, split: WholePrompts, backend: str
                       ) -> torch.Tensor | None:
        """Each whole prompt of the packed q, k, v attending to itself
        (:func:`kernels.prompt_attention`), the step's other rows over the pool; None where
        that kernel does not serve (Triton reads the cache as fast)."""
        outs = []
        for start, end in split.bounds:
            out = kernels.prompt_attention(q[start:end], k[start:end], v[start:end], self.scale,
                                           backend=backend)
            if out is None:
                return None
            outs.append(out)
        if split.rest is None:
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        out = q.new_empty(q.shape)
        for (start, end), prompt in zip(split.bounds, outs, strict=True):
            out[start:end] = prompt
        out[split.rest_rows] = self._paged(q.index_select(0, split.rest_rows), cache, split.rest)
        return out
