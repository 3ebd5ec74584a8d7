"""Turns a scheduled batch into flat tensors, runs the model, returns logits to sample from.

Per step (no globals): the runner packs every scheduled sequence's new tokens into one flat
batch, builds one :class:`AttentionMetadata`, runs ``model.forward`` and keeps only the hidden
states of the sequences whose chunk reaches their last token (they get a new token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from pdserve.engine.capacity.roofline import UtilizationMeter, attended_pairs
from pdserve.engine.step.cuda_graphs import DecodeGraphs
from pdserve.engine.step.decode_rows import DecodeRows
from pdserve.engine.step.scheduler_output import ScheduledSequence, SchedulerOutput
from pdserve.kernels import KVCacheLayer
from pdserve.kernels.lora import LoraBatch
from pdserve.models.attention import AttentionMetadata


@dataclass
class Chunk:
    """Tokens one sequence computes in a step, at positions ``start ..``, into the KV slots its
    block table maps them to; the rows of the last ``num_sampled`` tokens get logits, and
    those of the first ``num_scored`` (prompt positions whose logprobs are wanted)."""

    token_ids: list[int]
    start: int
    block_table: list[int | None]
    num_sampled: int = 0
    num_scored: int = 0
    lora_slot: int = -1  # its LoRA adapter's slot (-1: the base model)


@dataclass
class ModelInput:
    """One step's flat batch."""

    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    metadata: AttentionMetadata
    # (num_sampled + num_scored,) int64, ascending (as the model takes them): rows of the flat
    # batch that get logits, those to sample from and the prompt positions to score
    sample_indices: torch.Tensor
    num_scored: int = 0  # prompt positions scored for prompt logprobs: the logits' last rows
    # with num_scored: the logits' order, the sampled rows first, then the scored ones (an
    # index into the rows of sample_indices); None: sample_indices' own order
    logit_order: torch.Tensor | None = None
    num_attended: int = 0  # (query, key) pairs the step's attention computes (causal)
    num_context: int = 0  # KV tokens the step reads: every sequence's context, new ones included


_TOKEN_IDS, _START, _NUM_SAMPLED, _NUM_SCORED = (
    attrgetter("token_ids"), attrgetter("start"), attrgetter("num_sampled"),
    attrgetter("num_scored"))


def _chunk(item: ScheduledSequence) -> Chunk:
    """A scheduled chunk's tokens (then its drafts, when speculating); the rows of the last
    new token and of every draft are sampled."""
    seq, start = item.seq, item.start
    drafts = item.draft_token_ids  # speculative decoding: verified after the new token
    return Chunk([*seq.token_ids[start:start + item.num_new_tokens], *drafts], start,
                 seq.block_table, 1 + len(drafts) if item.samples else 0, item.num_scored,
                 seq.lora_slot)


def _row_slots(rows: DecodeRows) -> np.ndarray:
    """The LoRA slot of each decode row's sequence (-1: the base model)."""
    return np.fromiter((seq.lora_slot for seq in rows.seqs), np.int64, len(rows.seqs))


def _on(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """The array as a tensor on ``device`` (its memory itself on the CPU)."""
    tensor = torch.from_numpy(values)
    return tensor if device.type == "cpu" else tensor.to(device)


class ModelRunner:
    """Owns the model and its KV pools; knows nothing about scheduling policy."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCacheLayer], block_size: int,
                 device: torch.device, backend: str, max_model_len: int | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.meter: UtilizationMeter | None = None  # set by the engine: costs of each forward
        # captured decode forwards on CUDA (EngineParts.capture_decode_graphs)
        self.graphs: DecodeGraphs | None = None
        self.sliding_window = getattr(getattr(model, "config", None), "sliding_window", None)
        self.rows = DecodeRows(block_size, max_model_len, self.sliding_window)  # the
        # persistent decode batch
        self._aranged = self._aranged32 = torch.arange(0, device=device)
        self._aranged_n, self._aranged_pair = -1, (self._aranged, self._aranged32)
        self._rows_views: tuple | None = None  # (key, host views, tables): _host_views
        self.serves_lora = False  # the model has LoRA slots: each batch says each row's slot

    def prepare(self, output: SchedulerOutput) -> ModelInput:
        """The flat batch of a step: its decodes first, the persistent :class:`DecodeRows`
        moved on by the step's diff (synced when its decodes changed, the blocks they entered
        added), then its chunks, built for the step. A step of decodes alone is the rows'
        arrays as they stand."""
        rows = self.rows
        if output.decodes or len(rows):
            if output.decodes_version < 0 or rows.version != output.decodes_version:
                rows.sync(output.decodes, output.decodes_version)
            rows.blocks_added(output.grown, output.new_blocks)
        if not output.chunks:
            return self.prepare_rows()
        return self.prepare_chunks(list(map(_chunk, output.chunks)), rows)

    def prepare_rows(self) -> ModelInput:
        """The batch of the decode rows as they stand: one token per row (its last), every
        row sampled. On the CPU its tensors are views of the rows' arrays, which the next
        step moves on in place: a batch holds for its own step only. Elsewhere one host ->
        device copy of tokens, positions and slots."""
        rows, n = self.rows, len(self.rows)
        if self.device.type == "cpu":
            (input_ids, positions, slots), tables = self._host_views(rows)
            # a new tensor object every step: the attention plan is cached per object
            context_lens = torch.from_numpy(rows.context_lens)
        else:  # one copy to the device, then the int32 lengths there
            host = torch.from_numpy(rows.host).to(self.device)
            tables = rows.tables_tensor[:, :rows.max_blocks].to(self.device)
            context_lens = host[1].to(torch.int32).add_(1)
            input_ids, positions, slots = host.unbind(0)
        sample_rows, cu_seqlens = self._arange(n)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu_seqlens,
                                 context_lens=context_lens, block_tables=tables,
                                 max_query_len=1, max_context_len=rows.max_context_len,
                                 backend=self.backend,
                                 lora=self._lora_batch(_row_slots(rows)) if self.serves_lora
                                 else None)
        return ModelInput(input_ids=input_ids, positions=positions, metadata=meta,
                          sample_indices=sample_rows, num_attended=rows.num_context,
                          num_context=rows.num_context)

    def _host_views(self, rows: DecodeRows) -> tuple[tuple, torch.Tensor]:
        """((tokens, positions, slots), block tables) as tensors over the rows' arrays, made
        again only when the rows replace an array (a sync, a drop, wider tables) or use more
        table columns; the views hold the arrays, so their ids are not reused meanwhile."""
        key = (id(rows.state), id(rows.tables), rows.max_blocks)
        if self._rows_views is None or self._rows_views[0] != key:
            self._rows_views = (key, torch.from_numpy(rows.host).unbind(0),
                                rows.tables_tensor[:, :rows.max_blocks])
        return self._rows_views[1], self._rows_views[2]

    def _arange(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(0..n-1 int64, 0..n int32) on the device, cut from cached tensors (the last pair
        is kept: steps of one batch size reuse it)."""
        if self._aranged_n != n:
            if self._aranged.numel() < n + 1:
                size = max(n + 1, 2 * self._aranged.numel())
                self._aranged = torch.arange(size, device=self.device)
                self._aranged32 = self._aranged.to(torch.int32)
            self._aranged_n, self._aranged_pair = n, (self._aranged[:n], self._aranged32[:n + 1])
        return self._aranged_pair

    def prepare_chunks(self, chunks: list[Chunk], rows: DecodeRows | None = None) -> ModelInput:
        """The flat batch of ``rows`` (one token each, every one sampled), then ``chunks``
        (a speculative draft model prepares its own with it), built in numpy on the host,
        then one tensor per array (copied when not on the CPU)."""
        bs = self.block_size
        r = 0 if rows is None else len(rows)  # the rows come first
        n = r + len(chunks)
        q_lens = np.ones(n, np.int64)
        q_lens[r:] = np.fromiter(map(len, map(_TOKEN_IDS, chunks)), np.int64, len(chunks))
        starts = np.fromiter(map(_START, chunks), np.int64, len(chunks))
        ends = np.cumsum(q_lens)  # one past each sequence's last token in the flat batch
        input_ids = np.fromiter(chain.from_iterable(map(_TOKEN_IDS, chunks)), np.int64,
                                int(ends[-1]) - r)
        # each chunk token's position: its row in the flat batch, shifted per sequence
        positions = np.arange(r, r + len(input_ids)) - np.repeat(
            ends[r:] - q_lens[r:] - starts, q_lens[r:])
        width = max([len(c.block_table) for c in chunks] + [0 if rows is None else
                                                             rows.max_blocks])
        tables = np.zeros((n, max(width, 1)), np.int32)
        for row, chunk in enumerate(chunks, r):
            tables[row, :len(chunk.block_table)] = [0 if b is None else b
                                                    for b in chunk.block_table]
        slots = (tables[np.repeat(np.arange(r, n), q_lens[r:]), positions // bs]
                 .astype(np.int64) * bs + positions % bs)
        sampled = np.ones(n, np.int64)
        sampled[r:] = np.fromiter(map(_NUM_SAMPLED, chunks), np.int64, len(chunks))
        if rows is not None and r:  # the rows' tokens, positions, slots, tables go first
            row_tokens, row_positions, row_slots = rows.host
            input_ids = np.concatenate([row_tokens, input_ids])
            positions = np.concatenate([row_positions, positions])
            slots = np.concatenate([row_slots, slots])
            tables[:r, :rows.max_blocks] = rows.tables[:, :rows.max_blocks]
            starts = np.concatenate([row_positions, starts])
        # the last num_sampled rows of each sequence
        sample_indices = (np.arange(int(sampled.sum()))
                          + np.repeat(ends - sampled - (np.cumsum(sampled) - sampled), sampled))
        scored = np.fromiter(map(_NUM_SCORED, chunks), np.int64, len(chunks))
        num_scored, logit_order = int(scored.sum()), None
        if num_scored:  # each scoring chunk's first rows: the model takes them in row order,
            firsts = np.repeat(ends[r:] - q_lens[r:], scored)  # the logits put them last
            wanted = np.concatenate([sample_indices, firsts + np.arange(num_scored)
                                     - np.repeat(np.cumsum(scored) - scored, scored)])
            order = np.argsort(wanted, kind="stable")
            sample_indices, logit_order = wanted[order], np.empty_like(order)
            logit_order[order] = np.arange(len(order))  # (the inverse permutation)
        context_lens = (starts + q_lens).astype(np.int32)
        cu = np.zeros(n + 1, np.int32)
        cu[1:] = ends
        dev = self.device
        lora = None
        if self.serves_lora:
            seq_slots = np.fromiter((c.lora_slot for c in chunks), np.int64, len(chunks))
            if r:
                seq_slots = np.concatenate([_row_slots(rows), seq_slots])
            lora = self._lora_batch(np.repeat(seq_slots, q_lens))
        meta = AttentionMetadata(
            slot_mapping=_on(slots, dev), cu_seqlens_q=_on(cu, dev),
            context_lens=_on(context_lens, dev), block_tables=_on(tables, dev),
            max_query_len=int(q_lens.max()), max_context_len=int(context_lens.max()),
            backend=self.backend, lora=lora)
        return ModelInput(
            input_ids=_on(input_ids, dev), positions=_on(positions, dev), metadata=meta,
            sample_indices=_on(sample_indices, dev), num_scored=num_scored,
            logit_order=None if logit_order is None else _on(logit_order, dev),
            num_attended=attended_pairs(starts.tolist(), q_lens.tolist()),
            num_context=int(starts.sum()) + len(input_ids))

    def _lora_batch(self, token_slots: np.ndarray) -> LoraBatch | None:
        """Each row's LoRA slot for the step (None when every row runs the base model)."""
        if not (token_slots >= 0).any():
            return None
        return LoraBatch.of(_on(token_slots, self.device))

    def close(self) -> None:
        """Release what the runner holds beyond its tensors (nothing on one rank)."""

    @torch.inference_mode()
    def run(self, batch: ModelInput,
            after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The model forward and logits of a prepared batch (timed into ``meter`` when set; on
        CUDA that waits for the step, which sampling does next anyway)."""
        start = time.perf_counter()
        if (self.graphs is not None and after_layer is None and not batch.num_scored
                and batch.metadata.lora is None
                and len(batch.sample_indices) == len(batch.input_ids)
                and self.graphs.fits(batch.input_ids, batch.metadata)):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.metadata)
        else:
            # (num_sampled, hidden): the rows that end a sequence's tokens
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches,
                                batch.metadata, after_layer=after_layer,
                                rows=batch.sample_indices)
            if batch.logit_order is not None:
                hidden = hidden[batch.logit_order]
            logits = self.model.compute_logits(hidden)
        if self.meter is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.meter.record(len(batch.input_ids), batch.num_attended, batch.num_context,
                              len(batch.sample_indices), time.perf_counter() - start)
        return logits
