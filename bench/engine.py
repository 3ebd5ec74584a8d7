"""Engine benchmark: ``python -m pdserve.bench.engine [--quick] [--model DIR] [--context N]
[--batches B ...]``. Prints; never asserts.

In one run:
1. decode step time against the memory roofline (bytes read per step / read bandwidth measured
   now) on a random ~100M-parameter Llama (or the ``--model`` checkpoint) at batch 1, 8, 32
   (``--batches``), each sequence decoding after a prompt of ``--context`` tokens (128; longer
   contexts weigh the decode attention's reads), in fp32 (linear layers packed for oneDNN with
   a decode step's rows through the C panel GEMM, the default, through oneDNN, and plain;
   decode attention in C, the default where it builds, and in torch) and bf16 (packed for
   oneDNN, the default where the CPU has its bf16 kernels, and plain; ``python -m
   pdserve.bench.cpu_dtypes`` sets the two dtypes side by side, with prefill);
2. engine overhead per step (everything outside the model forward) at batch 64 and 256 on a
   tiny model, with prompts of one length and of spread lengths, greedy and sampled, and on
   a tiny Mistral with a sliding window on the persistent rows and on the general path (the
   median of three interleaved rounds, and their range), what a request joining the decode
   rows costs, and what arrivals cost a colocated worker's decode steps;
3. tokens/s of continuous batching against Hugging Face ``generate`` with static batches on the
   same requests with long-tailed output lengths;
4. the forward time of a step of one and of seven whole prompts of 256 tokens, and of seven
   beside a running request's decode, in fp32 and bf16 (``--prefill-only``: this alone).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.stats import format_table, lognormal_lengths
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.decode_rows import DecodeRows
from pdserve.kernels import cpu_decode_layers, cpu_panel_gemm
from pdserve.testing import general_steps
from pdserve.worker_api.sampling_params import SamplingParams

LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                  max_position_embeddings=2048, tie_word_embeddings=True)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=2048)


def write_random_llama(path: Path, **config) -> Path:
    # lazy: transformers (seconds to import; a test dependency) only for the Hugging Face reference
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
    model.save_pretrained(path)
    return path


def write_random_mistral(path: Path, sliding_window: int, **config) -> Path:
    """A random Mistral checkpoint (``config`` as for Llama, without tied embeddings) whose
    attention has a sliding window."""
    # lazy: transformers (seconds to import; a test dependency) only for the Hugging Face reference
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**config, sliding_window=sliding_window))
    model.to(torch.float32).save_pretrained(path)
    return path


def measure_read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of reading a large buffer (a sum reduction), best of ``repeats``."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_time(x.sum, repeats)


def measure_linear(dtype: torch.dtype, rows: int, repeats: int = 5) -> tuple[float, float]:
    """(weight bytes/s, FLOP/s) of torch's own ``linear`` with ``rows`` input rows against a
    32000 x 768 weight: the GEMV (rows=1) and GEMM ceilings the model forward runs on."""
    weight = torch.randn(32000, 768).to(dtype)
    x = torch.randn(rows, 768).to(dtype)
    seconds = _best_time(lambda: torch.nn.functional.linear(x, weight), repeats)
    return weight.numel() * weight.element_size() / seconds, 2 * rows * weight.numel() / seconds


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def decode_steps(engine: LLMEngine, batch: int, prompt_len: int, steps: int,
                 render_s: list[float] | None = None, spread: int = 1,
                 sampling: dict | None = None) -> list:
    """Run ``batch`` requests to decode and return StepStats of ``steps`` pure decode steps;
    request ``i``'s prompt has ``prompt_len + i % spread`` tokens (``spread`` 1: every row
    enters a new block in the same step; the block size: a few rows do in every step), and
    it decodes greedily or with ``sampling`` (SamplingParams fields; seed ``i``).
    ``render_s`` gets the time of rendering each step's deltas and reading each of them as a
    RequestDelta (the reader's side: a worker's poll renders, the router reads). Every row
    decodes every step (``Scheduler.max_decode_rows`` off): a step of ``batch`` is measured."""
    engine.scheduler.max_decode_rows = None
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True,
                                **(dict(sampling, seed=i) if sampling else {"temperature": 0.0}))
        engine.add_request(f"d{i}", [(7 * i + j) % 500 + 1
                                     for j in range(prompt_len + i % spread)], params)
    sched = engine.scheduler
    while any(s.num_output_tokens == 0 for s in [*sched.running, *sched.waiting]):
        engine.step()
    stats = []
    for _ in range(steps):
        deltas = engine.step()
        stats.append(engine.last_step)
        start = time.perf_counter()
        for _ in engine.render(deltas):
            pass
        if render_s is not None:
            render_s.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return stats


# (dtype, GEMM, attention, fused): "panel" is the default on CPU (oneDNN's packed weights, a
# decode step's few rows through pdserve's C panel GEMM where it beats oneDNN: AVX-512 in
# float32, AMX in bf16), "onednn" the same packed weights with every row through oneDNN,
# "plain" unpacked weights through F.linear; fused: a decode step's layers in one C call where
# the model and step allow (kernels/cpu_decode_layers; the default), else the unfused forward
ROOFLINE_VARIANTS = (("float32", "panel", "auto", True), ("float32", "panel", "auto", False),
                     ("float32", "onednn", "auto", False), ("float32", "panel", "torch", False),
                     ("float32", "plain", "auto", False), ("bfloat16", "panel", "auto", True),
                     ("bfloat16", "panel", "auto", False), ("bfloat16", "onednn", "auto", False),
                     ("bfloat16", "plain", "auto", False))


@contextlib.contextmanager
def _rows_through_onednn(on: bool):
    """While on, the C panel GEMM takes no call: every row of a packed layer goes to oneDNN."""
    before = cpu_panel_gemm.MAX_ROWS
    cpu_panel_gemm.MAX_ROWS = 0 if on else before
    try:
        yield
    finally:
        cpu_panel_gemm.MAX_ROWS = before


def roofline_table(model_dir: Path, bandwidth: float, batches: list[int], steps: int,
                   repeats: int = 5, prompt_len: int = 128) -> str:
    """Decode step vs the roofline max(bytes read / bandwidth, FLOPs / peak matmul rate), with
    the bandwidth of a plain read and, as the achievable ceiling, of torch's own GEMV (each
    ceiling the best of ``repeats`` timings); each of ROOFLINE_VARIANTS in the same run."""
    rows = []
    ceilings: dict[torch.dtype, tuple[float, float]] = {}  # torch's own, one per dtype
    for dtype, gemm, attention, fused in ROOFLINE_VARIANTS:
        blocks = max(4096, 2 * max(batches) * (prompt_len + steps) // 16)  # twice, at blocks of 16
        parts = EngineParts.build(EngineConfig(model=str(model_dir), dtype=dtype,
                                               num_kv_blocks=blocks, max_num_seqs=256,
                                               max_num_batched_tokens=max(2048, prompt_len),
                                               cpu_packed_gemm=gemm != "plain",
                                               attention_backend=attention))
        engine = LLMEngine(parts)
        model = parts.runner.model
        if not fused:
            model.fuses_decode = False
        model_dtype = model.dtype
        if model_dtype not in ceilings:  # the same torch linear for every variant of a dtype
            ceilings[model_dtype] = (measure_linear(model_dtype, 1, repeats)[0],
                                     measure_linear(model_dtype, 512, repeats)[1])
        gemv_bw, peak_flops = ceilings[model_dtype]
        params = parts.model_config.num_parameters()
        for batch in batches:
            with _rows_through_onednn(gemm == "onednn"):
                stats = sorted(decode_steps(engine, batch, prompt_len, steps),
                               key=lambda s: s.total_s)
            median = stats[len(stats) // 2]
            kv_read = batch * (prompt_len + steps // 2) * parts.ledger.kv_bytes_per_token
            bytes_read = parts.ledger.weight_bytes + kv_read
            compute_s = 2 * params * batch / peak_flops
            roof = max(bytes_read / bandwidth, compute_s)
            achievable = max(bytes_read / gemv_bw, compute_s)
            gemm_used = (gemm if gemm != "panel" or cpu_panel_gemm.beats_onednn(model_dtype)
                         else "onednn")
            fused_ran = (fused and batch <= cpu_decode_layers.MAX_ROWS[model_dtype]
                         and bool(model.fuses_decode))
            rows.append([dtype, gemm_used, parts.runner.backend, "yes" if fused_ran else "no",
                         batch,
                         median.total_s * 1e3,
                         f"{1 - median.forward_s / median.total_s:.1%}", roof * 1e3,
                         median.total_s / roof, achievable * 1e3, median.total_s / achievable,
                         batch / median.total_s])
    return format_table(["dtype", "GEMM", "attention", "fused", "batch", "step ms", "outside fwd",
                         "roofline ms", "x roofline", "gemv-roof ms", "x gemv-roof", "tok/s"],
                        rows)


WINDOW = 32  # the sliding window of section 2's Mistral, in tokens: its rows free blocks
SAMPLED = {"temperature 0.8": {"temperature": 0.8},
           "temperature 0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
           "temperature 0.8, top-k 50": {"temperature": 0.8, "top_k": 50}}


def overhead_table(model_dir: Path, windowed_dir: Path, batches: list[int], steps: int,
                   rounds: int = 3) -> str:
    """Time outside the forward per pure decode step: greedy with the prompts all of one
    length (the rows enter their blocks in lockstep) and spread over a block's worth of
    lengths, then sampled (spread lengths, the first batch size), then greedy on
    ``windowed_dir`` (a sliding window of WINDOW tokens) on the rows and on the general path.
    The cases run in ``rounds`` interleaved rounds (the machine's speed drifts); each prints
    its median round and the range of its overhead."""
    shortest = 16  # prompt tokens
    parts, windowed = (EngineParts.build(EngineConfig(
        model=str(d), num_kv_blocks=8192, max_num_seqs=512, max_num_batched_tokens=8192))
        for d in (model_dir, windowed_dir))
    block_size = parts.block_manager.block_size
    cases = [(parts, batch, spread, "greedy", None, True)
             for batch in batches for spread in (1, block_size)]
    cases += [(parts, batches[0], block_size, name, kw, True) for name, kw in SAMPLED.items()]
    cases += [(windowed, batches[0], block_size, f"greedy, window {WINDOW}{suffix}", None,
               on_rows) for suffix, on_rows in (("", True), (", general path", False))]
    runs: list[list[tuple]] = [[] for _ in cases]
    for _ in range(rounds):
        for case, (model, batch, spread, _name, sampling, on_rows) in enumerate(cases):
            runs[case].append(_overhead_run(model, batch, shortest, steps, spread, sampling,
                                            on_rows))
    rows = []
    for (_, batch, spread, name, *_), measured in zip(cases, runs, strict=True):
        measured.sort(key=lambda run: run[2])  # by overhead
        step_ms, outside_ms, overhead, median_ms, render_ms = measured[len(measured) // 2]
        lengths = f"{shortest}-{shortest + spread - 1}" if spread > 1 else str(shortest)
        spread_text = f"{measured[0][2]:.1%}-{measured[-1][2]:.1%}"
        rows.append([batch, lengths, name, step_ms, outside_ms, f"{overhead:.1%}", spread_text,
                     median_ms, render_ms])
    return format_table(["batch", "prompt tokens", "decoding", "step ms", "outside forward ms",
                         "overhead", f"range ({rounds} rounds)", "median outside ms",
                         "render ms (reader)"], rows)


def _overhead_run(parts: EngineParts, batch: int, prompt_len: int, steps: int, spread: int,
                  sampling: dict | None, rows: bool = True) -> tuple:
    """(step ms, outside-forward ms, overhead fraction, median outside ms, render ms) of one
    run of ``decode_steps`` on a fresh engine (``rows`` False: every step on the general
    path)."""
    render_s: list[float] = []
    engine = general_steps.engine(parts, rows=rows)
    stats = decode_steps(engine, batch, prompt_len, steps, render_s, spread, sampling)
    total = sum(s.total_s for s in stats)
    forward = sum(s.forward_s for s in stats)
    outside = sorted(s.total_s - s.forward_s for s in stats)
    return (total / len(stats) * 1e3, (total - forward) / len(stats) * 1e3,
            (total - forward) / total, outside[len(outside) // 2] * 1e3,
            sum(render_s) / len(render_s) * 1e3)


def join_sync_line(model_dir: Path, batch: int = 64, repeats: int = 300) -> str:
    """What one request joining ``batch`` decode rows costs the rows' sync: appended after
    them (a decode worker's join), mapped by identity (a join with a finish, or a step the
    scheduler made in full), read afresh (every row new)."""
    parts = EngineParts.build(EngineConfig(model=str(model_dir), num_kv_blocks=4096,
                                           max_num_seqs=batch + 1))
    engine = LLMEngine(parts)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(batch + 1):
        engine.add_request(f"j{i}", [(5 * i + j) % 500 + 1 for j in range(20)], params)
    engine.step()  # every prompt in one step: each sequence has one token left
    seqs = list(engine.scheduler.running)
    empty = DecodeRows(parts.block_manager.block_size)
    base = copy.copy(empty)
    base.sync(seqs[:batch], 1)
    cases = {"appended": (base, seqs, 2), "mapped": (base, [*seqs[:batch - 1], seqs[batch]], -1),
             "read afresh": (empty, seqs, -1)}
    cells = []
    for name, (rows, new, version) in cases.items():
        start = time.perf_counter()
        for _ in range(repeats):
            copy.copy(rows).sync(new, version)
        cells.append(f"{name} {(time.perf_counter() - start) / repeats * 1e6:.0f} us")
    return f"one join to {batch} decode rows, the rows' sync: " + ", ".join(cells)


def arrivals_line(model_dir: Path, batch: int = 64, every: int = 8, steps: int = 160) -> str:
    """What arrivals cost the decode rows on a colocated worker: a request joins ``batch``
    decoding rows every ``every`` steps, so its prefill runs beside them in a step the
    scheduler makes in full, and the rows step after it syncs the rows by identity; medians
    outside the forward of those rows steps and of the others (a decode worker's joins take
    neither)."""
    parts = EngineParts.build(EngineConfig(model=str(model_dir), num_kv_blocks=4096,
                                           max_num_seqs=batch + 8))
    engine = LLMEngine(parts)
    engine.scheduler.max_decode_rows = None  # (every row every step)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 1 for j in range(16 + i % 16)], params)
    engine.step()
    after, other, general = [], [], False
    for k in range(steps):
        if k % every == 0:
            engine.add_request(f"a{k}", [(3 * k + j) % 500 + 1 for j in range(20)],
                               SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        engine.render(engine.step())
        s = engine.last_step
        if s.num_tokens == s.num_seqs:  # a rows step
            (after if general else other).append((s.total_s - s.forward_s) * 1e6)
        general = s.num_tokens != s.num_seqs
    after.sort()
    other.sort()
    return (f"arrivals beside {batch} decode rows (one every {every} steps, colocated): the rows "
            f"step after each prefill {after[len(after) // 2]:.0f} us outside the forward, "
            f"the other rows steps {other[len(other) // 2]:.0f} us (medians)")


def hf_static_tokens_per_s(model_dir: Path, prompts, max_tokens, batch_size: int) -> float:
    # lazy: transformers (seconds to import; a test dependency) only for the Hugging Face reference
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, lens = prompts[i:i + batch_size], max_tokens[i:i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                           min_new_tokens=max(lens), pad_token_id=0)
        useful += sum(lens)
    return useful / (time.perf_counter() - start)


def batching_table(model_dir: Path, num_requests: int, mean_out: int, hf_batches: list[int],
                   repeats: int = 3) -> str:
    """Output tokens/s on the same requests: ours (all admitted, continuous batching) against
    HF ``generate`` in static batches of each size in ``hf_batches``; medians of ``repeats``
    interleaved runs, so the machine's noise hits every system alike."""
    rng = random.Random(0)
    prompt_lens = lognormal_lengths(rng, num_requests, mean=64, high=512)
    max_tokens = lognormal_lengths(rng, num_requests, mean=mean_out, high=4 * mean_out)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in prompt_lens]
    # no prefix cache: each repetition would find the prompts the one before cached, which
    # Hugging Face computes again every time
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=8192, enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]

    def ours() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return sum(max_tokens) / (time.perf_counter() - start)

    systems = {"pdserve continuous": ours} | {
        f"HF generate static (batch {b})":
            (lambda b=b: hf_static_tokens_per_s(model_dir, prompts, max_tokens, b))
        for b in hf_batches}
    runs: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, run in systems.items():
            runs[name].append(run())
    medians = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}
    ours_rate = medians["pdserve continuous"]
    table = format_table(["system", "output tok/s", "pdserve / this"],
                         [[name, rate, ours_rate / rate] for name, rate in medians.items()])
    return f"{table}\n{step_profile(llm.engine, prompts, params)}"


def step_profile(engine: LLMEngine, prompts, params) -> str:
    """Where pdserve's run of the batching workload spends its steps (one more run, untimed
    in the table): the long tail of output lengths leaves few sequences per decode step, so
    the forward's fixed cost per step, not the per-sequence overhead, sets the rate."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"profile-{i}", prompt, p)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    decode = [s for s in steps if s.num_tokens == s.num_seqs]
    total = sum(s.total_s for s in steps)
    return (f"pdserve's steps: {len(steps)}, {len(decode)} of them pure decode with "
            f"{sum(s.num_seqs for s in decode) / max(1, len(decode)):.1f} sequences on average; "
            f"the forward is {sum(s.forward_s for s in steps) / total:.0%} of step time")


# (label, prompts in the step, a running request decoding beside them)
PREFILL_STEPS = (("1 prompt", 1, False), ("7 prompts", 7, False),
                 ("1 decode + 7 prompts", 7, True))


def prefill_table(model_dir: Path, prompt_len: int, repeats: int = 3) -> str:
    """The forward time of a step of whole prompts of ``prompt_len`` tokens (no prefix cache),
    alone and beside a running request's decode (a mixed step), per dtype: the median of
    ``repeats``."""
    rows = []
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineParts.build(EngineConfig(
            model=str(model_dir), dtype=dtype, num_kv_blocks=4096, max_num_seqs=256,
            enable_prefix_caching=False, max_num_batched_tokens=max(2048, 8 * prompt_len))))
        for label, num_prompts, beside_decode in PREFILL_STEPS:
            steps = sorted(prompt_step(engine, f"{label}-{r}", num_prompts, prompt_len,
                                       beside_decode) for r in range(repeats))
            forward_s, num_seqs = steps[len(steps) // 2]
            rows.append([dtype, label, num_seqs, num_prompts * prompt_len, forward_s * 1e3,
                         num_prompts * prompt_len / forward_s])
    return format_table(["dtype", "step", "seqs", "prompt tokens", "forward ms",
                         "prompt tok/s"], rows)


def prompt_step(engine: LLMEngine, tag: str, num_prompts: int, prompt_len: int,
                beside_decode: bool) -> tuple[float, int]:
    """The forward seconds and sequences of one step that takes ``num_prompts`` whole prompts
    (and, with ``beside_decode``, a running request's next token)."""
    if beside_decode:
        engine.add_request(f"{tag}-running", [(3 * j) % 500 + 1 for j in range(prompt_len)],
                           SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
        engine.step()  # its prompt; the step below decodes it
    for i in range(num_prompts):
        engine.add_request(f"{tag}-{i}", [(7 * i + j) % 500 + 1 for j in range(prompt_len)],
                           SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()
    step = engine.last_step
    while engine.has_unfinished_requests():
        engine.step()
    return step.forward_s, step.num_seqs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--model", help="a checkpoint folder for section 1 instead of the "
                                        "random ~100M Llama")
    parser.add_argument("--roofline-only", action="store_true", help="section 1 alone")
    parser.add_argument("--prefill-only", action="store_true", help="section 4 alone")
    parser.add_argument("--context", type=int, default=128,
                        help="section 1: the prompt tokens each sequence decodes after")
    parser.add_argument("--batches", type=int, nargs="+",
                        help="section 1's batch sizes (default 1 8 32; --quick 1 8)")
    args = parser.parse_args(argv)
    if args.context < 1:
        parser.error(f"--context must be at least 1, got {args.context}")
    if args.batches is not None and min(args.batches) < 1:
        parser.error(f"--batches must be at least 1, got {min(args.batches)}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_random_llama(Path(tmp) / "tiny", **LLAMA_TINY)
        if args.model:
            big, big_name = Path(args.model), args.model
        elif args.quick:  # the smoke run's section 1 reads the tiny model too
            big, big_name = tiny, "random tiny Llama"
        else:
            big = write_random_llama(Path(tmp) / "llama100m", **LLAMA_100M)
            big_name = "random ~100M Llama"
        windowed = write_random_mistral(Path(tmp) / "windowed", WINDOW, **LLAMA_TINY)
        if args.prefill_only:
            print(f"4. prefill steps ({big_name})")
            print(prefill_table(big, 32 if args.quick else 256, 1 if args.quick else 3))
            return
        bandwidth = measure_read_bandwidth(1 << 26 if args.quick else 1 << 29)
        print(f"threads {torch.get_num_threads()}, measured read bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s\n")
        print(f"1. decode step vs memory roofline ({big_name}, prompts of {args.context} "
              "tokens)")
        print(roofline_table(big, bandwidth,
                             args.batches or ([1, 8] if args.quick else [1, 8, 32]),
                             4 if args.quick else 16, 1 if args.quick else 5, args.context))
        if args.roofline_only:
            return
        print("\n2. engine overhead per decode step (tiny model)")
        print(overhead_table(tiny, windowed, [8, 64] if args.quick else [64, 256],
                             4 if args.quick else 64,
                             1 if args.quick else 3))
        print(join_sync_line(tiny, 8 if args.quick else 64))
        print(arrivals_line(tiny, 8 if args.quick else 64, 4 if args.quick else 8,
                            24 if args.quick else 160))
        print("\n3. continuous batching vs Hugging Face static batching (tiny model)")
        print(batching_table(tiny, 16 if args.quick else 64, 16 if args.quick else 64,
                             [8] if args.quick else [16, 64], 1 if args.quick else 3))
        print(f"\n4. prefill steps ({big_name})")
        print(prefill_table(big, 32 if args.quick else 256, 1 if args.quick else 3))


if __name__ == "__main__":
    main()
