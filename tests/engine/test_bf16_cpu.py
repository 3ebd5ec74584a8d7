"""bfloat16 on the CPU: the offline engine's greedy tokens against transformers' model in bf16,
through the packed bf16 GEMMs and the C decode attention, at several batch sizes; and the
fallback where oneDNN has no bf16 kernels for the CPU.

Two bf16 computations of one model round in different places (transformers rounds attention
and norm outputs to bf16 where pdserve keeps them in float32, and the two sum in other orders),
so their logits differ by a few bf16 steps, and where the reference's best two tokens are that
close the argmax may fall either way. A token may therefore differ only at a measured tie: at
the first step where ours differs, the reference's top-2 logit gap must be within MARGIN_ULPS
steps of bf16 at its top logit; on every earlier step where the two agree on the best two
tokens, our gap (from our logprobs) must be within the same margin of the reference's. The
margin: on checkpoints like these, transformers' own bf16 gap differs from its float32 gap by
up to 6.2 steps and ours from its bf16 gap by up to 4 (``python -m pdserve.bench.bf16_ties``,
docs/cpu-speed.md), what rounding alone does; 8 steps leaves room above both, and a real error
(a context position missed, a value off by a few percent) moves the gaps by more.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import resolved_model
from pdserve.kernels import cpu_causal_attention
from pdserve.kernels import linear as klinear

MARGIN_ULPS = 8
MAX_TOKENS = 16
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randrange(3, 60))] for _ in range(16)]


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values at ``x`` (8 significant bits), x != 0."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


@dataclass(frozen=True)
class RefStep:
    """One greedy step of the reference."""

    token: int  # its argmax
    top: float  # the largest logit
    gap: float  # the largest logit less the second
    best_two: frozenset[int]  # the tokens of the two largest logits


def hf_bf16_steps(path, prompts: list[list[int]], max_tokens: int) -> list[list[RefStep]]:
    """transformers' model loaded in bf16, greedy over its own KV cache, each prompt alone."""
    # lazy: transformers (seconds to import) only for the reference
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    runs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, past, steps = torch.tensor([prompt]), None, []
            for _ in range(max_tokens):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                top = out.logits[0, -1].float().topk(2)
                first, second = top.values.tolist()
                steps.append(RefStep(int(top.indices[0]), first, first - second,
                                     frozenset(top.indices.tolist())))
                ids = torch.tensor([[steps[-1].token]])
            runs.append(steps)
    return runs


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    runs: dict[str, list[list[RefStep]]] = {}

    def get(name: str) -> list[list[RefStep]]:
        if name not in runs:
            runs[name] = hf_bf16_steps(hf_checkpoint(name), PROMPTS, MAX_TOKENS)
        return runs[name]

    return get


def check_against_reference(token_ids: list[int], logprobs: list[dict[int, float]],
                            ref: list[RefStep]) -> None:
    """Equal tokens up to a measured tie, then nothing more (the two continue differently)."""
    for i, step in enumerate(ref):
        margin = MARGIN_ULPS * bf16_ulp(step.top)
        if token_ids[i] != step.token:
            assert step.gap <= margin, (f"step {i}: {token_ids[i]} where the reference's "
                                        f"{step.token} led by {step.gap} (margin {margin})")
            return
        if set(logprobs[i]) == step.best_two:
            first, second = sorted(logprobs[i].values(), reverse=True)
            assert abs(first - second - step.gap) <= margin, (
                f"step {i}: our top-2 gap {first - second} against the reference's {step.gap}")


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-tied"])
@pytest.mark.parametrize("max_num_seqs", [1, 5, 16])
def test_bf16_greedy_matches_transformers_but_at_ties(hf_checkpoint, reference, name,
                                                      max_num_seqs):
    """At 1, 5 and 16 sequences a step: the packed bf16 GEMMs (where the CPU has oneDNN's bf16
    kernels) and the C decode attention on a bf16 pool."""
    llm = LLM(str(hf_checkpoint(name)), dtype="bfloat16", block_size=4, num_kv_blocks=512,
              max_num_seqs=max_num_seqs)
    model = llm.engine.parts.runner.model
    assert model.dtype == torch.bfloat16
    assert (model.model.layers[0].mlp.gate_up_proj.packed is not None) == klinear.bf16_native()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, ref in zip(outs, reference(name), strict=True):
        check_against_reference(out.token_ids, out.logprobs, ref)
    assert llm.engine.parts.block_manager.num_used_blocks == 0


def test_bf16_greedy_with_prompts_on_the_amx_attention(hf_checkpoint, reference, monkeypatch):
    """Qwen3's head_dim of 32 is one the C bf16 prompt attention takes (the other checkpoints'
    16 is not): on a CPU with AMX every prompt's layers go through it, and the tokens still
    match transformers' but at ties."""
    calls = []
    real = cpu_causal_attention.causal_attention_bf16_cpu
    monkeypatch.setattr(cpu_causal_attention, "causal_attention_bf16_cpu",
                        lambda *args: calls.append(args[0].shape[0]) or real(*args))
    llm = LLM(str(hf_checkpoint("qwen3-qknorm")), dtype="bfloat16", block_size=4,
              num_kv_blocks=512, max_num_seqs=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, ref in zip(outs, reference("qwen3-qknorm"), strict=True):
        check_against_reference(out.token_ids, out.logprobs, ref)
    if cpu_causal_attention.bf16_native():
        assert sorted(set(calls)) == sorted({len(p) for p in PROMPTS})


def test_the_tie_rule_fails_a_token_that_was_no_tie():
    ref = [RefStep(7, 3.0, 0.5, frozenset({7, 9})), RefStep(4, 3.0, 0.01, frozenset({4, 5}))]
    check_against_reference([7, 5], [{7: -1.0, 9: -1.5}, {5: -1.0, 4: -1.0}], ref)  # a tie
    with pytest.raises(AssertionError, match="led by 0.5"):
        check_against_reference([9, 4], [{9: -1.0, 7: -1.5}, {4: -1.0, 5: -1.1}], ref)
    with pytest.raises(AssertionError, match="top-2 gap"):
        check_against_reference([7, 4], [{7: -1.0, 9: -2.5}, {4: -1.0, 5: -1.1}], ref)


def test_bf16_without_the_cpus_bf16_kernels_runs_unpacked_and_says_so(
        hf_checkpoint, monkeypatch, caplog):
    """Where oneDNN has no bf16 kernels, --dtype bfloat16 still serves, on F.linear, with one
    warning per process that names the faster choice."""
    monkeypatch.setattr(klinear, "bf16_native", lambda: False)
    resolved_model.warn_bf16_emulated.cache_clear()
    path = str(hf_checkpoint("llama-gqa"))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger=resolved_model.__name__):
        for _ in range(2):
            llm = LLM(path, dtype="bfloat16", block_size=4, num_kv_blocks=64)
            assert llm.engine.parts.runner.model.model.layers[0].mlp.gate_up_proj.packed is None
            assert len(llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids) == 4
    warnings = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warnings) == 1 and "--dtype float32" in warnings[0]
    resolved_model.warn_bf16_emulated.cache_clear()
