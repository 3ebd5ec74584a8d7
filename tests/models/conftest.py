"""Fixtures for the model tests: a paged KV batch builder (see :class:`PagedBatch`)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import KVCacheLayer
from pdserve.models.attention import AttentionMetadata

BLOCK_SIZE = 4


class PagedBatch:
    """Random block tables and a noise-filled paged pool for a fixed set of sequences.

    The pool starts as noise so a kernel that reads a slot nobody wrote shows up as a wrong
    logit; sequences are identified by their index in the block table.
    """

    def __init__(self, config, num_seqs: int, max_len: int, seed: int, num_blocks: int = 64,
                 device: str = "cpu", backend: str = "torch"):
        gen = torch.Generator().manual_seed(seed)
        per_seq = math.ceil(max_len / BLOCK_SIZE)
        perm = torch.randperm(num_blocks, generator=gen)[: num_seqs * per_seq]
        self.block_tables = perm.view(num_seqs, per_seq).to(torch.int32)  # (S, blocks)
        shape = config.kv_cache_shape(num_blocks, BLOCK_SIZE)
        self.caches = [KVCacheLayer(torch.randn(shape, generator=gen).to(device))
                       for _ in range(config.num_hidden_layers)]
        self.device, self.backend = device, backend

    def step(self, chunks: dict[int, tuple[int, list[int]]]):
        """chunks: seq index -> (first position, new token ids). Returns (ids, positions, meta)."""
        ids, positions, slots, q_lens, ctx_lens, tables = [], [], [], [], [], []
        for seq, (start, tokens) in chunks.items():
            pos = torch.arange(start, start + len(tokens))
            table = self.block_tables[seq]
            slots.append(table[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids.append(torch.tensor(tokens))
            positions.append(pos)
            q_lens.append(len(tokens))
            ctx_lens.append(start + len(tokens))
            tables.append(table)
        dev = self.device
        cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev), cu_seqlens_q=cu.to(dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_tables=torch.stack(tables).to(dev), max_query_len=max(q_lens),
            max_context_len=max(ctx_lens), backend=self.backend)
        return torch.cat(ids).to(dev), torch.cat(positions).to(dev), meta


@pytest.fixture(scope="session")
def paged_batch() -> type[PagedBatch]:
    return PagedBatch
