"""``n`` > 1 against ``n`` separate requests: ``python -m pdserve.bench.n_fork [--quick]``.
Prints; never asserts.

One request of ``n`` sampled completions (forked after one prefill, sharing the prompt's full
KV blocks: docs/n-best-of.md) against ``n`` requests of one completion each, with the same
seeds (``child_seed``), so both make the same tokens; prefix caching off, so the separate
requests share nothing. For each: the tokens the engine computed, its peak KV blocks, the
wall time, and whether the outputs are equal. A random ~100M Llama (``--quick``: the tiny
one), on whatever device the engine resolves.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from pdserve.bench.engine import LLAMA_100M, LLAMA_TINY, write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine.llm import LLM
from pdserve.worker_api import choice_request_id
from pdserve.worker_api.sampling_params import SamplingParams, child_seed


def measure(model: str, prompt: list[int], requests: list[SamplingParams]) -> tuple:
    """(tokens computed, peak KV blocks, seconds, outputs) of ``requests`` run together."""
    with LLM(model, dtype="float32", block_size=16, num_kv_blocks=1024,
             enable_prefix_caching=False) as llm:
        engine = llm.engine
        ids = []
        for i, params in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
            ids += [choice_request_id(f"r{i}", j) for j in range(params.n)]
        outputs: dict[str, list[int]] = {}
        tokens, peak, start = 0, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for delta in engine.render(engine.step()):
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            tokens += engine.last_step.num_tokens
            peak = max(peak, engine.parts.block_manager.num_used_blocks)
        return tokens, peak, time.perf_counter() - start, [outputs[i] for i in ids]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny Llama")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_random_llama(Path(tmp) / "llama",
                                       **(LLAMA_TINY if args.quick else LLAMA_100M)))
        prompt = [(7 * i) % 500 + 3 for i in range(args.prompt_tokens)]
        common = dict(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)
        forked = measure(model, prompt, [SamplingParams(seed=5, n=args.n, **common)])
        apart = measure(model, prompt, [SamplingParams(seed=child_seed(5, i), **common)
                                        for i in range(args.n)])
    rows = [[label, tokens, peak, f"{seconds:.2f}", "yes" if outs == forked[3] else "no"]
            for label, (tokens, peak, seconds, outs)
            in [(f"one request, n={args.n}", forked), (f"{args.n} requests, n=1", apart)]]
    print(f"prompt {args.prompt_tokens} tokens, {args.max_tokens} generated per completion, "
          f"KV blocks of 16 tokens")
    print(format_table(["setup", "tokens computed", "peak KV blocks", "seconds",
                        "same tokens"], rows))


if __name__ == "__main__":
    main()
