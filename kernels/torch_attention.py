"""Paged attention in plain torch: the attention the CPU serves with (its decodes through the C
kernel of :mod:`pdserve.kernels.cpu_decode_attention` where that builds), and the oracle the
Triton and C attention kernels are tested against.

On the CPU one batched SDPA call costs far less than a call per sequence, so the sequences
of a batch are padded to a common query and context length. Padding to the batch's longest
sequence wastes most of the work when lengths spread (a decode batch whose contexts run from
20 to 400 tokens, prompts of long-tailed lengths), so the batch is split into groups of
similar context length (:func:`length_groups`) when that saves more work than the extra
calls cost. No Python loop runs over sequences or blocks, only over those few groups.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.kv_layout import KVCacheLayer
from pdserve.kernels.torch_ops import as_dtype, dequantize

# a group holds the sequences whose context is at least this share of its longest one:
# every sequence is padded to its group's longest query and context
GROUP_SHARE = 0.5
# what one more group costs, in padded work saved (query x key pairs x heads x head_dim): its
# calls (a context gather, SDPA, views) cost about what
# SDPA and the gather spend on this much padding
SPLIT_COST = 100_000
# whole prompts attend in chunks of this many queries (:func:`_causal_sdpa_in_chunks`)
CAUSAL_CHUNK = 32
# their masks are kept while a call has up to this many keys (under queries x keys floats:
# 16 MB at 2048)
CACHED_MASKS_MAX_Q = 2048


def length_groups(context_lens: list[int], q_lens: list[int], width: int) -> list[list[int]]:
    """The sequences in groups of similar context length, the longest group first, each
    group's indices ascending: a group takes every remaining sequence whose context is at
    least ``GROUP_SHARE`` of the longest remaining. One group of all when splitting saves
    less padded work (pairs x ``width``, heads x head_dim) than ``SPLIT_COST`` a group."""
    if not context_lens or min(context_lens) >= GROUP_SHARE * max(context_lens):
        return [list(range(len(context_lens)))]  # (one group whatever the cost: no sort)
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for s in order:
        if not groups or context_lens[s] < GROUP_SHARE * context_lens[groups[-1][0]]:
            groups.append([s])
        else:
            groups[-1].append(s)

    def padded(group: list[int]) -> int:  # (group[0] is its longest: taken in that order)
        return len(group) * max(q_lens[s] for s in group) * context_lens[group[0]]

    if (padded(order) - sum(map(padded, groups))) * width < SPLIT_COST * (len(groups) - 1):
        return [list(range(len(context_lens)))]
    return [sorted(group) for group in groups]


def _context_slots(block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   max_ctx: int, block_size: int) -> torch.Tensor:
    """(S, ctx) cache slot of each sequence's context positions 0 .. max_ctx - 1.

    Only positions in ``[lo, hi)`` (per sequence, the keys some query may see) are read; the
    others repeat the nearest of those, since slots past a sequence's end or behind block table
    padding may hold anything, NaN included, and 0 * NaN would leak through the softmax.
    """
    pos = torch.arange(max_ctx, device=block_tables.device)[None, :]
    pos = torch.minimum(torch.maximum(pos, lo[:, None]), hi[:, None] - 1).clamp_(min=0)
    return block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size


def _gather_context(cache: KVCacheLayer, slots: torch.Tensor):
    """Each sequence's K and V at ``slots`` (S, ctx): (S, ctx, kv_heads, hd) fp32."""
    flat = slots.view(-1)

    def rows(table: torch.Tensor) -> torch.Tensor:  # (num_slots, *row) -> (S, ctx, *row)
        # a row gather (index_select): the same values as pool[slots], faster on CPU
        return table.index_select(0, flat).view(*slots.shape, *table.shape[1:])

    k_t, v_t = (None if t is None else rows(t.view(-1, t.shape[-1]))  # (S, ctx, kv_heads)
                for t in (cache.k_token_scale, cache.v_token_scale))
    k_rows, v_rows = cache.slot_rows()
    return (dequantize(rows(k_rows), cache.k_scale, torch.float32, k_t),
            dequantize(rows(v_rows), cache.v_scale, torch.float32, v_t))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 GQA attention. q: (S, heads, Q, hd); k, v: (S, ctx, kv_heads, hd); ``mask``
    broadcasts to (S, heads, Q, ctx), additive or bool; None: causal from the top left.
    Returns (S, heads, Q, hd); rows that see nothing are undefined."""
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)


def _visible(q_pos: torch.Tensor, max_ctx: int, sliding_window: int | None) -> torch.Tensor:
    """(S, Q) query positions -> (S, Q, ctx) bool: key k visible iff k <= p (and k > p - w)."""
    k_pos = torch.arange(max_ctx, device=q_pos.device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return visible


def _multi_query_attention(query: torch.Tensor, cache: KVCacheLayer, q_lens: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                           sliding_window: int | None, causal) -> torch.Tensor:
    """Attention of packed queries (tokens, heads, hd) of sequences with several queries each,
    padded per group of similar lengths (:func:`length_groups`); plain causal ones through
    ``causal`` (:func:`_causal_sdpa_in_chunks`'s contract, see :func:`_padded_attention`).
    fp32 out."""
    groups = length_groups(context_lens.tolist(), q_lens.tolist(),
                           query.shape[1] * query.shape[2])
    if len(groups) == 1:
        return _padded_attention(query, cache, q_lens, context_lens, block_tables, scale,
                                 sliding_window, causal)
    group_of_seq = torch.empty(len(q_lens), dtype=torch.long)
    for g, group in enumerate(groups):
        group_of_seq[group] = g
    group_of_token = torch.repeat_interleave(group_of_seq.to(query.device), q_lens)
    out = query.new_empty(query.shape, dtype=torch.float32)
    for g, group in enumerate(groups):
        tokens = group_of_token == g  # (a group's tokens keep their order: its sequences')
        seqs = torch.tensor(group, device=query.device)
        out[tokens] = _padded_attention(query[tokens], cache, q_lens[seqs], context_lens[seqs],
                                        block_tables[seqs], scale, sliding_window, causal)
    return out


def _padded_attention(query: torch.Tensor, cache: KVCacheLayer, q_lens: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      sliding_window: int | None, causal) -> torch.Tensor:
    """Attention of packed queries (tokens, heads, hd) whose sequences have ``q_lens``,
    computed on a (num_seqs, max_q) padding. Returns fp32 (tokens, heads, hd).

    When every sequence is a whole prompt (its queries are its context), or there is one
    sequence (a chunk after its cached prefix), and there is no window, the rule is plain
    causal (``causal``, :func:`_causal_sdpa_in_chunks` or one with its contract): the padding
    keys lie past every real query. One sequence takes no padding at all."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    device = query.device
    max_q = int(q_lens.max())
    if num_seqs == 1:  # (a prompt alone, or beside decodes: nothing to pad)
        q = as_dtype(query, torch.float32)[None]
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
        starts = torch.cumsum(q_lens, 0) - q_lens
        local = torch.arange(num_tokens, device=device) - starts[seq_of_token]
        q = query.new_zeros(num_seqs, max_q, num_heads, head_dim, dtype=torch.float32)
        q[seq_of_token, local] = query.float()
    max_ctx = int(context_lens.max())
    first = context_lens.long() - q_lens  # first query position per sequence
    lo = first - sliding_window + 1 if sliding_window is not None else torch.zeros_like(first)
    k, v = _gather_context(cache, _context_slots(block_tables, lo, context_lens.long(), max_ctx,
                                                 cache.block_size))
    mask = None  # whole prompts, or one sequence's chunk after its prefix, without a window
    if sliding_window is not None or (num_seqs > 1 and bool(first.any())):
        q_pos = first[:, None] + torch.arange(max_q, device=device)
        q_pos = torch.where(torch.arange(max_q, device=device)[None, :] < q_lens[:, None],
                            q_pos, -1)
        mask = _visible(q_pos, max_ctx, sliding_window)[:, None]  # padding sees nothing
    q = q.transpose(1, 2)
    out = (causal(q, k, v, scale) if mask is None
           else _sdpa(q, k, v, scale, mask))  # (S, heads, max_q, hd)
    if num_seqs == 1:
        return out[0].transpose(0, 1)
    return out.transpose(1, 2)[seq_of_token, local]


def _causal_sdpa_in_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """:func:`_sdpa` with the causal rule, run on ``CAUSAL_CHUNK`` queries at a time against
    the keys up to the chunk's last: SDPA's CPU kernel takes keys in blocks of 512 and computes
    a whole block before masking it, so one call on a prompt shorter than that does the masked
    half too. q: (S, heads, Q, hd) at positions K-Q..K-1 (0..Q-1 for whole prompts, a chunk
    after its cached prefix otherwise); k, v: (S, K, kv_heads, hd), K >= Q."""
    num_q = q.shape[2]
    offset = k.shape[1] - num_q
    if num_q <= CAUSAL_CHUNK and not offset:
        return _sdpa(q, k, v, scale)
    out = torch.empty_like(q)
    masks = (_chunk_masks if offset + num_q <= CACHED_MASKS_MAX_Q
             else _chunk_masks.__wrapped__)(num_q, CAUSAL_CHUNK, q.device, offset)
    for index, mask in enumerate(masks):
        start = index * CAUSAL_CHUNK
        end = start + mask.shape[0]
        out[:, :, start:end] = _sdpa(q[:, :, start:end], k[:, :offset + end],
                                     v[:, :offset + end], scale, mask)
    return out


@functools.lru_cache(maxsize=4)
def _chunk_masks(num_q: int, chunk: int, device: torch.device,
                 offset: int = 0) -> list[torch.Tensor]:
    """Additive causal masks (chunk, offset + end) of each chunk of ``num_q`` queries at
    positions offset .. offset + num_q - 1 (the ``offset`` keys before them visible to all):
    made once for every layer of a forward (and for the next prompt of the same shape)."""
    pos = torch.arange(offset + num_q, device=device)
    return [torch.where(pos[None, :offset + min(num_q, start + chunk)]
                        <= pos[offset + start:offset + start + chunk, None], 0.0, -torch.inf)
            for start in range(0, num_q, chunk)]


def paged_attention_torch(query: torch.Tensor, cache: KVCacheLayer, cu_seqlens_q: torch.Tensor,
                          context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                          sliding_window: int | None = None, decode=None,
                          causal=None) -> torch.Tensor:
    """Causal attention of packed variable-length queries over their paged contexts.

    query: (num_tokens, num_heads, head_dim), sequences packed by ``cu_seqlens_q`` (num_seqs+1).
    Sequence ``s``'s queries are the last ``q_len`` positions of its ``context_lens[s]`` tokens,
    whose K/V are already in the cache. A query at position ``p`` sees keys ``k`` with
    ``k <= p`` and, with a window ``w``, ``k > p - w``. Returns (num_tokens, num_heads, head_dim).

    Sequences with one query (decodes in a mixed batch) take the decode path, ``decode``
    (:func:`paged_decode_attention_torch` unless given, with its arguments), so a long prefill
    chunk does not pad every decode in the batch to its length. Without a window, whole
    prompts, and one sequence's chunk after its cached prefix, attend through ``causal``
    (:func:`_causal_sdpa_in_chunks` unless given, with its contract).
    """
    decode = decode or paged_decode_attention_torch
    causal = causal or _causal_sdpa_in_chunks
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    if query.shape[0] == 0:
        return query.new_empty(query.shape)
    single = q_lens == 1
    if bool(single.all()):
        return decode(query, cache, block_tables, context_lens, scale, sliding_window)
    if not bool(single.any()):
        return _multi_query_attention(query, cache, q_lens, context_lens, block_tables, scale,
                                      sliding_window, causal).to(query.dtype)
    token_single = torch.repeat_interleave(single, q_lens)  # (num_tokens,)
    out = torch.empty_like(query)
    out[token_single] = decode(query[token_single], cache, block_tables[single],
                               context_lens[single], scale, sliding_window)
    multi = ~single
    out[~token_single] = _multi_query_attention(
        query[~token_single], cache, q_lens[multi], context_lens[multi], block_tables[multi],
        scale, sliding_window, causal).to(query.dtype)
    return out


@dataclass
class _DecodeGroup:
    """Rows ``start:end`` of the plan's order: their context slots and additive mask."""

    start: int
    end: int
    slots: torch.Tensor  # (n, ctx) int64
    mask: torch.Tensor  # (n, 1, 1, ctx) float32: 0 visible, -inf not


@dataclass
class _DecodePlan:
    """The slots and the additive visibility masks of one decode batch, in groups of similar
    context length (:func:`length_groups`), shared by every layer of a step.

    Every layer of a forward passes the same ``block_tables`` and ``context_lens`` tensors, so
    the plan is computed once per step. It is reused only for those very tensor objects at the
    same version (``_version`` counts in-place writes, as CUDA-graph-style static buffers do;
    inference tensors count none, so theirs is never reused); holding them keeps their ids from
    being reused. One plan per thread (workers' engine loops share a process in tests and the
    local launcher).
    """

    order: torch.Tensor | None  # the rows grouped (None: one group, in the batch's order)
    inverse: torch.Tensor | None  # the batch's order from the grouped one
    groups: list[_DecodeGroup]

    _local = threading.local()

    @classmethod
    def of(cls, block_tables: torch.Tensor, context_lens: torch.Tensor,
           sliding_window: int | None, block_size: int, width: int) -> _DecodePlan:
        """The plan for queries of ``width`` (heads x head_dim) per row."""
        # inference tensors track no version: their plans are never reused
        reusable = not (block_tables.is_inference() or context_lens.is_inference())
        key = ((block_tables._version, context_lens._version, sliding_window, block_size,
                width) if reusable else None)
        held = getattr(cls._local, "plan", None)
        if (reusable and held is not None and held[0] is block_tables
                and held[1] is context_lens and held[2] == key):
            return held[3]
        plan = cls._build(block_tables, context_lens, sliding_window, block_size, width)
        cls._local.plan = (block_tables, context_lens, key, plan) if reusable else None
        return plan

    @classmethod
    def _build(cls, block_tables: torch.Tensor, context_lens: torch.Tensor,
               sliding_window: int | None, bs: int, width: int) -> _DecodePlan:
        lengths = context_lens.tolist()
        groups = length_groups(lengths, [1] * len(lengths), width)
        if len(groups) == 1:
            slots, mask = _decode_slots(block_tables, context_lens, sliding_window, bs)
            return cls(None, None, [_DecodeGroup(0, len(lengths), slots, mask)])
        order = torch.tensor([s for group in groups for s in group],
                             device=context_lens.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        tables, lens = block_tables.index_select(0, order), context_lens.index_select(0, order)
        parts, start = [], 0
        for group in groups:
            end = start + len(group)
            parts.append(_DecodeGroup(start, end, *_decode_slots(
                tables[start:end], lens[start:end], sliding_window, bs)))
            start = end
        return cls(order, inverse, parts)


def _decode_slots(block_tables: torch.Tensor, context_lens: torch.Tensor,
                  sliding_window: int | None, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots (S, ctx), additive mask (S, 1, 1, ctx)) in few ops: positions clamped into each
    sequence's visible keys (see :func:`_context_slots`), their slots, and the mask."""
    pos = torch.arange(int(context_lens.max()), device=context_lens.device)  # (ctx,)
    last = context_lens[:, None].long() - 1  # (S, 1): the query's position
    visible = pos <= last  # (S, ctx)
    clamped = torch.minimum(pos, last)
    if sliding_window is not None:
        first = last - sliding_window + 1
        visible &= pos >= first
        clamped = torch.maximum(clamped, first)
    # int32 tables gather as they are; the arithmetic then widens to int64
    slots = block_tables.gather(1, clamped // bs) * bs + clamped % bs
    mask = torch.where(visible, 0.0, -torch.inf)[:, None, None]  # (S, 1, 1, ctx)
    return slots, mask


def paged_decode_attention_torch(query: torch.Tensor, cache: KVCacheLayer,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 scale: float, sliding_window: int | None = None
                                 ) -> torch.Tensor:
    """One query token per sequence (its last position). query: (num_seqs, num_heads, head_dim)."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    plan = _DecodePlan.of(block_tables, context_lens, sliding_window, cache.block_size,
                          num_heads * head_dim)
    q = as_dtype(query, torch.float32)[:, :, None]  # (S, heads, 1, hd)
    if plan.order is None:
        group = plan.groups[0]
        out = _sdpa(q, *_gather_context(cache, group.slots), scale, group.mask)
    else:
        q = q.index_select(0, plan.order)
        out = torch.cat([_sdpa(q[g.start:g.end], *_gather_context(cache, g.slots), scale, g.mask)
                         for g in plan.groups]).index_select(0, plan.inverse)
    return as_dtype(out[:, :, 0], query.dtype)
