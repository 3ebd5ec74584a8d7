"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the model's log-probability of each
prompt token given the tokens before it, with the top ones at each position, as vLLM's
``prompt_logprobs`` and OpenAI's ``echo`` + ``logprobs``.

The prefill computes them where it runs (a prefill worker, or a colocated or decode worker
that prefills itself): the runner gives logits to a chunk's rows at prompt positions too
(``ScheduledSequence.num_scored``: position p scores token p + 1), after the sampled rows,
and :func:`score_prompts` writes them into ``Sequence.prompt_logprobs`` by position, so a
prompt split into chunks is scored across them, and one computed again (preempted before
its first output) overwrites its own entries. The first output's delta carries the list.
A request that asks takes nothing from the prefix cache (a cached block's positions were
never scored); one that does not ask pays nothing: no extra rows, no extra logits.

The logprobs are the model's raw ``log_softmax`` (no temperature, penalty or bias: none
applies to a prompt token), in float32.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampling.sampler import _gather_logprobs
from pdserve.engine.step.scheduler_output import ScheduledSequence


def score_prompts(chunks: list[ScheduledSequence], logits: torch.Tensor) -> None:
    """Fill each scoring chunk's entries of its ``seq.prompt_logprobs`` from ``logits``, the
    chunks' scored rows in order (``num_scored`` each); run before the scheduler moves the
    chunks on (``start`` is the chunk's first position)."""
    scoring = [(item, item.num_scored) for item in chunks if item.num_scored]
    targets = [t for item, n in scoring
               for t in item.seq.token_ids[item.start + 1:item.start + 1 + n]]
    counts = [item.seq.sampling_params.prompt_logprobs for item, n in scoring for _ in range(n)]
    entries = _gather_logprobs(logits.float(), torch.tensor(targets, device=logits.device),
                               counts)
    offset = 0
    for item, n in scoring:
        start = item.start + 1  # entry i is prompt token i's
        item.seq.prompt_logprobs[start:start + n] = entries[offset:offset + n]
        offset += n
