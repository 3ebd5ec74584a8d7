"""Tensor parallel engine benchmark: ``python -m pdserve.bench.tensor_parallel [--sizes 1,2]
[--device cpu|cuda] [--model DIR]``. Prints; never asserts (but says when tokens differ).

For each group size, on the same checkpoint (a random Llama by default: ~100M parameters on
the CPU, ~1B in bfloat16 on CUDA): greedy tokens of a few prompts against size 1's, the time
of one prefill of ``--prompt-len`` tokens and the median pure decode step at each batch, each
as a ratio to size 1 in the same run. On a CPU whose cores the ranks share, the ratios say
what the group's collectives cost, not what tensor parallelism gains on separate devices.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.engine import LLAMA_100M, decode_steps, write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker_api.sampling_params import SamplingParams

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                max_position_embeddings=4096, tie_word_embeddings=False)


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[f"g{i}"] for i in range(len(prompts))]


def _prefill_s(engine: LLMEngine, prompt_len: int, repeats: int = 3) -> float:
    """Best time of one step that prefills a fresh ``prompt_len``-token prompt."""
    best = float("inf")
    for r in range(repeats):
        prompt = [(13 * r + j) % 500 + 1 for j in range(prompt_len)]
        engine.add_request(f"p{r}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return best


def run(model: Path, sizes: list[int], device: str, dtype: str, batches: list[int],
        prompt_len: int, steps: int) -> str:
    prompts = [[(5 * i + j) % 400 + 3 for j in range(8 + 9 * i)] for i in range(4)]
    rows, base, reference = [], {}, None
    cores = os.cpu_count() or 1
    for size in sizes:
        if device == "cpu":  # the same cores for every size: split among its ranks
            torch.set_num_threads(max(1, cores // size))
        config = EngineConfig(model=str(model), device=device, dtype=dtype, num_kv_blocks=2048,
                              max_num_seqs=max(batches), enable_prefix_caching=False,
                              max_num_batched_tokens=max(prompt_len, 256),
                              tensor_parallel_size=size)
        engine = LLMEngine.from_config(config)
        try:
            tokens = _greedy(engine, prompts, 16)
            reference = reference or tokens
            same = "same" if tokens == reference else "DIFFERENT"
            timings = [("prefill", prompt_len, _prefill_s(engine, prompt_len))]
            for batch in batches:
                stats = sorted(s.total_s for s in decode_steps(engine, batch, 128, steps))
                timings.append(("decode", batch, stats[len(stats) // 2]))
        finally:
            engine.close()
        for phase, n, seconds in timings:
            base.setdefault((phase, n), seconds)
            rows.append([size, torch.get_num_threads(), phase, n, seconds * 1e3,
                         seconds / base[(phase, n)], same])
    return format_table(["TP", "threads/rank", "phase", "tokens | batch", "ms", "x TP=1",
                         "greedy vs TP=1"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2", help="group sizes, comma-separated")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: a random Llama)")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per batch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    sizes = [int(s) for s in args.sizes.split(",")]
    if cuda and max(sizes) > torch.cuda.device_count():
        parser.error(f"--sizes asks for {max(sizes)} GPUs; {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-") as tmp:
        model = args.model or write_random_llama(Path(tmp), **(LLAMA_1B if cuda else LLAMA_100M))
        print(f"tensor parallel on {'cuda' if cuda else f'cpu ({os.cpu_count()} cores)'}, "
              f"{model}")
        print(run(model, sizes, "cuda" if cuda else "cpu", "bfloat16" if cuda else "float32",
                  [int(b) for b in args.batches.split(",")], args.prompt_len, args.steps))


if __name__ == "__main__":
    main()
