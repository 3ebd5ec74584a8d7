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
the check; a flip at a rounding boundary does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.sampler import draw_uniforms, filter_weights, inverse_cdf_draw, softmax_weights
from pdserve.engine.sampling_params import GREEDY_TEMPERATURE

SUPPORTED = {"max_tokens", "ignore_eos", "temperature", "top_p", "top_k", "min_p", "seed"}


def draw_problems(model_dir: str, requests: Sequence, streams: Sequence[list[int]],
                  tolerance: float = 1e-4) -> list[str]:
    """One line per stream whose tokens are not its request's draws (empty: all are).

    ``requests`` have ``.request_id``, ``.prompt`` (token ids) and ``.sampling`` (SamplingParams
    keywords among :data:`SUPPORTED`, with ``ignore_eos``: the stream has ``max_tokens`` tokens).
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    problems = []
    for request, tokens in zip(requests, streams, strict=True):
        problem = _stream_problem(model, request, tokens, tolerance)
        if problem:
            problems.append(f"{request.request_id}: {problem}")
    return problems


def _stream_problem(model, request, tokens: list[int], tolerance: float) -> str | None:
    sampling = request.sampling
    unknown = set(sampling) - SUPPORTED
    greedy = sampling.get("temperature", 1.0) < GREEDY_TEMPERATURE
    if unknown or not sampling.get("ignore_eos") or not (greedy or "seed" in sampling):
        raise ValueError(f"draw_problems checks ignore_eos streams, seeded unless greedy, with "
                         f"keys among {sorted(SUPPORTED)}; {request.request_id} has {sampling}")
    if len(tokens) != sampling["max_tokens"]:
        return f"{len(tokens)} tokens, expected max_tokens={sampling['max_tokens']}"
    ids = torch.tensor([list(request.prompt) + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(request.prompt) - 1:].float()  # (len(tokens), vocab)
    if greedy:
        ok = _greedy_ok(logits, tokens, tolerance)
    else:
        ok = _sampled_ok(logits, tokens, sampling, tolerance)
    bad = (~ok).nonzero()
    if len(bad):
        j = int(bad[0])
        return f"token {j} ({tokens[j]}) is not the draw at output position {j}"
    return None


def _greedy_ok(logits: torch.Tensor, tokens: list[int], tolerance: float) -> torch.Tensor:
    top = logits.max(dim=1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return chosen >= top - tolerance * top.abs().clamp(min=1.0)


def _sampled_ok(logits: torch.Tensor, tokens: list[int], sampling: dict,
                tolerance: float) -> torch.Tensor:
    rows = len(tokens)
    weights = softmax_weights(logits / sampling["temperature"])
    uniforms = draw_uniforms([sampling["seed"]] * rows, list(range(rows)))
    top_k = torch.full((rows,), sampling.get("top_k", 0), dtype=torch.int64)
    min_p = torch.full((rows,), float(sampling.get("min_p", 0.0)))
    observed = torch.tensor(tokens)
    ok = torch.zeros(rows, dtype=torch.bool)
    top_p = float(sampling.get("top_p", 1.0))
    for p in {min(1.0, top_p + d) for d in (-tolerance, 0.0, tolerance)}:
        filtered = filter_weights(weights.clone(), top_k, torch.full((rows,), p), min_p)
        for d in (-tolerance, 0.0, tolerance):
            ok |= inverse_cdf_draw(filtered, (uniforms + d).clamp(0.0, 1.0 - 2**-53)) == observed
    return ok
