"""Where a worker's threads compute: ``python -m pdserve.bench.compute_threads [--model DIR]
[--dtype bfloat16] [--threads 2] [--prompt 256] [--rounds 9] [--quick]``. Prints; never asserts.

The forward time of one prompt's step (no prefix cache) in three arrangements, each in a fresh
process (the thread counts are process-wide state):

* ``one thread``: the engine built and stepped on one thread, on one OpenMP thread;
* ``built here, stepped there``: built at ``--threads`` on the process's first thread, stepped
  on another, as a worker actor did before ``engine.compute_threads``: two threads each keep an
  OpenMP pool;
* ``compute_threads``: built on a thread that ends with its pool, stepped on a thread that
  claims ``--threads`` (``compute_threads.claim``), as a worker actor does now.

With ``--gemms``, also oneDNN's GEMMs of those steps per weight shape (torch.profiler, us a
call) one thread against ``compute_threads``: which of them split over the threads.

Without ``--model``, a random Llama of SmolLM2-135M's shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from pdserve.bench.cpu_dtypes import SMOLLM2_SHAPE, build_engine
from pdserve.bench.engine import prompt_step, write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine import compute_threads
from pdserve.engine.llm_engine import LLMEngine

ARRANGEMENTS = ("one thread", "built here, stepped there", "compute_threads")
QUICK_SHAPE = dict(SMOLLM2_SHAPE, num_hidden_layers=2, vocab_size=512)


def forward_ms(engine: LLMEngine, prompt_len: int, rounds: int) -> list[float]:
    """The forward ms of ``rounds`` steps of one prompt each, after two not counted."""
    times = [prompt_step(engine, f"p{r}", 1, prompt_len, False)[0] * 1e3
             for r in range(rounds + 2)]
    return times[2:]


def timed(engine: LLMEngine, prompt_len: int, rounds: int, gemms: bool) -> dict:
    """{"times": forward ms of each step, "gemms": {weight shape: oneDNN us a call}} (the
    GEMMs profiled with ``gemms`` only)."""
    if not gemms:
        return {"times": forward_ms(engine, prompt_len, rounds), "gemms": {}}
    with torch.profiler.profile(record_shapes=True) as prof:
        times = forward_ms(engine, prompt_len, rounds)
    calls = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key == "mkldnn::_linear_pointwise" and len(event.input_shapes) > 1:
            out_features, in_features = event.input_shapes[1]
            calls[f"{out_features}x{in_features}"] = event.cpu_time_total / event.count
    return {"times": times, "gemms": calls}


def measure(arrangement: str, model: Path, dtype: str, threads: int, prompt_len: int,
            rounds: int, gemms: bool = False) -> dict:
    """In this process (a fresh one): :func:`timed` of ``arrangement``."""
    result: list[dict] = []
    if arrangement == "one thread":
        torch.set_num_threads(1)
        return timed(build_engine(model, dtype), prompt_len, rounds, gemms)
    torch.set_num_threads(threads)
    if arrangement == "built here, stepped there":
        engine = build_engine(model, dtype)
        stepper = threading.Thread(target=lambda: result.append(
            timed(engine, prompt_len, rounds, gemms)))
    else:
        engine = compute_threads.on_own_thread(build_engine, model, dtype)

        def claimed() -> None:
            compute_threads.claim(threads)
            result.append(timed(engine, prompt_len, rounds, gemms))

        stepper = threading.Thread(target=claimed)
    stepper.start()
    stepper.join()
    return result[0]


def run_fresh(arrangement: str, args) -> dict:
    command = [sys.executable, "-m", "pdserve.bench.compute_threads", "--model", args.model,
               "--dtype", args.dtype, "--threads", str(args.threads), "--prompt",
               str(args.prompt), "--rounds", str(args.rounds), "--arrangement", arrangement,
               *(["--gemms"] if args.gemms else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a random "
                                                       "Llama of SmolLM2-135M's shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="two layers, short prompts")
    parser.add_argument("--gemms", action="store_true",
                        help="also oneDNN's time a call per weight shape")
    parser.add_argument("--arrangement", choices=ARRANGEMENTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arrangement:  # the child: one arrangement, its times as JSON
        print(json.dumps(measure(args.arrangement, Path(args.model), args.dtype, args.threads,
                                 args.prompt, args.rounds, args.gemms)))
        return
    if args.quick:
        args.prompt, args.rounds = min(args.prompt, 48), min(args.rounds, 3)  # past the panel
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(write_random_llama(Path(tmp) / "llama",
                                                **(QUICK_SHAPE if args.quick else SMOLLM2_SHAPE)))
        results = {arrangement: run_fresh(arrangement, args) for arrangement in ARRANGEMENTS}
    rows = []
    for arrangement, result in results.items():
        times = result["times"]
        rows.append([arrangement, 1 if arrangement == "one thread" else args.threads,
                     statistics.median(times), min(times), max(times)])
    print(f"{args.dtype}, prompts of {args.prompt} tokens, {args.rounds} steps each")
    print(format_table(["arrangement", "threads", "forward ms median", "min", "max"], rows))
    if args.gemms:
        one, split = results["one thread"]["gemms"], results["compute_threads"]["gemms"]
        print(format_table(["weight (out x in)", "1 thread us", f"{args.threads} threads us",
                            "speed-up"],
                           [[shape, one[shape], split[shape], one[shape] / split[shape]]
                            for shape in one if shape in split]))


if __name__ == "__main__":
    main()
