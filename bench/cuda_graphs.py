"""Decode steps from CUDA graphs against eager ones: ``python -m pdserve.bench.cuda_graphs``.

Prints; never asserts. For the tiny model and a random ~100M Llama (bf16) at batch 1, 8 and
64, in one run with the two modes interleaved: the median pure decode step with the forward
replayed from its captured graph (engine/step/cuda_graphs.py) and with ``enforce_eager=True``,
their ratio, and whether the two gave the same greedy tokens. A small model's decode step on
a GPU is bound by kernel launches; this is the figure that says how much a graph saves.

Without CUDA it says so and exits 0. ``--quick`` runs the same on the CPU at toy sizes with the
stand-in capture (its replay calls the forward again): a smoke run of the plumbing and the
token check, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pdserve.bench.engine import LLAMA_100M, LLAMA_TINY, decode_steps, write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.cuda_graphs import eager_capture
from pdserve.worker_api.sampling_params import SamplingParams

PROMPT_TOKENS = 32
CHECK_TOKENS = 16  # greedy tokens per request compared between the modes


def build(model_dir: Path, dtype: str, graphs: bool, max_num_seqs: int, steps: int,
          quick: bool) -> EngineParts:
    """Engine parts on CUDA (graphs captured unless eager), or on the CPU with the stand-in
    capture (``quick``)."""
    config = dict(model=str(model_dir), dtype=dtype, num_kv_blocks=2048,
                  max_num_seqs=max_num_seqs, max_model_len=PROMPT_TOKENS + steps + 64)
    if quick:
        parts = EngineParts.build(EngineConfig(**config))
        if graphs:
            parts.capture_decode_graphs(eager_capture)
        return parts
    parts = EngineParts.build(EngineConfig(**config, device="cuda", enforce_eager=not graphs))
    if graphs and parts.runner.graphs is None:
        raise RuntimeError("no decode graphs were captured: needs the Triton backend on CUDA")
    return parts


def greedy_outputs(parts: EngineParts, batch: int) -> list[list[int]]:
    """Each request's first CHECK_TOKENS greedy tokens, ``batch`` requests decoding together."""
    engine = LLMEngine(parts)
    params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i in range(batch):
        out[f"g{i}"] = []
        engine.add_request(f"g{i}", [(11 * i + j) % 500 + 1 for j in range(PROMPT_TOKENS)],
                           params)
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            out[delta.request_id] += delta.new_token_ids
    return list(out.values())


def median_step_ms(parts: EngineParts, batch: int, steps: int) -> float:
    stats = sorted(s.total_s for s in decode_steps(LLMEngine(parts), batch, PROMPT_TOKENS, steps))
    return stats[len(stats) // 2] * 1e3


def compare(name: str, model_dir: Path, dtype: str, batches: list[int], steps: int,
            quick: bool) -> list[list]:
    """One model's rows: per batch, eager and graph steps measured back to back."""
    modes = {mode: build(model_dir, dtype, mode == "graphs", max(batches), steps, quick)
             for mode in ("eager", "graphs")}
    rows = []
    for batch in batches:
        times = {mode: median_step_ms(parts, batch, steps) for mode, parts in modes.items()}
        same = greedy_outputs(modes["eager"], batch) == greedy_outputs(modes["graphs"], batch)
        rows.append([name, dtype, batch, times["eager"], times["graphs"],
                     times["eager"] / times["graphs"], "yes" if same else "NO"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="toy sizes on the CPU with the stand-in capture (a smoke run)")
    args = parser.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--quick runs the CPU smoke run)")
        return
    torch.manual_seed(0)
    batches, steps = ([1, 3], 4) if args.quick else ([1, 8, 64], 64)  # 3: padded to 4
    dtype = "float32" if args.quick else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": write_random_llama(Path(tmp) / "tiny", **LLAMA_TINY)}
        if not args.quick:
            models["~100M Llama"] = write_random_llama(Path(tmp) / "llama100m", **LLAMA_100M)
        rows = [row for name, path in models.items()
                for row in compare(name, path, dtype, batches, steps, args.quick)]
    where = "CPU, stand-in capture" if args.quick else torch.cuda.get_device_name()
    print(f"decode step, eager against CUDA graphs ({where}; median of {steps} steps)")
    print(format_table(["model", "dtype", "batch", "eager ms", "graphs ms", "eager / graphs",
                        "same tokens"], rows))


if __name__ == "__main__":
    main()
