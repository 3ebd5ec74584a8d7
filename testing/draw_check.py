"""Is every token of a stream the draw its request makes, up to float rounding?

A seeded request's token at output position ``j`` is the draw of ``draw_uniform(seed, j)`` from
the processed distribution at that position, and a greedy one is the argmax, so a request that
moves between workers continues with the same tokens. Bit for bit, that holds only while the
logits agree bit for bit, and on CPU they do not across batch shapes: a request that shares a
decode batch with others, has its prompt chunked differently, or is re-prefilled after a
migration gets logits that differ from the same request alone in the last bits (about 1e-6 on
the test models). A draw whose uniform falls that close to a boundary of the cumulative
distribution (or a token at the top-p edge) then flips, and the rest of the stream diverges.

So the fault tests do not compare streams with an offline run token for token. For each stream
they run the Hugging Face model once over prompt + tokens (teacher forcing) and check every
token against the draws the sampler would make there with the uniform and top-p moved by
``tolerance`` either way (greedy: within ``tolerance`` of the top logit). A lost, duplicated
or reordered token, a draw keyed to the wrong position or seed, or a truncated stream fails
the check; a flip at a rounding boundary does not. It needs ``transformers`` (the test extra).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.sampling.filters import filter_weights, softmax_weights
from pdserve.engine.sampling.sampler import SamplingRow, apply_penalties, inverse_cdf_draw
from pdserve.engine.sampling.seeded_uniforms import draw_uniforms
from pdserve.worker_api.sampling_params import GREEDY_TEMPERATURE, SamplingParams


def draw_problems(model_dir: str, requests: Sequence[tuple[list[int], SamplingParams | dict]],
                  streams: Sequence[list[int]], tolerance: float = 1e-4) -> list[str]:
    """One line per stream whose tokens are not its request's draws (empty: all are).

    ``requests`` are (prompt token ids, SamplingParams or its keywords): ``ignore_eos`` (the
    stream has ``max_tokens`` tokens), no stop strings or stop ids, and a seed unless greedy.
    Penalties are applied as the sampler applies them.
    """
    import transformers  # lazy: a test dependency, seconds to import

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    problems = []
    for i, ((prompt, params), tokens) in enumerate(zip(requests, streams, strict=True)):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        problem = _stream_problem(model, list(prompt), params, tokens, tolerance)
        if problem:
            problems.append(f"stream {i}: {problem}")
    return problems


def _stream_problem(model, prompt: list[int], params: SamplingParams, tokens: list[int],
                    tolerance: float) -> str | None:
    greedy = params.temperature < GREEDY_TEMPERATURE
    if not params.ignore_eos or params.stop or params.stop_token_ids or not (
            greedy or params.seed is not None):
        raise ValueError("draw_problems checks ignore_eos streams without stop strings or ids, "
                         f"seeded unless greedy; got {params}")
    if len(tokens) != params.max_tokens:
        return f"{len(tokens)} tokens, expected max_tokens={params.max_tokens}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    rows = [SamplingRow(params, params.seed or 0, j, prompt, tokens[:j])
            for j in range(len(tokens))]
    logits = apply_penalties(logits.float(), rows)
    ok = _greedy_ok(logits, tokens, tolerance) if greedy else \
        _sampled_ok(logits, tokens, params, tolerance)
    bad = (~ok).nonzero()
    if len(bad):
        j = int(bad[0])
        return f"token {j} ({tokens[j]}) is not the draw at output position {j}"
    return None


def _greedy_ok(logits: torch.Tensor, tokens: list[int], tolerance: float) -> torch.Tensor:
    top = logits.max(dim=1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return chosen >= top - tolerance * top.abs().clamp(min=1.0)


def _sampled_ok(logits: torch.Tensor, tokens: list[int], params: SamplingParams,
                tolerance: float) -> torch.Tensor:
    rows = len(tokens)
    weights = softmax_weights(logits / params.temperature)
    uniforms = draw_uniforms([params.seed] * rows, list(range(rows)))
    top_k = torch.full((rows,), params.top_k, dtype=torch.int64)
    min_p = torch.full((rows,), float(params.min_p))
    observed = torch.tensor(tokens)
    ok = torch.zeros(rows, dtype=torch.bool)
    for p in {min(1.0, params.top_p + d) for d in (-tolerance, 0.0, tolerance)}:
        filtered = filter_weights(weights.clone(), top_k, torch.full((rows,), p), min_p)
        for d in (-tolerance, 0.0, tolerance):
            ok |= inverse_cdf_draw(filtered, (uniforms + d).clamp(0.0, 1.0 - 2**-53)) == observed
    return ok
