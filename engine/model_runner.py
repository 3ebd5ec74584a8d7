"""Turns a scheduled batch into flat tensors, runs the model, returns logits to sample from.

Per step (no globals): the runner packs every scheduled sequence's new tokens into one flat
batch, builds one :class:`AttentionMetadata`, runs ``model.forward`` and keeps only the hidden
states of the sequences whose chunk reaches their last token (they get a new token).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.input_batch import DecodeRows
from pdserve.engine.roofline import UtilizationMeter, attended_pairs
from pdserve.engine.scheduler import ScheduledSequence
from pdserve.kernels import KVCacheLayer
from pdserve.models.attention import AttentionMetadata


@dataclass
class Chunk:
    """Tokens one sequence computes in a step, at positions ``start ..``, into the KV slots its
    block table maps them to; the rows of the last ``num_sampled`` tokens get logits."""

    token_ids: list[int]
    start: int
    block_table: list[int | None]
    num_sampled: int = 0


@dataclass
class ModelInput:
    """One step's flat batch."""

    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # (num_sampled,) int64: rows of the flat batch to sample from
    num_attended: int = 0  # (query, key) pairs the step's attention computes (causal)
    num_context: int = 0  # KV tokens the step reads: every sequence's context, new ones included


def host_tensor(values: array, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of an ``array`` of ints ("q": int64, "i": int32) on ``device``: the
    array's buffer becomes the tensor (3x faster than ``torch.tensor`` of a list), then one
    copy when ``device`` is not the CPU. The tensor keeps ``values`` alive: do not change it."""
    if not values:
        return torch.empty(0, dtype=_ARRAY_DTYPES[values.typecode], device=device)
    tensor = torch.frombuffer(values, dtype=_ARRAY_DTYPES[values.typecode])
    return tensor if device.type == "cpu" else tensor.to(device)


_ARRAY_DTYPES = {"q": torch.int64, "i": torch.int32}


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
        # a sliding window frees blocks in place (None entries): such models skip the fast path
        self.sliding_window = getattr(getattr(model, "config", None), "sliding_window", None)
        self.rows = DecodeRows(block_size, max_model_len)  # the persistent decode batch
        self._aranged = self._aranged32 = torch.arange(0, device=device)
        self._aranged_n, self._aranged_pair = -1, (self._aranged, self._aranged32)

    def prepare(self, scheduled: list[ScheduledSequence]) -> ModelInput:
        """The flat batch of ``scheduled``: a pure decode step syncs the persistent
        :class:`DecodeRows` and reads them; any other step is built from scratch."""
        # (a sequence with speculative drafts brings several tokens: the general path)
        if self.sliding_window is None and all(item.is_decode and not item.draft_token_ids
                                               for item in scheduled):
            self.rows.sync([item.seq for item in scheduled])
            return self.prepare_rows()
        self.rows.invalidate()
        return self._prepare_general(scheduled)

    def prepare_rows(self) -> ModelInput:
        """The batch of the decode rows as they stand: one token per row (its last), every
        row sampled; one host -> device copy of tokens, positions and slots."""
        rows, n = self.rows, len(self.rows)
        host = torch.from_numpy(rows.host)
        tables = rows.tables_tensor[:, :rows.max_blocks]
        if self.device.type == "cpu":  # int32 lengths straight from the host array
            context_lens = torch.from_numpy(rows.context_lens)
        else:  # one copy to the device, then the int32 lengths there
            host, tables = host.to(self.device), tables.to(self.device)
            context_lens = host[1].to(torch.int32).add_(1)
        input_ids, positions, slots = host.unbind(0)
        sample_rows, cu_seqlens = self._arange(n)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu_seqlens,
                                 context_lens=context_lens, block_tables=tables,
                                 max_query_len=1, max_context_len=rows.max_context_len,
                                 backend=self.backend)
        return ModelInput(input_ids=input_ids, positions=positions, metadata=meta,
                          sample_indices=sample_rows, num_attended=rows.num_context,
                          num_context=rows.num_context)

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

    def _prepare_general(self, scheduled: list[ScheduledSequence]) -> ModelInput:
        """Any step: each sequence's new tokens (then its drafts, when speculating); the rows
        of the last new token and of every draft are sampled."""
        chunks = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            drafts = item.draft_token_ids  # speculative decoding: verified after the new token
            chunks.append(Chunk([*seq.token_ids[start:start + item.num_new_tokens], *drafts],
                                start, seq.block_table,
                                1 + len(drafts) if item.samples else 0))
        return self.prepare_chunks(chunks)

    def prepare_chunks(self, chunks: list[Chunk]) -> ModelInput:
        """The flat batch of ``chunks`` (a speculative draft model prepares its own with it)."""
        input_ids: list[int] = []
        starts = [c.start for c in chunks]  # first position computed this step, per sequence
        q_lens = [len(c.token_ids) for c in chunks]
        tables = [[0 if b is None else b for b in c.block_table] for c in chunks]
        sample_indices: list[int] = []  # flat rows whose logits are returned, in order
        for c in chunks:
            input_ids.extend(c.token_ids)
            sample_indices.extend(range(len(input_ids) - c.num_sampled, len(input_ids)))
        dev, bs, cpu = self.device, self.block_size, torch.device("cpu")
        q_lens_t = host_tensor(array("q", q_lens), cpu)
        starts_t = host_tensor(array("q", starts), cpu)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
        # (num_tokens,): absolute position of each new token inside its sequence
        positions = starts_t[seq_of_token] + torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
        width = max(len(t) for t in tables)
        flat = array("q", [b for t in tables for b in (*t, *([0] * (width - len(t))))])
        block_tables = host_tensor(flat, cpu).view(len(tables), width)
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        context_lens = starts_t + q_lens_t
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            cu_seqlens_q=cu.to(dev, torch.int32),
            context_lens=context_lens.to(dev, torch.int32),
            block_tables=block_tables.to(dev, torch.int32),
            max_query_len=max(q_lens),
            max_context_len=int(context_lens.max()),
            backend=self.backend,
        )
        return ModelInput(
            input_ids=host_tensor(array("q", input_ids), dev),
            positions=positions.to(dev), metadata=meta,
            sample_indices=host_tensor(array("q", sample_indices), dev),
            num_attended=attended_pairs(starts, q_lens), num_context=sum(starts) + len(input_ids))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence],
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step; returns fp32 logits (num_sampled, vocab) in the order of ``scheduled``.
        ``after_layer(i)`` is called as soon as layer ``i``'s K/V are written."""
        return self.run(self.prepare(scheduled), after_layer)

    @torch.inference_mode()
    def run(self, batch: ModelInput,
            after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The model forward and logits of a prepared batch (timed into ``meter`` when set; on
        CUDA that waits for the step, which sampling does next anyway)."""
        start = time.perf_counter()
        if (self.graphs is not None and after_layer is None
                and len(batch.sample_indices) == len(batch.input_ids)
                and self.graphs.fits(batch.input_ids, batch.metadata)):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.metadata)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches,
                                batch.metadata, after_layer=after_layer)
            # (num_tokens, hidden) -> (num_sampled, hidden): rows that end a sequence's tokens
            logits = self.model.compute_logits(hidden.index_select(0, batch.sample_indices))
        if self.meter is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.meter.record(len(batch.input_ids), batch.num_attended, batch.num_context,
                              len(batch.sample_indices), time.perf_counter() - start)
        return logits
