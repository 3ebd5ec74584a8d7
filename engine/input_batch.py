"""The decode batch kept across steps, so a step of pure decodes costs a few tensor ops.

A step in which every scheduled sequence computes exactly one token (its last) is a pure
decode step. In continuous batching most steps are, and from one to the next the batch barely
changes: each sequence gains one position, one in ``block_size`` steps gains a block, a few
finish and a few join. :class:`DecodeBatch` keeps the batch's block tables in one persistent
int32 tensor and updates it by those diffs:

- a sequence that stays keeps its row; rows of sequences that left are dropped by one
  ``index_select`` (order kept, so the rows follow the scheduler's order);
- a sequence whose block table grew gets only its new entries written;
- a sequence that joined (or whose table was replaced: preempted and admitted again) gets a
  fresh row.

The tokens and positions of the step are read from the sequences (one list each); the slot
mapping, context lengths and sample rows are computed from the tensors. Anything but a pure
decode step goes through :meth:`ModelRunner.prepare`'s general path and resets the batch, so
the fast path never sees a state the general path made. Models with a sliding window always
take the general path (their freed blocks become ``None`` entries in place).

The fast path's tensors are checked against the general path's in
``tests/engine/test_input_batch.py`` over random add / finish / preempt sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sequence import Sequence


@dataclass
class DecodeBatch:
    """Persistent block tables of the last pure decode step (see the module docstring)."""

    device: torch.device
    seqs: list[Sequence] = field(default_factory=list)  # one per row
    keys: list[tuple[int, int]] = field(default_factory=list)  # (id(seq), id(its table))
    num_blocks: list[int] = field(default_factory=list)  # table entries already in the row
    tables: torch.Tensor = field(init=False)  # (rows, width) int32 on ``device``

    def __post_init__(self) -> None:
        self.tables = torch.zeros(0, 1, dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        self.seqs, self.keys, self.num_blocks = [], [], []

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """(len(seqs), width) int32 block tables of ``seqs`` in order, updated by diffs."""
        keys = [(id(seq), id(seq.block_table)) for seq in seqs]
        if keys != self.keys:
            self._rebase(seqs, keys)
        rows, cols, blocks = [], [], []  # the new entries of tables that grew
        for i, seq in enumerate(seqs):
            n, known = len(seq.block_table), self.num_blocks[i]
            if n != known:
                rows.extend([i] * (n - known))
                cols.extend(range(known, n))
                blocks.extend(seq.block_table[known:n])
                self.num_blocks[i] = n
        if rows:
            if max(cols) >= self.tables.shape[1]:
                width = self.tables.shape[1]
                self.tables = torch.nn.functional.pad(self.tables, (0, max(cols) + 1 - width))
            index = torch.tensor([rows, cols], dtype=torch.int64, device=self.device)
            self.tables[index[0], index[1]] = torch.tensor(blocks, dtype=torch.int32,
                                                           device=self.device)
        return self.tables

    def _rebase(self, seqs: list[Sequence], keys: list[tuple[int, int]]) -> None:
        """Keep the rows of the sequences that stayed in order (a prefix of ``seqs`` once the
        rows that left are dropped); the sequences after them get fresh, empty rows."""
        row_of = {key: i for i, key in enumerate(self.keys)}
        kept: list[int] = []
        for key in keys:
            i = row_of.get(key)
            if i is None or (kept and i < kept[-1]):
                break
            kept.append(i)
        if len(kept) < len(self.keys):
            index = torch.tensor(kept, dtype=torch.int64, device=self.device)
            self.tables = self.tables.index_select(0, index)
        extra = len(seqs) - len(kept)
        if extra:
            fresh = torch.zeros(extra, self.tables.shape[1], dtype=torch.int32,
                                device=self.device)
            self.tables = torch.cat([self.tables, fresh]) if kept else fresh
        self.num_blocks = [self.num_blocks[i] for i in kept] + [0] * extra
        self.seqs, self.keys = list(seqs), keys
