"""Batched LoRA deltas on the CPU: ``python -m pdserve.bench.lora_delta [--quick]``. Prints;
never asserts.

The torch ways of :mod:`pdserve.kernels.lora`, at SmolLM2-135M's sizes (hidden 576,
intermediate 1536) and rank 16, float32, one thread: the grouped path (one shrink and one
expand GEMM per adapter in use) and the span path (every row against the run of slots in use,
masked), between which the CPU picks (``lora_delta_cpu``), against the gather reference (every
row's A and B gathered, two batched products). Decode-like steps (8 rows over 1, 4 and 8
adapters, interleaved) and a prefill-like one (512 rows, one adapter), through an up projection
(576 -> 1536) and a down projection (1536 -> 576). The median of the passes after 3
warm-ups, in ms, and gather / grouped, grouped / span.
"""

from __future__ import annotations

import argparse

import torch

from pdserve.bench.stats import format_table, median_s
from pdserve.kernels.lora import (
    LoraBatch,
    lora_delta_gather,
    lora_delta_grouped,
    lora_delta_span,
)

HIDDEN, INTERMEDIATE, RANK, NUM_SLOTS = 576, 1536, 16, 16
LAYERS = {"up 576->1536": (HIDDEN, INTERMEDIATE), "down 1536->576": (INTERMEDIATE, HIDDEN)}
# (step, rows, adapters): rows are dealt to the adapters in turn
STEPS = [("decode", 8, 1), ("decode", 8, 4), ("decode", 8, 8), ("prefill", 512, 1)]


def _median_ms(fn, passes: int) -> float:
    return median_s(fn, passes, warmups=3) * 1e3


def case(rows: int, adapters: int, in_features: int, out_features: int,
         passes: int) -> tuple[float, float, float, float]:
    """(grouped ms, span ms, gather ms, max difference to gather) for one step through one
    layer."""
    x = torch.randn(rows, in_features)
    a = torch.randn(NUM_SLOTS, RANK, in_features) / in_features ** 0.5
    b = torch.randn(NUM_SLOTS, out_features, RANK) / RANK ** 0.5
    slots = torch.arange(rows) % adapters + 1  # slots 1..adapters, interleaved
    batch = LoraBatch.of(slots)
    grouped, spanned, gathered = (torch.zeros(rows, out_features) for _ in range(3))
    lora_delta_grouped(grouped, x, a, b, batch)
    lora_delta_span(spanned, x, a, b, batch)
    lora_delta_gather(gathered, x, a, b, slots)
    err = max(float((grouped - gathered).abs().max()), float((spanned - gathered).abs().max()))
    return (_median_ms(lambda: lora_delta_grouped(grouped, x, a, b, batch), passes),
            _median_ms(lambda: lora_delta_span(spanned, x, a, b, batch), passes),
            _median_ms(lambda: lora_delta_gather(gathered, x, a, b, slots), passes), err)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 passes a case (smoke)")
    args = parser.parse_args(argv)
    passes = 3 if args.quick else 50
    threads = torch.get_num_threads()  # (restored after: a caller's process keeps its own)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, one thread, float32, "
          f"rank {RANK}")
    table = []
    try:
        with torch.inference_mode():
            for step, rows, adapters in STEPS:
                for layer, (in_features, out_features) in LAYERS.items():
                    grouped, span, gather, err = case(rows, adapters, in_features,
                                                      out_features, passes)
                    table.append([step, rows, adapters, layer, grouped, span, gather,
                                  gather / grouped, grouped / span, f"{err:.1e}"])
    finally:
        torch.set_num_threads(threads)
    print(format_table(["step", "rows", "adapters", "layer", "grouped ms", "span ms",
                        "gather ms", "gather/grouped", "grouped/span", "max diff"], table))


if __name__ == "__main__":
    main()
