"""Turns a batch of logits into one token per sequence: penalties, temperature, filters, draw.

Semantics, applied per row in this order (Hugging Face / vLLM / OpenAI conventions):

1. ``repetition_penalty`` (HF ``RepetitionPenaltyLogitsProcessor``): for every token id that
   occurs in prompt + output (how often does not matter), ``logit < 0 -> logit * penalty`` else
   ``logit / penalty``.
2. ``frequency_penalty`` / ``presence_penalty`` (OpenAI, vLLM): on output tokens only,
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
3. ``logit_bias`` (OpenAI): ``logit[token_id] += bias`` for the row's entries; rows without
   one are not touched (a batch with no biased row pays nothing).
4. Greedy rows (``temperature < 1e-5``, i.e. 0): ``token = argmax(logits)`` over the penalized,
   biased logits, first index on ties. With no penalty or bias set the row is never modified,
   so the token is exactly ``torch.argmax`` of the raw logits (the engine relies on this to
   match HF).
5. Other rows: ``logits / temperature``, softmax, then the filters, each keeping a top set of
   tokens (always at least the most likely one; tokens tied with a threshold are all kept):
   - top-k (0 = off, >= vocab = off): keep the k most likely tokens;
   - top-p (1 = off): on the distribution renormalized after top-k, keep a token if the mass of
     the tokens strictly more likely than it is < top_p (the smallest top set with mass >= top_p,
     HF ``TopPLogitsWarper``);
   - min-p (0 = off): keep tokens with ``p >= min_p * p_max`` (a ratio, so renormalizing first
     changes nothing). The order top-k, top-p, min-p is Hugging Face's.
6. The draw is an inverse-CDF draw from the filtered distribution with ONE uniform per row,
   ``u = draw_uniform(seed, position)``, a splitmix64 hash of the request's seed and the
   output position (``engine.sampling.seeded_uniforms``; ``keyed_uniforms`` makes a batch's): the
   token is the first whose cumulative probability (in token id order) exceeds ``u``. It
   depends only on (seed, position, the row's logits): not on the other rows, the row
   index or which process samples it (the prefill worker draws position 0, the decode worker the
   rest, possibly another one after failover). The CDF is summed in two levels (float64 over
   128-token block sums, then within the chosen block), so tokens of probability 0 (filtered)
   are never drawn and the rest are drawn with their float32 softmax probability.

Logprobs (``params.logprobs = n``): ``log_softmax`` of the logits after penalties and temperature
(temperature 1 for greedy rows) and BEFORE ``logit_bias`` and top-k / top-p / min-p filtering:
the n most likely tokens plus the sampled one. Leaving the bias out is vLLM's default (its
logprobs are the model's, not the biased ones), so a biased token's reported logprob is what
the model gave it.

Cost: no Python loop over rows once their parameters are arrays (a :class:`SamplingBatch`,
which the persistent decode rows keep across steps); the filters (``engine.sampling.filters``)
are thresholds per row on ``exp(logit - max)``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.sampling.filters import (
    CDF_BLOCK,
    block_sums,
    filter_weights,
    numpy_viewable,
    softmax_weights,
)
from pdserve.engine.sampling.seeded_uniforms import keyed_uniforms, seed_key
from pdserve.engine.sequence import Sequence
from pdserve.worker_api.sampling_params import GREEDY_TEMPERATURE, SamplingParams

logger = logging.getLogger(__name__)



@dataclass
class SamplingRow:
    """What the sampler needs about one sequence being sampled."""

    params: SamplingParams  # the request's sampling parameters
    seed: int  # the request's random stream key
    position: int  # output position of the token being sampled (0 = first generated token)
    prompt_token_ids: list[int]  # for the repetition penalty
    output_token_ids: list[int]  # tokens generated so far, for all penalties


def sampling_row(seq: Sequence) -> SamplingRow:
    """What the sampler needs of ``seq``; token history only when a penalty reads it."""
    p = seq.sampling_params
    penalized = is_penalized(p)
    return SamplingRow(p, seq.seed, seq.num_output_tokens,
                       seq.prompt_token_ids if penalized else [],
                       seq.output_token_ids if penalized else [])


@dataclass
class SamplerOutput:
    """One sampled token per row, in the order of the rows."""

    token_ids: list[int]  # the sampled token of each row
    logprobs: list[dict[int, float] | None]  # per row: {token_id: logprob}, None if not requested


def _flat_ids(rows: list[int], id_lists: list[list[int]], vocab: int, device,
              field: str) -> torch.Tensor:
    """Flat indices ``row * vocab + token_id`` into a (num_rows, vocab) tensor, all lists joined."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    flat = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise ValueError(f"{field} must be token ids in [0, {vocab})")
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    return (row_of * vocab + flat).to(device)


def logit_bias_of(params: list[SamplingParams]) -> list[tuple[int, dict[int, float]]] | None:
    """``(row, logit_bias)`` of the rows of ``params`` that have a bias; None when none has."""
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias is not None]
    return biased or None


@contextlib.contextmanager
def logit_bias_added(logits: torch.Tensor,
                     biases: list[tuple[int, dict[int, float]]] | None) -> Iterator[None]:
    """Within the block, ``logits`` (num_rows, vocab) hold ``biases`` (``(row, {token_id:
    bias})``) added in place; after it, the entries it wrote hold their own values again
    (restored, not subtracted: exact). Sparse, as the penalties: only the biased entries are
    read and written, so a biased row costs its entries, not a copy of the logits."""
    if biases is None:
        yield
        return
    rows = [row for row, _ in biases]
    flat = _flat_ids(rows, [list(bias) for _, bias in biases], logits.shape[1], logits.device,
                     "logit_bias")
    values = torch.tensor([v for _, bias in biases for v in bias.values()], dtype=logits.dtype,
                          device=logits.device)
    entries = logits.view(-1)  # (num_rows * vocab,)
    own = entries[flat]  # (a copy: the values to restore)
    with torch.inference_mode():  # (the model's logits are inference tensors)
        entries.index_add_(0, flat, values)  # (a row's ids are a dict's keys: no repeats)
    try:
        yield
    finally:
        with torch.inference_mode():
            entries[flat] = own


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns a new (num_rows, vocab) tensor.

    Sparse: only the (row, token) entries that occur are read and written, so the cost is the
    number of prompt + output ids, not num_rows * vocab.
    """
    vocab = logits.shape[1]
    dev = logits.device
    out = logits.clone()
    flat_out = out.view(-1)  # (num_rows * vocab,)
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        ids = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep]
        flat = _flat_ids(rep, ids, vocab, dev, "prompt_token_ids/output_token_ids")
        penalty = torch.ones(len(rows), dtype=logits.dtype, device=dev)
        penalty[rep] = torch.tensor([rows[i].params.repetition_penalty for i in rep],
                                    dtype=logits.dtype, device=dev)
        values, factor = flat_out[flat], penalty[flat // vocab]
        flat_out[flat] = torch.where(values < 0, values * factor, values / factor)  # repeats agree
    freq = [i for i, r in enumerate(rows)
            if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if freq:
        flat = _flat_ids(freq, [rows[i].output_token_ids for i in freq], vocab, dev,
                         "output_token_ids")
        seen, counts = torch.unique(flat, return_counts=True)
        fp = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype,
                          device=dev)
        pp = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype,
                          device=dev)
        row_of = seen // vocab
        flat_out.index_add_(0, seen, -(fp[row_of] * counts.to(logits.dtype) + pp[row_of]))
    return out


def inverse_cdf_draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(rows,) token ids drawn by inverse CDF from nonnegative weights, one uniform per row."""
    vocab = weights.shape[1]
    block_mass = block_sums(weights).to(torch.float64)  # (rows, num_blocks)
    block_cdf = torch.cumsum(block_mass, dim=1)
    # strictly below the total, so the chosen block has mass > 0
    target = uniforms.to(torch.float64) * block_cdf[:, -1] * (1.0 - 1e-12)
    block = torch.searchsorted(block_cdf, target[:, None], right=True)  # (rows, 1)
    block = block.clamp_(max=block_cdf.shape[1] - 1)
    rest = target[:, None] - (block_cdf - block_mass).gather(1, block)  # mass before it
    start = block * CDF_BLOCK
    index = start + _block_offsets(weights.device)  # (rows, block)
    if vocab % CDF_BLOCK:  # the last block runs past the vocabulary: 0 there
        in_block = weights.gather(1, index.clamp(max=vocab - 1)) * (index < vocab)
    else:
        in_block = weights.gather(1, index)
    inner_cdf = torch.cumsum(in_block.to(torch.float64), dim=1)
    # keep the target strictly inside this block's mass so a zero-weight tail is unreachable
    rest = torch.minimum(rest.clamp_(min=0.0), inner_cdf[:, -1:] * (1.0 - 1e-12))
    offset = torch.searchsorted(inner_cdf, rest, right=True).clamp_(max=CDF_BLOCK - 1)
    return (start + offset).squeeze(1)


@functools.cache
def _block_offsets(device: torch.device) -> torch.Tensor:
    return torch.arange(CDF_BLOCK, device=device)


def _gather_logprobs(processed: torch.Tensor, token_ids: torch.Tensor,
                     counts: list[int]) -> list[dict[int, float]]:
    """Top-``counts[i]`` log-probabilities of each row plus the sampled token's."""
    logprobs = torch.log_softmax(processed, dim=1)
    num_top = min(max(counts), logprobs.shape[1])
    top = torch.topk(logprobs, num_top)  # (rows, num_top), possibly empty
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    rows = zip(counts, top.indices.tolist(), top.values.tolist(), token_ids.tolist(), sampled,
               strict=True)
    out = []
    for n, ids, values, token, value in rows:
        entry = dict(zip(ids[:n], values[:n], strict=True))
        entry[token] = value
        out.append(entry)
    return out


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first maximum of each row, as ``logits.argmax(dim=1).tolist()``."""
    return greedy_token_array(logits).tolist()


def greedy_token_array(logits: torch.Tensor) -> np.ndarray:
    """:func:`greedy_tokens` as an int64 array. On CPU it is numpy's argmax over the same
    memory (a SIMD scan, faster than torch's reduction; ties and NaN pick the first index,
    as torch does)."""
    if numpy_viewable(logits):
        return logits.detach().numpy().argmax(axis=1)
    return logits.max(dim=1).indices.cpu().numpy()


def is_penalized(p: SamplingParams) -> bool:
    """A penalty is set: the row's logits depend on its token history."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def takes_argmax(p: SamplingParams) -> bool:
    """Greedy with no penalty, no bias and no logprobs: the token is exactly the row's argmax."""
    return (p.temperature < GREEDY_TEMPERATURE and p.logprobs is None
            and not is_penalized(p) and p.logit_bias is None)


_FLOATS, _FLOAT_BITS = struct.Struct("<3d"), struct.Struct("<3q")


@dataclass
class SamplingBatch:
    """The sampler's inputs as arrays, one entry per row: built from SamplingRows
    (:meth:`of`) or kept across steps by the persistent decode rows
    (``DecodeRows.sampling_batch``). The sampler only reads them."""

    floats: np.ndarray  # float64 (3, rows): temperature, top_p, min_p
    top_k: np.ndarray  # int64 (rows,): 0 = off
    logprobs: np.ndarray  # int64 (rows,): top log-probabilities wanted, -1 = none
    seed_keys: np.ndarray  # uint64 (rows,): each seed's first hash round (seed_key)
    positions: np.ndarray  # int64 (rows,): the output position each row samples
    penalized: list[SamplingRow] | None = None  # every row, when some row has a penalty
    biases: list[tuple[int, dict[int, float]]] | None = None  # (row, logit_bias); None: none

    NUM_COLUMNS = 6  # int64 values of one row in columns()

    def __len__(self) -> int:
        return len(self.top_k)

    @staticmethod
    def columns(seq: Sequence) -> tuple[int, ...]:
        """``seq``'s entries as :data:`NUM_COLUMNS` int64 values, kept by the persistent decode
        rows (:meth:`from_columns` reads them back): top-k, logprobs, the seed key's bits,
        then temperature, top-p and min-p as float64 bits."""
        p, key = seq.sampling_params, seed_key(seq.seed)
        return (p.top_k, -1 if p.logprobs is None else p.logprobs,
                key - (1 << 64) if key >> 63 else key,
                *_FLOAT_BITS.unpack(_FLOATS.pack(p.temperature, p.top_p, p.min_p)))

    @classmethod
    def from_columns(cls, columns: np.ndarray, positions: np.ndarray,
                     penalized: list[SamplingRow] | None,
                     biases: list[tuple[int, dict[int, float]]] | None = None) -> SamplingBatch:
        """The batch over (NUM_COLUMNS, rows) int64 ``columns`` (views, no copy)."""
        return cls(columns[3:6].view(np.float64), columns[0], columns[1],
                   columns[2].view(np.uint64), positions, penalized, biases)

    @classmethod
    def of(cls, rows: list[SamplingRow]) -> SamplingBatch:
        params = [r.params for r in rows]
        return cls(np.array([(p.temperature, p.top_p, p.min_p) for p in params],
                            np.float64).reshape(-1, 3).T,
                   np.array([p.top_k for p in params], np.int64),
                   np.array([-1 if p.logprobs is None else p.logprobs for p in params],
                            np.int64),
                   np.array([seed_key(r.seed) for r in rows], np.uint64),
                   np.array([r.position for r in rows], np.int64),
                   rows if any(map(is_penalized, params)) else None,
                   logit_bias_of(params))


def check_samplable(seq: Sequence) -> None:
    """ValueError unless ``seq``'s sampling parameters pack into the arrays a step samples with
    (both the per-step batch and the persistent rows' columns). Checked when a request
    arrives, so a value no array can hold fails that request, never a step."""
    try:
        np.array([SamplingBatch.columns(seq)], np.int64)
        SamplingBatch.of([sampling_row(seq)])
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"sampling_params cannot be packed for a step: {exc}") from exc


def sampled_weights(logits: torch.Tensor, batch: SamplingBatch,
                    index: np.ndarray | None = None) -> torch.Tensor:
    """(rows, vocab) the filtered, unnormalised softmax (max 1 per row) of the sampled rows of
    ``batch``: all of them (``index`` None) or ``index``; ``logits`` are already penalized."""
    dev = logits.device
    floats, top_k = batch.floats, batch.top_k
    if index is not None:
        floats, top_k = floats[:, index], top_k[index]
    temps, top_p, min_p = torch.from_numpy(floats.astype(np.float32)).to(dev)
    if index is None:
        scaled = logits / temps[:, None]  # (num_sampled, vocab), a fresh tensor
    else:
        scaled = logits.index_select(0, torch.from_numpy(index).to(dev)).div_(temps[:, None])
    weights = softmax_weights(scaled)
    uses_k, uses_p, uses_min_p = (top_k > 0).any(), (floats[1] < 1.0).any(), \
        (floats[2] > 0.0).any()
    if uses_k or uses_p or uses_min_p:  # (a filter no row uses is skipped)
        weights = filter_weights(weights, torch.from_numpy(top_k).to(dev) if uses_k else None,
                                 top_p if uses_p else None, min_p if uses_min_p else None)
    return weights


class Sampler:
    """Stateless: ``sampler(logits, rows)`` samples one token per row (see the module docstring);
    ``sampler.sample(logits, batch)`` the same from a :class:`SamplingBatch`."""

    @staticmethod
    def is_plain_greedy(params: list[SamplingParams]) -> bool:
        """Every row greedy with no penalty and no logprobs: the tokens are exactly
        ``logits.argmax(dim=1)`` and no :class:`SamplingRow` needs to be built."""
        return all(map(takes_argmax, params))

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be (num_rows={len(rows)}, vocab), "
                             f"got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput([], [])
        return self.sample(logits, SamplingBatch.of(rows))

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """One token per row of ``batch`` (its logits: ``logits``, (len(batch), vocab))."""
        logits = logits.float()
        if batch.penalized is not None:
            logits = apply_penalties(logits, batch.penalized)
        # the draw reads the biased logits; logprobs the unbiased ones (the module docstring)
        with logit_bias_added(logits, batch.biases):
            token_ids = self._tokens(logits, batch)
        return SamplerOutput(token_ids.tolist(), self._logprobs(logits, batch, token_ids))

    def _tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """(rows,) each row's token: the argmax of greedy rows, a draw for the others."""
        is_greedy = batch.floats[0] < GREEDY_TEMPERATURE
        if is_greedy.all():
            return logits.argmax(dim=1)
        if not is_greedy.any():
            return self._sample(logits, batch, None)
        dev = logits.device
        greedy = torch.from_numpy(np.flatnonzero(is_greedy)).to(dev)
        sampled = np.flatnonzero(~is_greedy)
        token_ids = torch.empty(len(batch), dtype=torch.int64, device=dev)
        token_ids[greedy] = logits[greedy].argmax(dim=1)
        token_ids[torch.from_numpy(sampled).to(dev)] = self._sample(logits, batch, sampled)
        return token_ids

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch,
                index: np.ndarray | None) -> torch.Tensor:
        """Draws of the sampled rows: all of them (``index`` None) or ``index``."""
        keys, positions = batch.seed_keys, batch.positions
        if index is not None:
            keys, positions = keys[index], positions[index]
        return inverse_cdf_draw(sampled_weights(logits, batch, index),
                                keyed_uniforms(keys, positions, logits.device))

    @staticmethod
    def _logprobs(logits: torch.Tensor, batch: SamplingBatch,
                  token_ids: torch.Tensor) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(batch)
        wanted = np.flatnonzero(batch.logprobs >= 0)
        if not len(wanted):
            return out
        temps = batch.floats[0, wanted]
        temps = torch.from_numpy(np.where(temps >= GREEDY_TEMPERATURE, temps, 1.0)
                                 .astype(np.float32)).to(logits.device)
        if len(wanted) < len(batch):  # (a copy of the rows: skipped when all want them)
            index = torch.from_numpy(wanted).to(logits.device)
            logits, token_ids = logits[index], token_ids[index]
        processed = logits / temps[:, None]  # (num_wanted, vocab)
        entries = _gather_logprobs(processed, token_ids, batch.logprobs[wanted].tolist())
        for i, entry in zip(wanted.tolist(), entries, strict=True):
            out[i] = entry
        return out
