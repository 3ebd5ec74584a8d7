"""Verification of speculative drafts: which proposed tokens a sequence keeps, and the token after.

For one speculating sequence the target computed logits at the k + 1 positions ``P .. P + k``
(``P`` = the output position of its next token) over its last token followed by the drafts
``d_1 .. d_k``; row ``j`` predicts the token at output position ``P + j``. Each row is processed
exactly as :mod:`pdserve.engine.sampling.sampler` processes a row (penalties with the token history
extended by the drafts before that position, temperature, top-k / top-p / min-p), giving the
target's distribution ``p_j``; the draft's ``q_j`` comes from the same processing of the draft
model's logits (``None``: one-hot at the draft, as for n-gram lookup).

Rule (Leviathan et al. / Chen et al. speculative sampling), per draft in order:

1. accept ``d_{j+1}`` when ``u_accept(P + j) < p_j(d) / q_j(d)`` (probability ``min(1, p/q)``);
2. at the first rejection draw the token from the normalised ``max(0, p_j - q_j)`` with
   ``u_residual(P + j)`` and stop;
3. when all k are accepted draw a bonus token from ``p_k`` with the plain sampler's uniform
   ``draw_uniform(seed, P + k)`` (so it is exactly the token plain sampling would draw there).

Every emitted token is then distributed exactly as the target's at its position, whatever the
draft proposed. Greedy rows (temperature 0) are the special case ``p_j`` = one-hot at the argmax
of the penalised logits (first index on ties, as the sampler): a draft is accepted iff it equals
the argmax, the residual and the bonus are the argmax, so the output is identical to
non-speculative greedy decoding token for token.

Uniforms are keyed by (seed, output position, stream): ``draw_uniform(seed ^ stream, position)``
with one constant per stream (accept test, residual draw, the draft's own draw); stream 0 is the
plain sampler's. So a seeded request's tokens depend only on its seed and the logits, never on
the batch it shares or the row it occupies.

Logprobs of each emitted token come from the target's processed logits at its position
(penalties and temperature, before the filters), as in the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.sampling.filters import block_sums
from pdserve.engine.sampling.sampler import (
    SamplingBatch,
    SamplingRow,
    _gather_logprobs,
    apply_penalties,
    inverse_cdf_draw,
    logit_bias_added,
    sampled_weights,
)
from pdserve.engine.sampling.seeded_uniforms import draw_uniform
from pdserve.worker_api.sampling_params import GREEDY_TEMPERATURE

ACCEPT_STREAM = 0x5EC0_0001_A11C_E5ED  # u of the accept test at a position
RESIDUAL_STREAM = 0x5EC0_0002_0E51_D0A1  # u of the draw from max(0, p - q)
DRAFT_STREAM = 0x5EC0_0003_D2AF_7ED0  # u of the draft model's own draw


def stream_uniform(seed: int, position: int, stream: int) -> float:
    """The uniform of ``stream`` at output ``position`` of the request keyed ``seed``."""
    return draw_uniform(seed ^ stream, position)


def process_rows(logits: torch.Tensor,
                 rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """(penalised logits, weights): the sampler's processing of every row (the logits before
    any ``logit_bias``, what logprobs report; the weights after it). ``weights`` are the
    filtered, unnormalised softmax (max 1 per row) of sampled rows, one-hot at the argmax of
    greedy rows; a draw from a row is ``inverse_cdf_draw(weights, u)``."""
    logits, batch, dev = logits.float(), SamplingBatch.of(rows), logits.device
    if batch.penalized is not None:
        logits = apply_penalties(logits, rows)
    weights = torch.zeros_like(logits)
    is_greedy = batch.floats[0] < GREEDY_TEMPERATURE
    greedy, sampled = np.flatnonzero(is_greedy), np.flatnonzero(~is_greedy)
    with logit_bias_added(logits, batch.biases):
        if len(greedy):
            index = torch.from_numpy(greedy).to(dev)
            weights[index, logits[index].argmax(dim=1)] = 1.0
        if len(sampled):
            weights[torch.from_numpy(sampled).to(dev)] = sampled_weights(logits, batch, sampled)
    return logits, weights


def normalized(weights: torch.Tensor) -> torch.Tensor:
    """Rows summing to 1 (fixed 128-token block sums, so a row's value is batch-independent)."""
    return weights / block_sums(weights).sum(dim=1, keepdim=True)


@dataclass
class DraftedRows:
    """One speculating sequence, as the verifier sees it."""

    rows: list[SamplingRow]  # k + 1 rows, positions P .. P + k, histories extended by drafts
    draft_token_ids: list[int]  # d_1 .. d_k
    draft_weights: torch.Tensor | None  # (k, vocab) the draft's processed weights (q before
    # normalising); None: q is one-hot at each draft (n-gram lookup, greedy draft)


@dataclass
class Verified:
    """What one speculating sequence emits this step."""

    token_ids: list[int]  # the accepted drafts, then the residual or bonus token
    num_accepted: int  # drafts accepted (len(token_ids) - 1)
    logprobs: list[dict[int, float] | None]  # per emitted token, None if not requested


def verify(logits: torch.Tensor, seqs: list[DraftedRows]) -> list[Verified]:
    """``logits``: (sum of k_i + 1, vocab), each sequence's k_i + 1 rows in order. See the module
    docstring for the rule."""
    rows = [r for s in seqs for r in s.rows]
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be ({len(rows)}, vocab), got {tuple(logits.shape)}")
    penalized, weights = process_rows(logits, rows)
    probs = normalized(weights)
    starts, draft_rows, draft_ids, q_of_draft, uniforms = [], [], [], [], []
    offset = 0
    for s in seqs:
        starts.append(offset)
        k = len(s.draft_token_ids)
        draft_rows.extend(range(offset, offset + k))
        draft_ids.extend(s.draft_token_ids)
        if s.draft_weights is None:
            q_of_draft.append(torch.ones(k, dtype=probs.dtype, device=probs.device))
        else:
            q = normalized(s.draft_weights.float())
            ids = torch.tensor(s.draft_token_ids, device=q.device)
            q_of_draft.append(q.gather(1, ids[:, None]).squeeze(1))
        uniforms.extend(stream_uniform(r.seed, r.position, ACCEPT_STREAM) for r in s.rows[:k])
        offset += k + 1
    dev = probs.device
    accepted = [False] * len(draft_rows)
    if draft_rows:
        p_d = probs[torch.tensor(draft_rows, device=dev),
                    torch.tensor(draft_ids, device=dev)].double()
        u = torch.tensor(uniforms, dtype=torch.float64, device=dev)
        accepted = (u * torch.cat(q_of_draft).double() < p_d).tolist()
    # one final draw per sequence: the residual at the first rejection, else the bonus
    final_weights, final_u, emitted_rows, counts = [], [], [], []
    i = 0
    for s, start in zip(seqs, starts, strict=True):
        k = len(s.draft_token_ids)
        a = next((j for j in range(k) if not accepted[i + j]), k)
        i += k
        row = start + a
        if a < k:
            q = (normalized(s.draft_weights.float())[a] if s.draft_weights is not None
                 else torch.nn.functional.one_hot(torch.tensor(s.draft_token_ids[a], device=dev),
                                                  probs.shape[1]).to(probs.dtype))
            residual = (probs[row] - q).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself
                residual = weights[row]
            final_weights.append(residual)
            final_u.append(stream_uniform(s.rows[a].seed, s.rows[a].position, RESIDUAL_STREAM))
        else:
            final_weights.append(weights[row])
            final_u.append(draw_uniform(s.rows[k].seed, s.rows[k].position))
        emitted_rows.append(list(range(start, row + 1)))
        counts.append(a)
    last = inverse_cdf_draw(torch.stack(final_weights),
                            torch.tensor(final_u, dtype=torch.float64, device=dev)).tolist()
    out = []
    for s, a, token in zip(seqs, counts, last, strict=True):
        out.append(Verified(list(s.draft_token_ids[:a]) + [token], a, [None] * (a + 1)))
    _add_logprobs(penalized, rows, emitted_rows, out)
    return out


def _add_logprobs(penalized: torch.Tensor, rows: list[SamplingRow],
                  emitted_rows: list[list[int]], out: list[Verified]) -> None:
    """Fill ``out[i].logprobs`` for the sequences that asked for them (one batched gather)."""
    wanted = [(v, j, r) for v, seq_rows in zip(out, emitted_rows, strict=True)
              if rows[seq_rows[0]].params.logprobs is not None
              for j, r in enumerate(seq_rows)]
    if not wanted:
        return
    index = [r for _, _, r in wanted]
    temps = [rows[r].params.temperature for r in index]
    temps = torch.tensor([1.0 if t < GREEDY_TEMPERATURE else t for t in temps],
                         dtype=penalized.dtype, device=penalized.device)
    processed = penalized[index] / temps[:, None]  # (num_wanted, vocab)
    tokens = torch.tensor([v.token_ids[j] for v, j, _ in wanted], device=penalized.device)
    entries = _gather_logprobs(processed, tokens, [rows[r].params.logprobs for r in index])
    for (v, j, _), entry in zip(wanted, entries, strict=True):
        v.logprobs[j] = entry
