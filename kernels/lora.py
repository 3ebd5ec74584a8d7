"""Batched LoRA deltas: each row of a step's flat batch adds the low-rank update of its own
adapter, ``y[t] += B[s] (A[s] x[t])`` with ``s`` the row's slot (``-1``: the base model, no
update), so requests for different adapters and for the base model share one step.

Adapter weights live in a fixed pool of slots per linear layer (``a``: (slots, rank, in),
``b``: (slots, out, rank), the adapter's scaling folded into ``b``; a fused layer such as
qkv holds each part's A stacked and its B block-diagonal, unused rank rows and columns zero).
:class:`LoraBatch` says which slot each row uses, computed once per step and shared by every
layer.

Three torch implementations: :func:`lora_delta_gather` gathers each row's A and B and runs one
batched product (the reference, and what the Triton kernel computes the same way); and the CPU
paths, which :func:`lora_delta_cpu` picks between: :func:`lora_delta_grouped`, one pair of GEMMs
per adapter in use over that adapter's rows (a prompt's rows share one adapter), and
:func:`lora_delta_span`, every row against the run of slots in use, masked (a decode step of a
few rows over several adapters, where the grouped path's operations per adapter cost more than
their arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoraBatch:
    """The adapter slot of every row of one step's flat batch."""

    token_slots: torch.Tensor  # (T,) int64: the slot of each row, -1 for the base model
    groups: tuple[tuple[int, torch.Tensor], ...]  # (slot, its rows (R,) int64) per slot used
    # lora_delta_span's masks, by rank width (made once per step, shared by the layers)
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def span(self) -> tuple[int, int]:
        """The first and one past the last slot in use."""
        return self.groups[0][0], self.groups[-1][0] + 1

    def span_mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """(T, span x rank): 1 where a row's slot owns the column, else 0."""
        key = (rank, dtype)
        if key not in self._masks:
            first, end = self.span
            local = self.token_slots - first  # (T,): the row's slot within the span
            owner = torch.arange(end - first, device=local.device).repeat_interleave(rank)
            self._masks[key] = (local[:, None] == owner[None, :]).to(dtype)
        return self._masks[key]

    @classmethod
    def of(cls, token_slots: torch.Tensor) -> LoraBatch | None:
        """The batch for ``token_slots`` (T,) int64; None when no row uses an adapter."""
        used = torch.unique(token_slots)
        groups = tuple((int(s), torch.nonzero(token_slots == s).flatten())
                       for s in used.tolist() if s >= 0)
        return cls(token_slots, groups) if groups else None

    def of_rows(self, rows: torch.Tensor) -> LoraBatch | None:
        """The batch of the flat batch's ``rows`` (R,) alone, in that order."""
        return LoraBatch.of(self.token_slots.index_select(0, rows))


def _check(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"x (T, in) and out (T, out) must share T, got {tuple(x.shape)} and "
                         f"{tuple(out.shape)}")
    if a.dim() != 3 or b.dim() != 3 or a.shape[:2] != (b.shape[0], b.shape[2]) \
            or a.shape[2] != x.shape[1] or b.shape[1] != out.shape[1]:
        raise ValueError(f"a must be (slots, rank, in) and b (slots, out, rank) for x "
                         f"{tuple(x.shape)} and out {tuple(out.shape)}, got a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")


def lora_delta_gather(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      token_slots: torch.Tensor) -> None:
    """The reference: ``out[t] += b[s] @ (a[s] @ x[t])`` for each row ``t`` of slot ``s >= 0``,
    in place, with every row's A and B gathered (float32 sums)."""
    _check(out, x, a, b)
    rows = torch.nonzero(token_slots >= 0).flatten()
    if not len(rows):
        return
    slots = token_slots.index_select(0, rows)
    xs = x.index_select(0, rows).float().unsqueeze(2)  # (R, in, 1)
    shrunk = torch.bmm(a.index_select(0, slots).float(), xs)  # (R, rank, 1)
    delta = torch.bmm(b.index_select(0, slots).float(), shrunk).squeeze(2)  # (R, out)
    out.index_add_(0, rows, delta.to(out.dtype))


# lora_delta_cpu takes the span path for at most this many rows (docs/lora.md: at 8 rows over
# 4-8 adapters it beats the grouped path, at 32-64 rows it loses)
SPAN_MAX_ROWS = 16


def lora_delta_cpu(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   batch: LoraBatch) -> None:
    """The CPU's update: :func:`lora_delta_span` for a few rows over two or more adapters
    whose slots are not spread over many others, else :func:`lora_delta_grouped`."""
    first, end = batch.span
    if len(x) <= SPAN_MAX_ROWS and 2 <= len(batch.groups) and end - first <= 2 * len(batch.groups):
        lora_delta_span(out, x, a, b, batch)
    else:
        lora_delta_grouped(out, x, a, b, batch)


def lora_delta_span(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    batch: LoraBatch) -> None:
    """The same update computed for every row against every slot from the first to the last
    in use (contiguous views of the pools, no gather), the shrink masked to each row's own
    slot: five operations whatever the number of adapters, at span / adapters times the
    arithmetic of :func:`lora_delta_grouped`. For a few rows over several adapters (a decode
    step), where the grouped path's operations per adapter cost more than their arithmetic."""
    first, end = batch.span
    span, rank = end - first, a.shape[1]
    shrunk = x @ a[first:end].reshape(span * rank, -1).T  # (T, span x rank)
    shrunk.mul_(batch.span_mask(rank, shrunk.dtype))
    per_slot = torch.bmm(shrunk.view(len(x), span, rank).transpose(0, 1),
                         b[first:end].transpose(1, 2))  # (span, T, out)
    out.add_(per_slot.sum(0) if span > 1 else per_slot[0])


def lora_delta_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       batch: LoraBatch) -> None:
    """The same update as :func:`lora_delta_gather`, one (shrink, expand) GEMM pair per slot
    over its rows."""
    for slot, rows in batch.groups:
        if len(rows) == len(x):  # every row under one adapter: no gather, no scatter
            out.add_((x @ a[slot].T) @ b[slot].T)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)
