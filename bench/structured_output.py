"""Structured output benchmark: ``python -m pdserve.bench.structured_output [--quick]
[--model DIR]``. Prints; never asserts.

In one run, on the built-in tiny Llama (random weights, vocabulary 512) or the ``--model``
checkpoint (its own tokenizer, e.g. SmolLM2's 49,152 tokens: the grammar's token mask scales
with the vocabulary):

1. what a constraint costs before its first token: a fresh engine's first constrained
   request (the grammar engine's import and set-up, and the compile), a new schema on that
   engine, and a schema it compiled before (its cache: a new matcher only), each through
   ``LLMEngine.then_prepared`` as a worker makes them.
2. decode step time with 0, 1 and all of 8 and 32 rows constrained by a JSON schema, as a
   ratio to the same batch unconstrained: the median step of each variant, the variants
   interleaved round by round, the ratio of medians over rounds. The schema (a string field
   with a long ``minLength``) keeps every row decoding for the whole measurement.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from pdserve.bench.stats import format_table
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.models.tiny import tiny_model_dir
from pdserve.worker_api import WorkRequest
from pdserve.worker_api.sampling_params import SamplingParams

# every row keeps writing the string for as long as the measurement runs
LONG_SCHEMA = {"type": "object", "properties": {"log": {"type": "string", "minLength": 4000}},
               "required": ["log"], "additionalProperties": False}
OTHER_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "age"]}


def _engine(model_dir: Path, batch: int) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype="float32", block_size=16,
        num_kv_blocks=batch * 8 + 16, max_num_seqs=max(batch, 8)))


def step_times(engine: LLMEngine, batch: int, num_constrained: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` pure decode steps of ``batch`` greedy rows, the first
    ``num_constrained`` of them under LONG_SCHEMA (the engine is left empty)."""
    for i in range(batch):
        outputs = {"json": LONG_SCHEMA} if i < num_constrained else None
        engine.add_request(f"r{i}", [(7 * i + j) % 400 + 1 for j in range(16)], SamplingParams(
            max_tokens=steps + 8, temperature=0.0, ignore_eos=True,
            structured_outputs=outputs))
    sched = engine.scheduler
    while any(s.num_output_tokens == 0 for s in [*sched.running, *sched.waiting]):
        engine.step()
    times = []
    for _ in range(steps):
        engine.step()
        if engine.last_step.num_seqs != batch:
            raise RuntimeError(f"a row left before the measurement ended "
                               f"({engine.last_step.num_seqs} of {batch})")
        times.append(engine.last_step.total_s)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def step_table(model_dir: Path, batches: list[int], steps: int, rounds: int) -> str:
    rows = []
    for batch in batches:
        engine = _engine(model_dir, batch)
        variants = {"none": 0, "1 row": 1, f"all {batch}": batch}
        step_times(engine, batch, batch, 4)  # warm-up: the grammar engine, the schema
        medians: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, k in variants.items():
                medians[name].append(statistics.median(step_times(engine, batch, k, steps)))
        base = statistics.median(medians["none"])
        for name in variants:
            median = statistics.median(medians[name])
            rows.append([batch, name, f"{median * 1e3:.2f}", f"{median / base:.3f}"])
        engine.close()
    return format_table(["batch", "constrained rows", "median step (ms)", "vs none"], rows)


def _time_constraint(engine: LLMEngine, schema: dict) -> float:
    """Seconds until a worker could use a matcher for ``schema`` (compile included)."""
    params = SamplingParams(structured_outputs={"json": schema})
    start = time.perf_counter()

    def ready(_constraint) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done

    engine.then_prepared(WorkRequest("compile", [1], params, 0, 0.0), ready).result(120)
    return time.perf_counter() - start


def compile_lines(model_dir: Path) -> str:
    engine = _engine(model_dir, 8)
    first = _time_constraint(engine, OTHER_SCHEMA)
    new = _time_constraint(engine, LONG_SCHEMA)
    cached = min(_time_constraint(engine, OTHER_SCHEMA) for _ in range(20))
    engine.close()
    return (f"first constrained request of a fresh engine (grammar engine set-up + compile): "
            f"{first * 1e3:.0f} ms\na new schema on that engine: {new * 1e3:.1f} ms\n"
            f"a schema compiled before (cache hit, a new matcher): {cached * 1e6:.0f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--model", help="a checkpoint folder instead of the random tiny Llama")
    parser.add_argument("--steps", type=int, default=32, help="measured steps per variant")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the variants")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else tiny_model_dir(Path(tmp))
        print(f"model {args.model or 'random tiny Llama (vocabulary 512)'}, "
              f"threads {torch.get_num_threads()}\n")
        print("1. a constraint's cost before its first token")
        print(compile_lines(model_dir))  # (first: the process has not loaded xgrammar yet)
        print("\n2. decode step time with rows under a JSON schema, against none")
        print(step_table(model_dir, [8] if args.quick else [8, 32],
                         4 if args.quick else args.steps, 1 if args.quick else args.rounds))


if __name__ == "__main__":
    main()
