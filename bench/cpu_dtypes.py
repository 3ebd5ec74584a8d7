"""float32 against bfloat16 on the CPU: ``python -m pdserve.bench.cpu_dtypes [--model DIR]
[--threads 1,2] [--rounds 3] [--quick]``. Prints; never asserts.

For each thread count, one engine per dtype (defaults otherwise: packed GEMMs, the C kernels
where they build), measured in interleaved rounds (the machine's speed drifts between them):
the median pure decode step at batch 1, 8 and 32 (prompts of 128 tokens), and prefill
tokens/s of one prompt of 256 and of 1024 tokens (no prefix cache, one step each). Each cell
prints the median of the rounds and their range. Without ``--model``, a random Llama of
SmolLM2-135M's shape.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.engine import decode_steps, write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.kernels import linear as klinear
from pdserve.worker_api.sampling_params import SamplingParams

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                     max_position_embeddings=2048, tie_word_embeddings=True)
DTYPES = ("float32", "bfloat16")


def build_engine(model_dir: Path, dtype: str) -> LLMEngine:
    return LLMEngine(EngineParts.build(EngineConfig(
        model=str(model_dir), dtype=dtype, num_kv_blocks=1024, max_num_seqs=64,
        max_num_batched_tokens=2048, enable_prefix_caching=False)))


def decode_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    stats = decode_steps(engine, batch, 128, steps)
    return statistics.median(s.total_s for s in stats) * 1e3


def prefill_tokens_per_s(engine: LLMEngine, tokens: int, tag: str) -> float:
    """One prompt of ``tokens`` tokens to its first token (a step, as the budget holds it)."""
    engine.add_request(tag, [(7 * j) % 500 + 1 for j in range(tokens)],
                       SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - start)


def measure(engines: dict[str, LLMEngine], batches: list[int], prompts: list[int],
            steps: int, rounds: int) -> dict[tuple[str, str], list[float]]:
    """{(dtype, figure): one value per round}; each round measures every figure of every
    dtype once, the dtypes alternating."""
    values: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for dtype, engine in engines.items():
            for batch in batches:
                values.setdefault((dtype, f"decode b{batch} ms"), []).append(
                    decode_ms(engine, batch, steps))
            for tokens in prompts:
                values.setdefault((dtype, f"prefill {tokens} tok/s"), []).append(
                    prefill_tokens_per_s(engine, tokens, f"p{r}-{tokens}"))
    return values


def table(values: dict[tuple[str, str], list[float]], threads: int) -> list[list]:
    rows = []
    for (dtype, figure), runs in values.items():
        rows.append([threads, dtype, figure, statistics.median(runs), min(runs), max(runs)])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint folder (default: random SmolLM2 shape)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 kernels: "
          f"{klinear.bf16_native()}")
    with tempfile.TemporaryDirectory() as tmp:
        shape = (dict(SMOLLM2_SHAPE, num_hidden_layers=2, vocab_size=1024) if args.quick
                 else SMOLLM2_SHAPE)
        model_dir = Path(args.model) if args.model else write_random_llama(Path(tmp), **shape)
        engines = {dtype: build_engine(model_dir, dtype) for dtype in DTYPES}
        batches, prompts = ([1, 8], [64]) if args.quick else ([1, 8, 32], [256, 1024])
        rows = []
        try:
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                values = measure(engines, batches, prompts, 4 if args.quick else 16,
                                 1 if args.quick else args.rounds)
                rows += table(values, threads)
        finally:
            torch.set_num_threads(before)
    print(format_table(["threads", "dtype", "figure", "median", "min", "max"], rows))


if __name__ == "__main__":
    main()
