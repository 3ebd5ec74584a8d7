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

import operator
from dataclasses import dataclass, field

import torch

from pdserve.engine.sequence import Sequence


@dataclass
class DecodeBatch:
    """Persistent block tables of the last pure decode step (see the module docstring)."""

    device: torch.device
    seqs: list[Sequence] = field(default_factory=list)  # one per row (held: ids stay unique)
    tables: list[list] = field(default_factory=list)  # the seq.block_table copied into the row
    num_blocks: list[int] = field(default_factory=list)  # table entries already in the row
    tensor: torch.Tensor = field(init=False)  # (rows, width) int32 on ``device``

    def __post_init__(self) -> None:
        self.tensor = torch.zeros(0, 1, dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        self.seqs, self.tables, self.num_blocks = [], [], []

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """(len(seqs), width) int32 block tables of ``seqs`` in order, updated by diffs."""
        if len(seqs) != len(self.seqs) or any(map(operator.is_not, seqs, self.seqs)):
            self._rebase(seqs)
        rows, cols, blocks = [], [], []  # the entries to write: tables that grew or changed
        for i, seq in enumerate(seqs):
            table = seq.block_table
            known = self.num_blocks[i]
            if table is not self.tables[i]:  # replaced (freed, then admitted again)
                self.tables[i], known = table, 0
            if len(table) != known:
                rows.extend([i] * (len(table) - known))
                cols.extend(range(known, len(table)))
                blocks.extend(table[known:])
                self.num_blocks[i] = len(table)
        if rows:
            self._write(rows, cols, blocks)
        return self.tensor

    def _write(self, rows: list[int], cols: list[int], blocks: list[int]) -> None:
        width = max(cols) + 1
        if width > self.tensor.shape[1]:
            self.tensor = torch.nn.functional.pad(self.tensor, (0, width - self.tensor.shape[1]))
        index = torch.tensor([rows, cols], dtype=torch.int64, device=self.device)
        self.tensor[index[0], index[1]] = torch.tensor(blocks, dtype=torch.int32,
                                                       device=self.device)

    def _rebase(self, seqs: list[Sequence]) -> None:
        """Keep the rows of the sequences that stayed in order (a prefix of ``seqs`` once the
        rows that left are dropped); the sequences after them get fresh, empty rows."""
        row_of = {id(seq): i for i, seq in enumerate(self.seqs)}
        kept: list[int] = []
        for seq in seqs:
            i = row_of.get(id(seq))
            if i is None or (kept and i < kept[-1]):
                break
            kept.append(i)
        if len(kept) < len(self.seqs):
            index = torch.tensor(kept, dtype=torch.int64, device=self.device)
            self.tensor = self.tensor.index_select(0, index)
        extra = len(seqs) - len(kept)
        if extra:
            fresh = torch.zeros(extra, self.tensor.shape[1], dtype=torch.int32,
                                device=self.device)
            self.tensor = torch.cat([self.tensor, fresh]) if kept else fresh
        self.seqs = list(seqs)
        self.tables = [self.tables[i] for i in kept] + [None] * extra
        self.num_blocks = [self.num_blocks[i] for i in kept] + [0] * extra
