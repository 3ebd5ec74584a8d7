"""How far two bf16 computations of one model set their best two tokens apart: ``python -m
pdserve.bench.bf16_ties [--seeds 4] [--prompts 16] [--tokens 16]``. Prints; never asserts.

On random Llama checkpoints of the engine tests' shape (written by transformers), greedy
decoding of random prompts by transformers' model in float32 and in bf16 and by pdserve's
offline engine in bf16. Along transformers' bf16 tokens, up to the step where pdserve's token
first differs, at every step where the compared run agrees on the best two tokens: the
difference of the two top-2 logit gaps in bf16 steps of the top logit (the spacing of bf16
values there), worst case per checkpoint, of transformers' bf16 against its float32 (what bf16
rounding alone does) and of pdserve's bf16 against transformers' bf16. And how many prompts'
tokens part, and transformers' largest gap where they do. ``tests/engine/test_bf16_cpu.py``
takes its tie margin from these figures.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
from pathlib import Path

import torch

from pdserve.bench.stats import format_table
from pdserve.engine.llm import LLM
from pdserve.worker_api.sampling_params import SamplingParams

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False)


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values at ``x`` (8 significant bits), x != 0."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def write_checkpoint(path: Path, seed: int) -> Path:
    """A random Llama: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, .1), as the tests do."""
    # lazy: transformers (seconds to import) only to write and run the reference
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(noise / param.shape[1] ** 0.5 if param.dim() == 2
                        else 1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(path)
    return path


def top2(logits: torch.Tensor) -> tuple[int, frozenset[int], float, float]:
    """(the argmax, the best two tokens, the top logit, the gap to the second)."""
    top = logits.float().topk(2)
    first, second = top.values.tolist()
    return int(top.indices[0]), frozenset(top.indices.tolist()), first, first - second


def reference_steps(models: dict, prompt: list[int], tokens: int) -> list[dict]:
    """Each dtype's top2 at every step, all fed transformers' bf16 tokens."""
    ids, caches, steps = torch.tensor([prompt]), {dtype: None for dtype in models}, []
    with torch.no_grad():
        for _ in range(tokens):
            step = {}
            for dtype, model in models.items():
                result = model(input_ids=ids, past_key_values=caches[dtype], use_cache=True)
                caches[dtype] = result.past_key_values
                step[dtype] = top2(result.logits[0, -1])
            steps.append(step)
            ids = torch.tensor([[step[torch.bfloat16][0]]])
    return steps


def compare(path: Path, prompts: list[list[int]], tokens: int) -> list:
    """[worst |bf16 - fp32 gap| of transformers, worst |ours - transformers' bf16 gap|, how
    many prompts' tokens part, transformers' largest bf16 gap where they do], gaps in bf16
    steps."""
    # lazy: transformers (seconds to import) only for the reference
    from transformers import AutoModelForCausalLM

    models = {dtype: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
              for dtype in (torch.bfloat16, torch.float32)}
    llm = LLM(str(path), dtype="bfloat16", block_size=4, num_kv_blocks=512)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    worst_fp32, worst_ours, ties = 0.0, 0.0, []
    for prompt, out in zip(prompts, outs, strict=True):
        for i, step in enumerate(reference_steps(models, prompt, tokens)):
            token, best, top, gap = step[torch.bfloat16]
            unit = bf16_ulp(top)
            if step[torch.float32][1] == best:
                worst_fp32 = max(worst_fp32, abs(step[torch.float32][3] - gap) / unit)
            if out.token_ids[i] != token:
                ties.append(gap / unit)
                break
            if set(out.logprobs[i]) == best:
                first, second = sorted(out.logprobs[i].values(), reverse=True)
                worst_ours = max(worst_ours, abs(first - second - gap) / unit)
    return [worst_fp32, worst_ours, len(ties), max(ties, default=math.nan)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4, help="checkpoints (seeds 0, 1, ...)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            rng = random.Random(seed)
            prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 60))]
                       for _ in range(args.prompts)]
            path = write_checkpoint(Path(tmp) / f"seed{seed}", seed)
            rows.append([seed, *compare(path, prompts, args.tokens)])
    print(f"{args.prompts} prompts x {args.tokens} tokens per checkpoint; gaps in bf16 steps "
          "of the top logit")
    print(format_table(["seed", "worst |hf bf16 - hf fp32|", "worst |ours - hf bf16|",
                        "prompts parting", "largest hf gap where they part"], rows))


if __name__ == "__main__":
    main()
