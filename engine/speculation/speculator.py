"""Speculative decoding on decode and colocated workers: propose k tokens cheaply, verify them in
one target forward, keep the longest prefix the target agrees with.

Configuration (vLLM's keys, validated in engine/speculative_config.py):
``EngineConfig.speculative_config`` / ``LLM(..., speculative_config=...)`` /
``pdserve serve --speculative-config JSON``::

    {"method": "draft_model", "model": DIR, "num_speculative_tokens": K}
    {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}

A step with speculation (:meth:`LLMEngine.step` drives it):

1. ``schedule()``: a running decode gets its one token plus ``num_lookahead`` draft slots
   (:meth:`Speculator.num_lookahead`: at most K, never past ``max_tokens`` or the context, only
   from free blocks and the token budget: drafts never preempt anything). Prefill chunks and
   sequences with no room get none and run as before in the same batch.
2. :meth:`Speculator.propose` fills ``item.draft_token_ids`` (at most ``num_lookahead``).
3. The runner appends the drafts after each sequence's new token and returns logits at every
   one of its k + 1 positions; one target forward verifies every speculating sequence of the
   mixed batch (the paged attention kernels take several query tokens per sequence).
4. :meth:`Speculator.verify` verifies (:mod:`pdserve.engine.sampling.rejection_sampler`) and
   returns the accepted tokens as data; the engine's output stage appends them one by one
   (stopping at the first that finishes the request); then :meth:`Speculator.roll_back_each`
   rolls back: ``num_computed_tokens`` covers only the
   tokens whose KV is valid (the accepted drafts) and the blocks past the sequence's tokens are
   freed (``BlockManager.trim``).

Proposers. :class:`NgramProposer` (prompt lookup): the most recent earlier occurrence of the
last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) proposes the tokens
that followed it; its q is one-hot. :class:`DraftModelProposer`: a small model of the same
vocabulary, loaded with the same loader, with its own KV pool of the SAME number of blocks and
block size as the target's, so the target's block tables index it directly and the target's
block manager allocates for both.

Draft KV (the choice): the draft computes its KV lazily, from the sequence's token ids, the
first time a sequence speculates and then catches up whatever it lacks at each proposal
(``Sequence.num_draft_computed_tokens`` tracks it; preemption resets it). One mechanism serves
every mode: on a decode worker the KV transferred is the target's only, and nothing about the
draft crosses the wire; offline and colocated the draft's prompt pass happens on the first
decode step instead of beside the target's prefill chunks (the same tokens, in chunks of at most
``max_num_batched_tokens``). With a sliding window, blocks the window already freed are skipped
(the draft starts at the oldest block still held): its proposals there are approximations, which
can cost acceptance but never correctness, since only the target decides what is emitted.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.capacity.memory import allocate_kv_caches
from pdserve.engine.sampling.rejection_sampler import (
    DRAFT_STREAM,
    DraftedRows,
    process_rows,
    stream_uniform,
    verify,
)
from pdserve.engine.sampling.sampler import SamplingRow, inverse_cdf_draw, is_penalized
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative_config import SpeculativeConfig
from pdserve.engine.step.model_runner import Chunk, ModelRunner
from pdserve.models import load_model
from pdserve.models.checkpoint import open_checkpoint
from pdserve.worker_api.sampling_params import GREEDY_TEMPERATURE

logger = logging.getLogger(__name__)

@dataclass
class SpecDecodeStats:
    """Counters since the engine started (the names of vLLM's metrics)."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0  # drafts the target accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0 before any)."""
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculating step: accepted drafts + the target's own token."""
        return (self.num_accepted_tokens + self.num_drafts) / max(1, self.num_drafts)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


def drafted_rows(seq: Sequence, drafts: list[int], num_rows: int) -> list[SamplingRow]:
    """Sampling rows at output positions P .. P + num_rows - 1, row j's history extended by
    ``drafts[:j]`` (only when a penalty reads it)."""
    p, position = seq.sampling_params, seq.num_output_tokens
    if not is_penalized(p):
        return [SamplingRow(p, seq.seed, position + j, [], []) for j in range(num_rows)]
    prompt, output = seq.prompt_token_ids, seq.output_token_ids
    return [SamplingRow(p, seq.seed, position + j, prompt, output + drafts[:j])
            for j in range(num_rows)]


# -- proposers ----------------------------------------------------------------------------------

class NgramProposer:
    """Prompt lookup (see the module docstring); stateless but for a one-step memo."""

    def __init__(self, config: SpeculativeConfig):
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min
        self._memo: dict[str, tuple[int, list[int]]] = {}  # request_id -> (num_tokens, drafts)

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        """``limit`` tokens predicted from the most recent earlier occurrence of the longest
        suffix (n_max .. n_min tokens) that occurred before: the tokens that followed it, and
        past the end of the sequence the same span again (the text from the occurrence to now
        taken as a cycle, so a loop of one or two tokens still yields ``limit`` drafts; vLLM
        stops at the end)."""
        arr = np.asarray(token_ids)
        length = len(arr)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            # windows starting at 0 .. length - 1 - n: each is followed by a token
            windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
            hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                period = length - start  # >= 1: windows end before the last token
                return [int(arr[start + j % period]) for j in range(limit)]
        return []

    def max_drafts(self, seq: Sequence, limit: int) -> int:
        drafts = self.lookup(seq.token_ids, limit)
        self._memo[seq.request_id] = (seq.num_tokens, drafts)
        return len(drafts)

    def propose(self, seqs: list[Sequence], limits: list[int]):
        out = []
        for seq, limit in zip(seqs, limits, strict=True):
            num_tokens, drafts = self._memo.pop(seq.request_id, (-1, []))
            if num_tokens != seq.num_tokens:
                drafts = self.lookup(seq.token_ids, limit)
            out.append((drafts[:limit], None))
        self._memo.clear()
        return out


class DraftModelProposer:
    """A small draft model over its own KV pool indexed by the target's block tables."""

    def __init__(self, runner: ModelRunner, max_chunk_tokens: int):
        self.runner = runner  # the draft model over its own KV pool (no meter, no graphs)
        self.block_size = runner.block_size
        self.max_chunk_tokens = max_chunk_tokens  # catch-up forwards are at most this long

    @classmethod
    def build(cls, config: SpeculativeConfig, parts) -> DraftModelProposer:
        runner = parts.runner
        dtype = next(runner.model.parameters()).dtype
        mc = open_checkpoint(config.model).model_config
        model = load_model(config.model, dtype=dtype, device=runner.device)
        caches = allocate_kv_caches(mc, parts.ledger, [dtype] * mc.num_hidden_layers,
                                    runner.device)
        logger.info("draft model %s: %d layers, %d KV blocks beside the target's", config.model,
                    mc.num_hidden_layers, parts.ledger.num_kv_blocks)
        return cls(ModelRunner(model, caches, parts.config.block_size, runner.device,
                               runner.backend), parts.config.max_num_batched_tokens)

    def max_drafts(self, seq: Sequence, limit: int) -> int:
        return limit

    def _start(self, seq: Sequence) -> int:
        """First position whose draft KV is missing (the oldest block still held, at least)."""
        table = seq.block_table
        first = next((i for i, b in enumerate(table) if b is not None), len(table))
        return max(min(seq.num_draft_computed_tokens, seq.num_computed_tokens),
                   first * self.block_size)

    def propose(self, seqs: list[Sequence], limits: list[int]):
        """Up to ``limits[i]`` drafts per sequence and their processed weights (None for
        greedy requests: q one-hot). k forwards: the first also catches the draft's KV up."""
        starts = [self._start(seq) for seq in seqs]
        for i, seq in enumerate(seqs):  # long catch-ups (first speculation) in bounded chunks
            while seq.num_tokens - starts[i] > self.max_chunk_tokens:
                end = starts[i] + self.max_chunk_tokens
                self._forward([Chunk(seq.token_ids[starts[i]:end], starts[i], seq.block_table)],
                              with_logits=False)
                starts[i] = end
        drafts: list[list[int]] = [[] for _ in seqs]
        weights: list[list[torch.Tensor]] = [[] for _ in seqs]
        chunks = [Chunk(seq.token_ids[s:], s, seq.block_table)
                  for seq, s in zip(seqs, starts, strict=True)]
        active = list(range(len(seqs)))
        for j in range(max(limits)):
            logits = self._forward(chunks, with_logits=True)  # (len(active), vocab)
            rows = [drafted_rows(seqs[i], drafts[i], j + 1)[j] for i in active]
            _, w = process_rows(logits, rows)
            u = torch.tensor([stream_uniform(r.seed, r.position, DRAFT_STREAM) for r in rows],
                             dtype=torch.float64, device=w.device)
            tokens = inverse_cdf_draw(w, u).tolist()
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                weights[i].append(w[row])
            active = [i for i in active if len(drafts[i]) < limits[i]]
            chunks = [Chunk([drafts[i][-1]], seqs[i].num_tokens + j, seqs[i].block_table)
                      for i in active]
        for seq, k in zip(seqs, limits, strict=True):
            seq.num_draft_computed_tokens = seq.num_tokens + k - 1  # d_k itself never ran
        return [(d, None if seq.sampling_params.temperature < GREEDY_TEMPERATURE
                 else torch.stack(w)) for seq, d, w in zip(seqs, drafts, weights, strict=True)]

    def _forward(self, chunks: list[Chunk], with_logits: bool) -> torch.Tensor | None:
        """One draft forward over ``chunks``; logits (fp32) of each chunk's last token."""
        for chunk in chunks:
            chunk.num_sampled = 1 if with_logits else 0
        logits = self.runner.run(self.runner.prepare_chunks(chunks))
        return logits if with_logits else None


class Speculator:
    """What speculation adds to one engine: lookahead sizes, proposals, verification, rollback."""

    def __init__(self, config: SpeculativeConfig, proposer, block_manager, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self._draft_weights: dict[int, torch.Tensor | None] = {}  # id(item) -> q, this step

    @classmethod
    def build(cls, parts) -> Speculator | None:
        """None when ``parts.config.speculative_config`` is unset."""
        if parts.config.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(parts.config.speculative_config, parts.model_config,
                                             parts.max_model_len)
        proposer = (NgramProposer(config) if config.method == "ngram"
                    else DraftModelProposer.build(config, parts))
        return cls(config, proposer, parts.block_manager, parts.max_model_len)

    def num_lookahead(self, seq: Sequence) -> int:
        """Draft slots the scheduler may give decode ``seq``: K, cut so that k + 1 emitted
        tokens stay within ``max_tokens`` and the context (and, for n-grams, to the match)."""
        limit = min(self.config.num_speculative_tokens,
                    seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
        return self.proposer.max_drafts(seq, limit) if limit > 0 else 0

    def propose(self, scheduled) -> None:
        """Fill ``draft_token_ids`` of the items the scheduler gave draft slots."""
        items = [item for item in scheduled if item.num_lookahead > 0]
        if not items:
            return
        proposals = self.proposer.propose([item.seq for item in items],
                                          [item.num_lookahead for item in items])
        for item, (drafts, weights) in zip(items, proposals, strict=True):
            if drafts:
                item.draft_token_ids = drafts
                self._draft_weights[id(item)] = weights

    def drafted(self, sampling) -> bool:
        """Whether any item of ``sampling`` has drafts to verify this step."""
        return bool(self._draft_weights) and any(item.draft_token_ids for item in sampling)

    def verify(self, sampling, logits: torch.Tensor, draw) -> tuple[list, list, dict]:
        """The tokens of ``sampling`` from ``logits`` (one row per plain item, k + 1 per
        speculating one), as (token_ids, logprobs, faults) with a list of tokens per item: a
        plain item's one token drawn by ``draw(logits, seqs)`` (the engine's), a speculating
        one's accepted drafts and the target's own token (:func:`verify`). Data only: the
        output stage appends them, then :meth:`roll_back_each` frees what was rejected."""
        plain, plain_rows, spec, spec_rows = [], [], [], []
        row = 0
        for i, item in enumerate(sampling):
            n = 1 + len(item.draft_token_ids)
            (spec if item.draft_token_ids else plain).append(i)
            (spec_rows if item.draft_token_ids else plain_rows).extend(range(row, row + n))
            row += n
        token_ids: list = [None] * len(sampling)
        logprobs: list = [None] * len(sampling)
        faults: dict[int, Exception] = {}
        drafted = [DraftedRows(drafted_rows(sampling[i].seq, list(sampling[i].draft_token_ids),
                                            1 + len(sampling[i].draft_token_ids)),
                               list(sampling[i].draft_token_ids),
                               self._draft_weights.pop(id(sampling[i]))) for i in spec]
        self._draft_weights.clear()
        for i, v in zip(spec, verify(logits[spec_rows], drafted), strict=True):
            token_ids[i], logprobs[i] = v.token_ids, v.logprobs
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(sampling[i].draft_token_ids)
            self.stats.num_accepted_tokens += v.num_accepted
        if plain:
            drawn, entries, failed = draw(logits[plain_rows], [sampling[i].seq for i in plain])
            for k, i in enumerate(plain):
                token_ids[i] = [drawn[k]]
                logprobs[i] = None if entries[k] is None else [entries[k]]
                if k in failed:
                    faults[i] = failed[k]
        return token_ids, logprobs, faults

    def roll_back_each(self, sampling) -> None:
        """After the output stage: each speculating sequence still running is rolled back to
        the tokens whose KV is valid (:meth:`roll_back`)."""
        for item in sampling:
            if item.draft_token_ids and not item.seq.is_finished:
                self.roll_back(item.seq)

    def roll_back(self, seq: Sequence) -> None:
        """After appending: the accepted drafts' KV is valid, the last token's is not computed
        yet; blocks past the sequence's tokens (rejected slots) go back to the pool."""
        bm = self.block_manager
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens,
                                            seq.num_computed_tokens)
        bm.cache_computed_blocks(seq)
        bm.free_out_of_window(seq)
        bm.trim(seq, seq.num_tokens)
