"""Batched LoRA deltas: each row of a step's flat batch adds the low-rank update of its own
adapter, ``y[t] += B[s] (A[s] x[t])`` with ``s`` the row's slot (``-1``: the base model, no
update), so requests for different adapters and for the base model share one step.

Adapter weights live in a fixed pool of slots per linear layer (``a``: (slots, rank, in),
``b``: (slots, out, rank), the adapter's scaling folded into ``b``; a fused layer such as
qkv holds each part's A stacked and its B block-diagonal, unused rank rows and columns zero).
:class:`LoraBatch` says which slot each row uses, computed once per step and shared by every
layer.

Two torch implementations: :func:`lora_delta_gather` gathers each row's A and B and runs one
batched product (the reference, and what the Triton kernel computes the same way); and
:func:`lora_delta_grouped`, the CPU path: one pair of GEMMs per adapter in use over that
adapter's rows (a step rarely mixes more than a few adapters, and a prompt's rows share one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """The adapter slot of every row of one step's flat batch."""

    token_slots: torch.Tensor  # (T,) int64: the slot of each row, -1 for the base model
    groups: tuple[tuple[int, torch.Tensor], ...]  # (slot, its rows (R,) int64) per slot used

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


def lora_delta_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       batch: LoraBatch) -> None:
    """The same update as :func:`lora_delta_gather`, one (shrink, expand) GEMM pair per slot
    over its rows."""
    for slot, rows in batch.groups:
        if len(rows) == len(x):  # every row under one adapter: no gather, no scatter
            out.add_((x @ a[slot].T) @ b[slot].T)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)
