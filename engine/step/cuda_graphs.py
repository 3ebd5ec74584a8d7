"""Decode forwards captured in CUDA graphs, for a ladder of batch sizes (padded).

A decode step of a small model on a GPU is bound by kernel launches, not by the device: dozens
of kernels per layer, each a few microseconds of Python and driver time. Capturing the whole
decode forward (model + logits) once per batch size and replaying it costs one launch.

How it works:

- At engine start (CUDA, ``enforce_eager=False``), :class:`DecodeGraphs` captures the forward
  for every size of :data:`BATCH_SIZES` up to ``max_num_seqs`` (largest first, so the smaller
  graphs reuse its memory pool), over static input buffers: token ids, positions, slot
  mapping, context lengths, block tables as wide as ``max_model_len`` needs. The attention
  kernels see ``max_context_len = max_model_len`` at capture, so one graph serves any context.
- A pure decode step of ``n`` sequences replays the smallest graph of at least ``n`` rows: the
  step's tensors are copied into the first ``n`` rows of the buffers; the padding rows write
  their K/V into a scratch block that the block manager never hands out and attend only to it.
  The logits of the first ``n`` rows are returned (a copy: the next replay overwrites them).
- Anything else (prefill chunks, speculative verification, a per-layer callback, a batch wider
  than the largest graph, the torch attention backend whose reference kernels sync the host)
  runs eagerly, as on CPU. ``enforce_eager=True`` (vLLM's name) turns graphs off.

The capture itself is a strategy (``capture``): :func:`cuda_capture` on a GPU; the CPU tests
use :func:`eager_capture`, which replays by calling the forward again on the same static
buffers, so the buffer plumbing and the padding are checked against the eager forward on every
machine. A real capture is tested where a GPU is present (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

Replay = Callable[[], torch.Tensor]  # runs the captured forward, returns the static logits


def cuda_capture(forward: Callable[[], torch.Tensor], pool=None) -> tuple[Replay, object]:
    """Capture ``forward`` in a CUDA graph (after warm-up on a side stream, as torch asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: lazy initialisation and Triton autotuning happen here
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward()
    return (lambda: (graph.replay(), logits)[1]), graph.pool()


def eager_capture(forward: Callable[[], torch.Tensor], pool=None) -> tuple[Replay, object]:
    """A stand-in capture for machines without CUDA: replay calls ``forward`` again."""
    return forward, pool


@dataclass
class _Buffers:
    """Static inputs of every graph (views of the first rows for the smaller ones)."""

    input_ids: torch.Tensor  # (max_rows,) int64
    positions: torch.Tensor  # (max_rows,) int64
    slot_mapping: torch.Tensor  # (max_rows,) int64
    context_lens: torch.Tensor  # (max_rows,) int32
    block_tables: torch.Tensor  # (max_rows, width) int32
    cu_seqlens_q: torch.Tensor  # (max_rows + 1,) int32: 0, 1, 2, ...


class DecodeGraphs:
    """Captured pure-decode forwards of one model over its KV pool (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int,
                 device: torch.device, backend: str, max_model_len: int, max_num_seqs: int,
                 scratch_block: int, capture=cuda_capture) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size, self.max_model_len = block_size, max_model_len
        self.scratch_block = scratch_block
        self.sizes = sorted({b for b in BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})
        self.width = -(-max_model_len // block_size)
        rows = self.sizes[-1]
        self.buffers = _Buffers(
            input_ids=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            slot_mapping=torch.full((rows,), scratch_block * block_size, dtype=torch.int64,
                                    device=device),
            context_lens=torch.ones(rows, dtype=torch.int32, device=device),
            block_tables=torch.full((rows, self.width), scratch_block, dtype=torch.int32,
                                    device=device),
            cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device))
        self._replays: dict[int, Replay] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first: the others share its pool
            self._replays[size], pool = capture(self._forward_of(size), pool)
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def _forward_of(self, size: int) -> Callable[[], torch.Tensor]:
        b = self.buffers
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:size], cu_seqlens_q=b.cu_seqlens_q[:size + 1],
            context_lens=b.context_lens[:size], block_tables=b.block_tables[:size],
            max_query_len=1, max_context_len=self.max_model_len, backend=self.backend)

        def forward() -> torch.Tensor:
            with torch.inference_mode():
                hidden = self.model(b.input_ids[:size], b.positions[:size], self.kv_caches, meta)
                return self.model.compute_logits(hidden)
        return forward

    def fits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A pure decode batch a graph can run (one token and one sampled row per sequence)."""
        return (meta.is_decode_only and len(input_ids) <= self.sizes[-1]
                and meta.max_context_len <= self.max_model_len
                and meta.block_tables.shape[1] <= self.width)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """(n, vocab) float32 logits of a batch that :meth:`fits`, by one graph replay."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        b = self.buffers
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(meta.slot_mapping)
        b.context_lens[:n].copy_(meta.context_lens)
        b.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._pad(n, size)
        return self._replays[size]()[:n].clone()

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size write and read the scratch block only."""
        if n == size:
            return
        b = self.buffers
        b.input_ids[n:size] = 0
        b.positions[n:size] = 0
        b.slot_mapping[n:size] = self.scratch_block * self.block_size
        b.context_lens[n:size] = 1
        b.block_tables[n:size, 0] = self.scratch_block
