"""LoRA adapters' cost: ``python -m pdserve.bench.lora [--quick] [--model DIR]``. Prints;
never asserts; not part of ``make test``.

On SmolLM2-135M (fp32, the peer's checkpoint: ``../shared/peer`` sets it up in
``/tmp/peer-model/smollm2-hf``; ``--quick`` or a missing checkpoint: the built-in tiny model),
one offline engine per case runs the same load, ``--requests`` prompts of ``--input-len``
random tokens, ``--output-len`` greedy tokens each, ``--max-num-seqs`` at a time:

* ``base, LoRA off``: the base model on an engine without slots (the reference);
* ``base, LoRA on``: the base model on an engine with slots (what serving adapters costs the
  requests that use none);
* ``1 / 4 / 16 adapters``: the requests spread round robin over that many adapters (PEFT,
  rank ``--rank`` on all seven projections), ``max_loras`` = 16 so none is evicted.

Per case: output tokens per second of wall time, median TPOT (each request's time from its
first to its last token over its tokens after the first) and median TTFT, with each ratio to
the reference in the same run; then each adapter's load time from disk (read, checked,
digest) and from host memory (copied into a slot), medians over the adapters.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.bench.stats import format_table
from pdserve.engine.llm import LLM
from pdserve.models.tiny import tiny_model_dir
from pdserve.testing.lora_adapters import write_peft_adapter
from pdserve.worker_api.sampling_params import SamplingParams

PEER_MODEL = Path("/tmp/peer-model/smollm2-hf")
CASES = (("base, LoRA off", None), ("base, LoRA on", 0), ("1 adapter", 1),
         ("4 adapters", 4), ("16 adapters", 16))


def make_adapters(model: Path, folder: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``model`` in ``folder`` (kept: later runs reuse them)."""
    paths = []
    for i in range(count):
        path = folder / f"adapter-{i}-r{rank}"
        if not (path / "adapter_model.safetensors").exists():
            write_peft_adapter(model, path, rank, seed=i, scale=0.5)
        paths.append(path)
    return paths


def run_case(model: Path, adapters: int | None, paths: list[Path], prompts, args) -> dict:
    lora = {} if adapters is None else dict(enable_lora=True, max_loras=16,
                                             max_lora_rank=args.rank)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with LLM(str(model), dtype="float32", max_num_seqs=args.max_num_seqs,
             enable_prefix_caching=False, **lora) as llm:
        refs = [LLM.adapter(p) for p in paths[:adapters or 0]]
        per_prompt = [refs[i % len(refs)] if refs else None for i in range(len(prompts))]
        for ref in refs:  # read and in a slot before the clock starts: a steady state
            llm.generate([prompts[0][:4]], SamplingParams(max_tokens=1), use_tqdm=False,
                         adapters=ref)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, adapters=per_prompt)
        wall = time.perf_counter() - start
    tpots = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs]
    return {"tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "tpot_ms": 1e3 * statistics.median(tpots),
            "ttft_ms": 1e3 * statistics.median(o.ttft_s for o in outs)}


def load_times(model: Path, paths: list[Path], rank: int) -> tuple[float, float]:
    """Median seconds to read an adapter from disk, and to copy one from host memory into a
    slot (two slots, every adapter held in host memory)."""
    with LLM(str(model), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=rank,
             max_cpu_loras=len(paths), num_kv_blocks=64) as llm:
        slots = llm.engine.parts.adapters
        refs = [LLM.adapter(p) for p in paths]
        disk = []
        for ref in refs:
            start = time.perf_counter()
            slots.read(ref)
            disk.append(time.perf_counter() - start)
        host = []
        for i, ref in enumerate(refs):
            start = time.perf_counter()
            slots.load_slot(i % 2, ref)
            host.append(time.perf_counter() - start)
    return statistics.median(disk), statistics.median(host)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.lora",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="the tiny model, a short load")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "pdserve-bench-lora")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        model = PEER_MODEL if PEER_MODEL.is_dir() and not args.quick else \
            tiny_model_dir(args.adapters_dir / "tiny")
    if args.quick:
        args.requests, args.input_len, args.output_len = 8, 16, 8
    folder = args.adapters_dir / model.name
    paths = make_adapters(model, folder, 16, args.rank)
    rng = random.Random(0)
    vocab = 480 if args.quick or model != PEER_MODEL else 49152
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    print(f"model {model}, {args.requests} requests of {args.input_len} in / "
          f"{args.output_len} out, {args.max_num_seqs} at a time, rank {args.rank}")
    results = {label: run_case(model, adapters, paths, prompts, args)
               for label, adapters in CASES}
    ref = results[CASES[0][0]]
    rows = [[label, f"{r['tok_s']:.1f}", f"{r['tok_s'] / ref['tok_s']:.2f}x",
             f"{r['tpot_ms']:.1f}", f"{r['tpot_ms'] / ref['tpot_ms']:.2f}x",
             f"{r['ttft_ms']:.0f}", f"{r['ttft_ms'] / ref['ttft_ms']:.2f}x"]
            for label, r in results.items()]
    print(format_table(["case", "out tok/s", "vs base", "TPOT p50 ms", "vs base",
                        "TTFT p50 ms", "vs base"], rows))
    disk, host = load_times(model, paths, args.rank)
    print(f"adapter load, median of {len(paths)}: from disk {1e3 * disk:.1f} ms "
          f"(read + check + digest), from host memory into a slot {1e3 * host:.2f} ms")


if __name__ == "__main__":
    main()
