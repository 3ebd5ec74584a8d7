"""int8 KV cache quality and capacity: ``python -m pdserve.bench.kv_int8 [--model DIR]``.

Prints, against the model-dtype cache in the same run: KV blocks that fit on the same budget,
greedy token agreement over a prompt set, and the error of the first generated token's
log-probabilities (which depend only on the prompt's cached K/V). Never asserts.
"""

from __future__ import annotations

import argparse
import random

from pdserve.bench.stats import format_table
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models import tiny_model_dir


def _agreement(reference, outs) -> tuple[float, float, float, float, float]:
    """(same first token, same sequence, token agreement, max and mean |d logprob| of token 0)."""
    n = len(reference)
    both = list(zip(reference, outs, strict=True))
    same_first = sum(a.token_ids[0] == b.token_ids[0] for a, b in both) / n
    same_all = sum(a.token_ids == b.token_ids for a, b in both) / n
    pairs = [(x, y) for a, b in both for x, y in zip(a.token_ids, b.token_ids, strict=True)]
    errors = [abs(a.logprobs[0][t] - b.logprobs[0][t])
              for a, b in both for t in a.logprobs[0] if t in b.logprobs[0]]
    return (same_first, same_all, sum(x == y for x, y in pairs) / len(pairs), max(errors),
            sum(errors) / len(errors))


def compare(model_dir: str, num_prompts: int, max_tokens: int, budget: int) -> list[list]:
    rng = random.Random(0)
    base = LLM(model_dir, memory_budget_bytes=budget)
    vocab = base.engine.parts.model_config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(16, 256))]
               for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=8)
    reference = base.generate(prompts, params, use_tqdm=False)
    base_blocks = base.memory_ledger.num_kv_blocks
    rows = [["model dtype", base_blocks, 1.0, *_agreement(reference, reference)]]
    for keep_edges in (True, False):
        llm = LLM(model_dir, memory_budget_bytes=budget, kv_cache_dtype="int8",
                  kv_int8_keep_edge_layers=keep_edges)
        outs = llm.generate(prompts, params, use_tqdm=False)
        blocks = llm.memory_ledger.num_kv_blocks
        rows.append([f"int8{' + fp edge layers' if keep_edges else ''}", blocks,
                     blocks / base_blocks, *_agreement(reference, outs)])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--budget-mib", type=int, default=512)
    args = parser.parse_args(argv)
    model_dir = args.model or str(tiny_model_dir())
    rows = compare(model_dir, args.prompts, args.max_tokens, args.budget_mib << 20)
    print(f"model {model_dir}, {args.prompts} prompts x {args.max_tokens} greedy tokens")
    print(format_table(["KV cache", "blocks", "x blocks", "same 1st token", "same sequence",
                        "token agreement", "max |dlogprob|", "mean |dlogprob|"], rows))


if __name__ == "__main__":
    main()
