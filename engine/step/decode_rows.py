"""The decode batch kept across steps, so that a step's decodes cost a few array ops.

A decode computes exactly one token (its last) and samples the next. In continuous batching
most sequences decode in most steps, and from one step to the next their batch barely
changes: each sequence gains one position, one in ``block_size`` steps gains a block, a few
finish and a few join. :class:`DecodeRows` keeps the batch's state in numpy
arrays, one column per sequence in ``state`` (the step's tokens, positions and KV slots, then
what the stop rules, the deltas and the sampler need) and one row per sequence in ``tables``
(its block table). Each step moves them on by diffs and mirrors into the
:class:`~pdserve.engine.sequence.Sequence` objects what changes there (a token appended, one
more computed token), so those stay the source of truth outside the step (aborts,
preemption, migration, stats).

Only the rows' steps move a decoding sequence (a sequence leaves the decodes only by ending
or being preempted), so a row's state holds for as long as its sequence stays in the rows. The
rows mirror the decodes of the scheduler's ``running_version`` they were synced at
(``version``; -1 after a step the scheduler made in full, whose decodes are matched by
identity):

- :meth:`DecodeRows.sync` rebuilds them for a step's decodes in their order: a sequence that
  stayed keeps its table row and its state column (one fancy index each), the blocks the
  schedule gave it read from its table; a sequence that joined, or whose table was replaced
  (preempted and admitted again), gets a fresh column read from it; when the only change is
  sequences joining after every row of a steady step (a decode worker's steady state), the
  arrays just grow by their columns;
- :meth:`DecodeRows.ended` removes the rows that finished in the step just run, when that
  is all that changed, so a finish costs no sync.

Each step moves the arrays on in place (a sync, a drop or wider tables make new ones), so
the runner's CPU tensors over them (``ModelRunner.prepare``) are made once per arrays,
and a :class:`~pdserve.engine.step.model_runner.ModelInput` of the rows holds for its own step
only. What outlives the step is copied: the counters of its deltas, and the per-row lists,
which a sync or a drop replaces rather than edits.

The rows belong to the model runner (``ModelRunner.prepare`` syncs them from each
:class:`~pdserve.engine.step.scheduler_output.SchedulerOutput`'s decodes, and puts the step's
chunks after them); the scheduler never reads them: it gives the sequences their blocks and
counts their progress, and hands the rows the blocks it appended
(:meth:`DecodeRows.blocks_added`).

With a sliding window, blocks that fell out of it are freed by the scheduler and
become ``None`` in the sequence's table; the rows keep the old id there (0 for an entry
already ``None`` when read), which the attention kernels never read: they read only the
window's blocks.

``tests/engine/test_decode_rows.py`` runs random traffic through an engine with the rows and
one whose every sequence is a chunk built per step: every forward's tensors and every rendered
delta are equal.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter, is_

import numpy as np
import torch

from pdserve.engine.sampling.sampler import (
    SamplingBatch,
    SamplingRow,
    is_penalized,
    logit_bias_of,
    takes_argmax,
)
from pdserve.engine.sequence import Sequence
from pdserve.worker_api import StepDeltas

# the rows of DecodeRows.state, one column per batch row; from SAMPLING on, the sampler's
(TOKENS, POSITIONS, SLOTS, NUM_BLOCKS, LAST_POSITIONS, NUM_PROMPT, NUM_OUTPUT, STOPS_ON_EOS,
 PER_TOKEN, FIRST, GREEDY, PENALIZED, BIASED, SAMPLING) = range(14)
NUM_FIELDS = SAMPLING + SamplingBatch.NUM_COLUMNS
# up to this many rows, a loop of scalar reads and writes beats numpy's fixed cost per call
# (a few us each right after a forward): the rows that enter a block in one step of a batch
# whose lengths are spread (batch / block_size of them)
FEW_ROWS = 32

_BLOCK_TABLE, _TOKEN_IDS = attrgetter("block_table"), attrgetter("token_ids")
_REQUEST_ID, _ATTEMPT = attrgetter("request_id"), attrgetter("attempt")
_ROW_OBJECTS = ("seqs", "_table_refs", "_token_lists", "request_ids", "attempts")


class DecodeRows:
    """The rows of the running decode batch (see the module docstring)."""

    def __init__(self, block_size: int, max_model_len: int | None = None,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len  # the context limit (a row at it ends)
        self.window = window  # the model's sliding window (None: none)
        self.version = -1  # the scheduler's running_version these rows mirror (-1: none)
        self.seqs: list[Sequence] = []
        # one int64 column per row: the step's tokens, positions (= num_computed_tokens) and
        # KV slots (-1: the position starts a block the row does not have yet), then what
        # the stop rules, the deltas and the sampler need. Moved on in place by each step.
        self.state = np.zeros((NUM_FIELDS, 0), np.int64)
        self.context_lens = np.zeros(0, np.int32)  # positions + 1
        self.max_context_len = self.num_context = 0  # max and sum of context_lens
        self.needs_block: list[int] = []  # rows whose position starts a block not yet theirs
        self.tables = np.zeros((0, 8), np.int32)  # block tables; entries past num_blocks: 0
        self.tables_tensor = torch.from_numpy(self.tables)  # the same memory
        self.max_blocks = 0
        self.any_eos = self.any_per_token = self.any_first = self.all_greedy = False
        self.any_penalized = self.any_biased = False
        # per-row constants of the compact deltas (new lists on every sync: deltas hold them)
        self.request_ids: list[str] = []
        self.attempts: list[int] = []
        self._token_lists: list[list[int]] = []  # each row's seq.token_ids
        self._table_refs: list[list] = []  # the seq.block_table each row was filled from

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def host(self) -> np.ndarray:
        """(3, rows) int64: the step's tokens, positions and slots (what the model reads)."""
        return self.state[:SLOTS + 1]

    # -- sync --------------------------------------------------------------------------------

    def sync(self, seqs: list[Sequence], version: int = -1) -> list[Sequence]:
        """Make the rows those of ``seqs`` in order (each with one token left to compute).
        ``version``: the scheduler's running_version whose decodes ``seqs`` are, -1 when the
        schedule was made in full (it may have given kept rows blocks). Returns the sequences
        that got fresh rows (the others kept theirs)."""
        seqs, n = list(seqs), len(self.seqs)
        tables = list(map(_BLOCK_TABLE, seqs))
        if version >= 0 and len(seqs) > n and all(map(is_, seqs, self.seqs)):
            fresh = self._append(seqs[n:], tables[n:])  # (a decode worker's joins)
        else:
            old = self._old_rows(seqs, tables)
            num_blocks = self._sync_tables(tables, old)
            fresh = self._sync_state(seqs, old, num_blocks)
        self._set_seqs(seqs, tables)
        self.version = version
        return fresh

    def _append(self, seqs: list[Sequence], tables: list[list]) -> list[Sequence]:
        """Fresh rows for ``seqs`` after every row there is (which stay as they are)."""
        n, k = len(self.seqs), len(seqs)
        grown = np.zeros((n + k, self._table_width(max(map(len, tables)))), np.int32)
        grown[:n, :self.tables.shape[1]] = self.tables
        for row, table in enumerate(tables, n):
            grown[row, :len(table)] = np.fromiter(self._block_ids(table), np.int32, len(table))
        self._set_tables(grown)
        columns = np.array(list(map(self._fresh_row, seqs)), np.int64).T  # (fields, k)
        self.state = state = np.concatenate([self.state, columns], axis=1)
        self.needs_block = self.needs_block + self._look_up_slots(np.arange(n, n + k))
        self.context_lens = np.concatenate(
            [self.context_lens, (state[POSITIONS, n:] + 1).astype(np.int32)])
        self._batch_totals()
        return seqs

    def _old_rows(self, seqs: list[Sequence], tables: list[list]) -> np.ndarray:
        """Each sequence's current row, or -1 (new, or its table was replaced: preempted and
        admitted again)."""
        row_of = dict(zip(map(id, self.seqs), range(len(self.seqs)), strict=True))
        old_rows = list(map(row_of.get, map(id, seqs), repeat(-1)))
        refs = self._table_refs
        for j, i in enumerate(old_rows):
            if i >= 0 and tables[j] is not refs[i]:
                old_rows[j] = -1
        return np.asarray(old_rows, np.int64)

    def _set_seqs(self, seqs: list[Sequence], tables: list[list]) -> None:
        """The per-row objects (new lists: handed-out deltas hold the old ones)."""
        self.seqs, self._table_refs = seqs, tables
        self._token_lists = list(map(_TOKEN_IDS, seqs))
        self.request_ids = list(map(_REQUEST_ID, seqs))
        self.attempts = list(map(_ATTEMPT, seqs))

    def _sync_tables(self, tables: list[list], old: np.ndarray) -> np.ndarray:
        """Block tables of the new rows: kept rows copied by one fancy index, then the entries
        each table gained (a fresh row: all of them) written. Returns their lengths."""
        lengths = np.fromiter(map(len, tables), np.int64, len(tables))
        new = np.zeros((len(tables), self._table_width(int(lengths.max(initial=0)))), np.int32)
        known = np.zeros(len(tables), np.int64)
        kept = np.flatnonzero(old >= 0)
        if len(kept):
            new[kept, :self.tables.shape[1]] = self.tables[old[kept]]
            known[kept] = self.state[NUM_BLOCKS, old[kept]]
        known = np.minimum(known, lengths)
        grown = np.flatnonzero(lengths != known)
        if len(grown):  # every gained entry in one write
            counts = lengths[grown] - known[grown]
            starts = known[grown].tolist()
            blocks = np.fromiter(self._block_ids(chain.from_iterable(
                tables[j][start:] for j, start in zip(grown.tolist(), starts, strict=True))),
                np.int32, int(counts.sum()))
            row = np.repeat(grown, counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            column = np.arange(len(blocks)) - first + np.repeat(known[grown], counts)
            new[row, column] = blocks
        self._set_tables(new)
        return lengths

    def _block_ids(self, entries):
        """A table's entries as block ids (with a window, a freed entry, None, reads as 0)."""
        return entries if self.window is None else (0 if b is None else b for b in entries)

    def _table_width(self, needed: int) -> int:
        """The tables' width doubled until it holds ``needed`` blocks."""
        width = self.tables.shape[1]
        while width < needed:
            width *= 2
        return width

    def _set_tables(self, tables: np.ndarray) -> None:
        self.tables, self.tables_tensor = tables, torch.from_numpy(tables)

    def _sync_state(self, seqs: list[Sequence], old: np.ndarray,
                    num_blocks: np.ndarray) -> list[Sequence]:
        """Kept rows' state moves by one fancy index; fresh rows' is read from their
        sequences; then what is derived from the whole batch. Returns the fresh ones."""
        state = np.empty((NUM_FIELDS, len(seqs)), np.int64)
        kept, fresh = np.flatnonzero(old >= 0), np.flatnonzero(old < 0)
        if len(kept):
            state[:, kept] = self.state[:, old[kept]]
        fresh_seqs = [seqs[j] for j in fresh.tolist()]
        if fresh_seqs:
            state[:, fresh] = np.array(list(map(self._fresh_row, fresh_seqs)), np.int64).T
        state[NUM_BLOCKS] = num_blocks
        self.state = state
        # fresh rows, and kept rows entering a block (their tables were just read again)
        self.needs_block = self._look_up_slots(np.flatnonzero(state[SLOTS] < 0))
        self.context_lens = (state[POSITIONS] + 1).astype(np.int32)
        self._batch_totals()
        return fresh_seqs

    def ended(self, rows: list[int], version_before: int, version: int) -> None:
        """Rows ``rows`` ended in the step just run, which the scheduler's ``running_version``
        saw go from ``version_before`` to ``version``: when the rows mirrored the former and
        those ends are all that changed, they are dropped (:meth:`drop`), so the next step
        needs no sync; otherwise the next step's sync rebuilds them."""
        if self.version == version_before == version - len(rows):
            self.drop(rows, version)

    def drop(self, rows: list[int], version: int) -> None:
        """Rows ``rows`` ended in the step just run, and that is all that changed in the
        running set (now at ``version``): keep the others in order, by one fancy index."""
        keep = np.ones(len(self.seqs), bool)
        keep[rows] = False
        self.state = state = self.state[:, keep]
        self._set_tables(self.tables[keep])
        self.context_lens = self.context_lens[keep]
        for name in _ROW_OBJECTS:  # copies: handed-out deltas hold the old lists
            values = getattr(self, name).copy()
            for row in reversed(rows):
                del values[row]
            setattr(self, name, values)
        self.needs_block = np.flatnonzero(state[SLOTS] < 0).tolist()
        self._batch_totals()
        self.version = version

    def _batch_totals(self) -> None:
        state = self.state
        positions = state[POSITIONS]
        self.max_context_len = int(positions.max(initial=-1)) + 1
        self.num_context = int(positions.sum()) + len(positions)
        self.max_blocks = int(state[NUM_BLOCKS].max(initial=0))
        self.any_eos = bool(state[STOPS_ON_EOS].any())
        self.any_per_token = bool(state[PER_TOKEN].any())
        self.any_first = bool(state[FIRST].any())
        self.all_greedy = bool(state[GREEDY].all())
        self.any_penalized = bool(state[PENALIZED].any())
        self.any_biased = bool(state[BIASED].any())

    def _fresh_row(self, seq: Sequence) -> tuple:
        p = seq.sampling_params
        limit = seq.num_prompt_tokens + p.max_tokens
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        return (seq.token_ids[-1], seq.num_computed_tokens, -1, len(seq.block_table),
                limit - 1, seq.num_prompt_tokens, seq.num_output_tokens, not p.ignore_eos,
                bool(p.stop or p.stop_token_ids or p.logprobs is not None  # PER_TOKEN
                     or p.structured_outputs is not None),
                seq.first_token_time is None, takes_argmax(p),
                is_penalized(p), p.logit_bias is not None, *SamplingBatch.columns(seq))

    def _look_up_slots(self, rows: np.ndarray) -> list[int]:
        """Slots of ``rows`` from their tables (-1 where the position's block is missing);
        returns the rows whose block is missing."""
        if len(rows) <= FEW_ROWS:
            return self._look_up_slots_each(rows.tolist())
        bs, state = self.block_size, self.state
        positions = state[POSITIONS, rows]
        has = positions < state[NUM_BLOCKS, rows] * bs
        if not has.any():  # (rows entering their next blocks together)
            state[SLOTS, rows] = -1
            return rows.tolist()
        column = np.minimum(positions // bs, self.tables.shape[1] - 1)
        slots = self.tables[rows, column].astype(np.int64) * bs + positions % bs
        state[SLOTS, rows] = np.where(has, slots, -1)
        return rows[~has].tolist()

    def _look_up_slots_each(self, rows: list[int]) -> list[int]:
        """:meth:`_look_up_slots` one row at a time (the few rows that enter a block in one
        step of a batch whose lengths are spread)."""
        bs, tables, state = self.block_size, self.tables, self.state
        positions, num_blocks, slots = state[POSITIONS], state[NUM_BLOCKS], state[SLOTS]  # views
        missing = []
        for row in rows:
            position = int(positions[row])
            if position < num_blocks[row] * bs:
                slots[row] = int(tables[row, position // bs]) * bs + position % bs
            else:
                slots[row] = -1
                missing.append(row)
        return missing

    # -- the steps ---------------------------------------------------------------------------

    def sampling_batch(self, penalized: list[SamplingRow] | None = None) -> SamplingBatch:
        """The rows' sampling inputs as views of their state (this step's: ``advance`` makes a
        new state); ``penalized``: every row's SamplingRow, needed when :attr:`any_penalized`;
        the rows' logit biases are read from their sequences when :attr:`any_biased`."""
        state = self.state
        biases = logit_bias_of([seq.sampling_params for seq in self.seqs]) \
            if self.any_biased else None
        return SamplingBatch.from_columns(state[SAMPLING:], state[NUM_OUTPUT], penalized, biases)

    def blocks_added(self, seqs: list[Sequence], blocks: list[int]) -> None:
        """``seqs`` were each given their next block, ``blocks[i]`` for ``seqs[i]`` (the last
        entry of its table now): the rows in :attr:`needs_block` take theirs. In a steady
        step they are those sequences, in order; after a sync, whose reading of the tables
        may have found some, each row's block is read from its table. A row left without a
        block is a scheduling bug, and raises."""
        rows = self.needs_block
        if not rows:
            return
        if len(rows) != len(seqs) or not all(map(is_, map(self.seqs.__getitem__, rows), seqs)):
            num_blocks = self.state[NUM_BLOCKS]
            tables = [self.seqs[row].block_table for row in rows]
            columns = [int(num_blocks[row]) for row in rows]
            for row, table, column in zip(rows, tables, columns, strict=True):
                if column >= len(table):
                    raise RuntimeError(f"{self.seqs[row].request_id}: no KV block for its next "
                                       "position; the scheduler gave it none")
            blocks = [table[column] for table, column in zip(tables, columns, strict=True)]
        self._blocks_added(rows, blocks)

    def _blocks_added(self, rows: list[int], blocks: list[int]) -> None:
        """Each of ``rows`` got its next block, ``blocks[i]`` for ``rows[i]``."""
        state, bs = self.state, self.block_size
        num_blocks = state[NUM_BLOCKS]
        if len(rows) <= FEW_ROWS:  # one at a time
            positions, slots = state[POSITIONS], state[SLOTS]
            for row, block in zip(rows, blocks, strict=True):
                column = int(num_blocks[row])
                self._widen_tables(column + 1)
                self.tables[row, column] = block
                num_blocks[row] = column + 1
                slots[row] = block * bs + int(positions[row]) % bs
                self.max_blocks = max(self.max_blocks, column + 1)
        else:
            index = np.asarray(rows, np.int64)
            columns = num_blocks[index]
            most = int(columns.max()) + 1
            self._widen_tables(most)
            block_ids = np.asarray(blocks, np.int64)
            self.tables[index, columns] = block_ids
            num_blocks[index] = columns + 1
            state[SLOTS, index] = block_ids * bs + state[POSITIONS, index] % bs
            self.max_blocks = max(self.max_blocks, most)
        self.needs_block = []

    def _widen_tables(self, needed: int) -> None:
        """Widen the tables to hold ``needed`` blocks (new entries 0)."""
        width = self._table_width(needed)
        if width > self.tables.shape[1]:
            self._set_tables(np.pad(self.tables, ((0, 0), (0, width - self.tables.shape[1]))))

    def advance(self, token_ids: list[int], tokens: np.ndarray) -> None:
        """Every row computed its position (``num_computed_tokens``, which the scheduler
        moved on) and sampled ``token_ids[row]`` (``tokens``: the same as an array): each
        sequence gets its token, and the rows move to the next position (a row entering a
        new block looks its slot up, or waits in :attr:`needs_block` for the scheduler to
        give it one)."""
        list(map(list.append, self._token_lists, token_ids))
        state = self.state
        state[TOKENS] = tokens
        state[POSITIONS:SLOTS + 1] += 1  # positions and slots, one op
        state[NUM_OUTPUT] += 1
        self.context_lens += 1
        self.max_context_len += 1
        self.num_context += len(self.seqs)
        entering = np.flatnonzero(state[POSITIONS] % self.block_size == 0)
        if len(entering):
            self.needs_block = self._look_up_slots(entering)

    def first_tokens_sent(self) -> None:
        """Every row has had its first token (after a step's deltas)."""
        if self.any_first:
            self.state[FIRST] = 0
            self.any_first = False

    def new_token_deltas(self, token_ids: list[int], skip: list[int]) -> StepDeltas:
        """After :meth:`advance`: the deltas of every row but ``skip`` (ascending), each
        adding its one token ``token_ids[row]``."""
        if skip:
            keep = np.ones(len(self.seqs), bool)
            keep[skip] = False
            index = np.flatnonzero(keep)
            counts = self.state[NUM_PROMPT:NUM_OUTPUT + 1, index]  # (a copy)
            rows = index.tolist()
            return StepDeltas.new_tokens([self.request_ids[i] for i in rows],
                                         [token_ids[i] for i in rows],
                                         [self.attempts[i] for i in rows], counts[0], counts[1])
        counts = self.state[NUM_PROMPT:NUM_OUTPUT + 1].copy()  # (the next step moves state)
        return StepDeltas.new_tokens(self.request_ids, token_ids, self.attempts, counts[0],
                                     counts[1])

    def ending(self, eos_token_ids) -> np.ndarray:
        """After :meth:`advance`: the rows whose token goes through the per-token stop rules:
        those with their own (stop strings, stop ids, logprobs), those the token may end
        (an EOS, max_tokens or the context limit) and those whose first token it is."""
        state = self.state
        ending = state[POSITIONS] >= state[LAST_POSITIONS]
        if self.any_per_token:
            ending |= state[PER_TOKEN].astype(bool)
        if self.any_first:  # (its first token: the delta says where its TTFT went)
            ending |= state[FIRST].astype(bool)
        if self.any_eos:
            for eos in eos_token_ids:  # (one or two ids: cheaper than np.isin)
                ending |= (state[TOKENS] == eos) & state[STOPS_ON_EOS].astype(bool)
        return np.flatnonzero(ending)
