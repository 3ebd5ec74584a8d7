"""``pdserve plan`` on this machine: choose the hardware from the flags, and with ``--measure``
run the real engine here and hold the plan against it.

:func:`measure` builds the engine on the planned budget (the engine's own margin), then:

1. KV blocks: the engine's allocated blocks against the planner's (they must be equal: both
   go through ``engine.capacity.memory``'s per-block bytes and activation estimate);
2. decode: one short sequence (the step is the weights streaming through), then ``batch``
   requests at ``context`` tokens (capped to what a CPU does in seconds): the median forward
   time of pure decode steps against the roofline at the same batch and context, both at the
   measured copy bandwidth and at what a one-row ``linear`` streams here (on CPUs far less),
   and the whole step (scheduling, sampling, bookkeeping included);
3. prefill: one ``PREFILL_TOKENS`` prompt in one step (median of three), forward time against
   the prediction.

Predictions use this machine's measured peaks (matmul rate in the serving dtype, copy
bandwidth; each the best of the planner's probe and one more after the engine ran, since other
work on the machine makes a probe read low) at MFU 1 unless ``--mfu`` says otherwise: the peak
is what this machine reaches on a large matmul, so what is left between prediction and
measurement is the model's smaller shapes, attention, non-matmul work and per-step overhead.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from pdserve.bench.plan import (
    PREFILL_TOKENS,
    Hardware,
    PlanRequest,
    accelerators,
    find_accelerator,
    measured_hardware,
    roofline_ms,
)
from pdserve.engine.capacity.roofline import StepCost, copy_bandwidth, gemv_bandwidth, matmul_rate
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.worker_api.sampling_params import SamplingParams

GiB = 1 << 30
MEASURE_BATCH = 16  # decode batch measured at most
MEASURE_CONTEXT = 512  # decode context measured at most
SHORT_CONTEXT = 16  # the weights-only decode row: one sequence this long
DECODE_STEPS = 8


def choose_hardware(device: str | None, hbm_gib: float | None, hbm_gbps: float | None,
                    tflops: float | None, dtype: torch.dtype, measure: bool = False) -> Hardware:
    """The hardware the flags name (ValueError naming the flags when they conflict or name
    none). This machine is measured only when asked: ``--device cpu|cuda`` or ``--measure``;
    ``--hbm-gib`` alone takes the catalogue's card of that memory (or asks which)."""
    figures = (hbm_gib, hbm_gbps, tflops)
    memory = None if hbm_gib is None else int(hbm_gib * GiB)
    if device is not None and device.lower() in ("cpu", "cuda"):
        if device.lower() == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA device")
        return measured_hardware(device.lower(), dtype, memory)
    if device is not None:
        hw = find_accelerator(device)
        return Hardware(hw.name, memory or hw.memory_bytes,
                        hbm_gbps * 1e9 if hbm_gbps else hw.bandwidth_bytes_per_s,
                        tflops * 1e12 if tflops else hw.peak_flops_per_s, hw.source)
    if all(f is not None for f in figures):
        return Hardware("given", memory, hbm_gbps * 1e9, tflops * 1e12,
                        "--hbm-gib/--hbm-gbps/--tflops")
    if hbm_gbps is not None or tflops is not None:
        raise ValueError("arguments --hbm-gib, --hbm-gbps, --tflops: give all three, or "
                         "--device")
    if measure:
        return measured_hardware("cuda" if torch.cuda.is_available() else "cpu", dtype, memory)
    if hbm_gib is not None:
        return accelerator_with_memory(hbm_gib)
    raise ValueError(f"argument --device: name the hardware to plan for "
                     f"({', '.join(accelerators())}), give --hbm-gib/--hbm-gbps/--tflops, or "
                     "--measure to measure this machine")


def accelerator_with_memory(hbm_gib: float, tolerance: float = 0.03) -> Hardware:
    """The one catalogue card whose memory is ``hbm_gib`` (within ``tolerance``); when none or
    several are, a device of that memory whose speed is unknown: the plan's memory answer
    needs nothing more, its time estimates are left out."""
    matches = [hw for hw in accelerators().values()
               if abs(hw.memory_bytes / GiB - hbm_gib) <= tolerance * hbm_gib]
    if len(matches) == 1:
        hw = matches[0]
        return Hardware(hw.name, hw.memory_bytes, hw.bandwidth_bytes_per_s,
                        hw.peak_flops_per_s, f"the catalogue's {hbm_gib:g} GiB card; {hw.source}")
    names = ", ".join(hw.name for hw in matches) or "no card in the catalogue"
    return Hardware(f"{hbm_gib:g} GiB device", int(hbm_gib * GiB), None, None,
                    f"--hbm-gib {hbm_gib:g} (matches {names}); for time estimates name the "
                    f"card with --device NAME, or give --hbm-gbps and --tflops too")


def _engine(req: PlanRequest, hw: Hardware, margin: float):
    config = EngineConfig(model=req.model, dtype=req.dtype, device=hw.device,
                          kv_cache_dtype=req.kv_cache_dtype, block_size=req.block_size,
                          max_model_len=req.max_model_len, memory_budget_bytes=hw.memory_bytes,
                          memory_safety_margin=margin,
                          max_num_batched_tokens=req.max_num_batched_tokens,
                          max_num_seqs=req.max_num_seqs, enable_prefix_caching=False)
    engine = LLMEngine(EngineParts.build(config))
    engine.scheduler.max_decode_rows = None  # (a step of every row is what is measured)
    return engine


def _decode_forward(engine, batch: int, context: int) -> tuple[float, float]:
    """Median (forward s, whole step s) of pure decode steps at ``batch`` x ``context``."""

    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
    prompt_len = context - 1 - DECODE_STEPS // 2  # the median step runs at ``context``
    vocab = engine.parts.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"d{i}", [(7 * i + j) % (vocab - 3) + 3 for j in range(prompt_len)],
                           params)
    sched = engine.scheduler
    while any(s.num_output_tokens == 0 for s in [*sched.running, *sched.waiting]):
        engine.step()
    steps = []
    for _ in range(DECODE_STEPS):
        engine.step()
        steps.append(engine.last_step)
    while engine.has_unfinished_requests():
        engine.step()
    return (statistics.median(s.forward_s for s in steps),
            statistics.median(s.total_s for s in steps))


def _prefill_forward(engine, tokens: int, repeats: int = 3) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.parts.model_config.vocab_size
    times = []
    for r in range(repeats + 1):  # the first warms up
        engine.add_request(f"p{r}", [(11 * r + j) % (vocab - 3) + 3 for j in range(tokens)],
                           params)
        engine.step()
        if r:
            times.append(engine.last_step.forward_s)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def measure(req: PlanRequest, hw: Hardware, plan: dict) -> dict:
    """Steps 1-3 of the module docstring; ``plan`` is :func:`make_plan` of ``req`` on ``hw``
    with the engine's margin. Returns the rows of predicted against measured: ``predicted`` at
    the copy bandwidth, ``predicted_gemv`` at what a one-row ``linear`` streams here."""

    engine = _engine(req, hw, plan["margin_bytes"] / hw.memory_bytes if hw.memory_bytes else 0)
    ledger, runner = engine.parts.ledger, engine.parts.runner
    cost = StepCost.for_model(engine.parts.model_config, plan["weight_bytes"],
                              plan["kv_bytes_per_token"])
    context = min(plan["avg_context"], MEASURE_CONTEXT, engine.parts.max_model_len - 1)
    batch = max(1, min(plan["max_batch"], MEASURE_BATCH,
                       ledger.num_kv_blocks // -(-context // ledger.block_size)))
    tokens = min(PREFILL_TOKENS, engine.parts.max_model_len - 2, req.max_num_batched_tokens)
    shapes = ((1, SHORT_CONTEXT, "weights stream"), (batch, context, ""))
    decodes = [_decode_forward(engine, b, c) for b, c, _ in shapes]
    prefill_fwd = _prefill_forward(engine, tokens)
    hw = _probe_again(hw, runner.model.dtype)  # a probe on a busy machine reads low: best of 2
    at_gemv = dataclasses.replace(hw, bandwidth_bytes_per_s=gemv_bandwidth(
        hw.device, runner.model.dtype))
    rows = [_row("KV blocks for the budget", plan["num_kv_blocks"], None,
                 ledger.num_kv_blocks, "blocks"),
            _row("weights", plan["weight_bytes"], None, ledger.weight_bytes, "bytes")]
    for (b, c, label), (forward, _whole) in zip(shapes, decodes, strict=True):
        step = cost.decode(b, c)
        what = f"decode forward, batch {b} x {c} tokens" + (f" ({label})" if label else "")
        rows.append(_row(what, roofline_ms(*step, hw, req.mfu),
                         roofline_ms(*step, at_gemv, req.mfu), forward * 1e3, "ms"))
    rows.append(_row(f"decode step, whole (batch {batch})", rows[-1]["predicted"],
                     rows[-1]["predicted_gemv"], decodes[-1][1] * 1e3, "ms"))
    prefill_pred = roofline_ms(*cost.prefill(tokens), hw, req.mfu)
    rows.append(_row(f"prefill forward, {tokens} tokens", prefill_pred, None,
                     prefill_fwd * 1e3, "ms"))
    gemv = at_gemv.bandwidth_bytes_per_s
    return {"rows": rows, "threads": torch.get_num_threads(), "gemv_bytes_per_s": gemv,
            "copy_bytes_per_s": hw.bandwidth_bytes_per_s, "matmul_flops_per_s":
            hw.peak_flops_per_s, "achieved_matmul_fraction_in_prefill":
            prefill_pred["compute_ms"] * req.mfu / (prefill_fwd * 1e3)}


def _probe_again(hw: Hardware, dtype: torch.dtype) -> Hardware:
    """``hw`` with its matmul rate and copy bandwidth the best of its probe and a new one."""

    gpu = hw.device == "cuda"
    flops = matmul_rate(hw.device, dtype, 8192 if gpu else 2048, 5)
    copy = copy_bandwidth(hw.device, (1 << 30) if gpu else None, 5)
    return dataclasses.replace(hw, peak_flops_per_s=max(hw.peak_flops_per_s, flops),
                               bandwidth_bytes_per_s=max(hw.bandwidth_bytes_per_s, copy))


def _row(what: str, predicted, predicted_gemv, measured: float, unit: str) -> dict:
    """``predicted``: a number or a :func:`roofline_ms` dict (then its binding is kept)."""
    row = {"what": what, "unit": unit, "measured": measured}
    for key, value in (("predicted", predicted), ("predicted_gemv", predicted_gemv)):
        if isinstance(value, dict):
            row[key] = value["ms"]
            row.setdefault("binding", value["binding"])
        else:
            row[key] = value
    row["measured_over_predicted"] = (measured / row["predicted"] if row["predicted"]
                                      else None)
    return row
