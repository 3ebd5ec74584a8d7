"""A decode step's GEMMs on the CPU at a few rows: ``python -m pdserve.bench.packed_rows
[--quick] [--dtype bfloat16]``. Prints; never asserts.

Every linear layer of SmolLM2-135M's shape (30 layers of fused QKV, O, gate-up and down, and
the vocabulary head; random weights in ``--dtype``, float32 by default, so from memory as a
real step reads them), one thread, at 1-32 rows, four ways: oneDNN's packed weights with the
rows padded to ``--pad-to`` rows (default: what ``kernels.linear.linear`` pads the dtype to),
the same without padding, ``F.linear`` over unpacked weights, and pdserve's C panel GEMM over
the packed weights (where it builds, the layout checks out and it runs for the dtype here:
AVX-512 for float32, AMX for bf16; in calls of as many rows as the fused decode hands it,
``cpu_decode_layers.MAX_ROWS``, past that: what taking it further would cost). The median of
9 passes after 3 warm-ups, in ms; "-" where a way does not run here.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pdserve.bench.stats import format_table, median_s
from pdserve.kernels import cpu_decode_layers, cpu_panel_gemm
from pdserve.kernels.linear import can_pack, min_packed_rows

HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
          (HIDDEN, INTERMEDIATE)]
WAYS = ("padded", "unpadded", "F.linear", "panel")


def step_ms(rows: int, way: str, layers: int, vocab: int, passes: int,
            dtype: torch.dtype = torch.float32, pad_to: int = 4) -> float | None:
    """One pass over every layer's weight at ``rows`` rows, ``way``; None where it does not
    run here (the panel GEMM: not for this dtype here, not built, or another layout)."""
    if way == "panel" and not cpu_panel_gemm.beats_onednn(dtype):
        return None
    chunk = cpu_decode_layers.MAX_ROWS.get(dtype, cpu_panel_gemm.MAX_ROWS)
    weights = [torch.randn(o, i).to(dtype) for _ in range(layers) for o, i in SHAPES]
    weights.append(torch.randn(vocab, HIDDEN).to(dtype))
    packed = ([torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
              if way != "F.linear" else None)
    if way == "panel" and not all(cpu_panel_gemm.record_layout(w, p)
                                  for w, p in zip(weights, packed, strict=True)):
        return None
    inputs = {i: torch.randn(rows, i).to(dtype) for i in (HIDDEN, INTERMEDIATE)}

    def one_pass() -> None:
        for k, w in enumerate(weights):
            x = inputs[w.shape[1]]
            if packed is None:
                F.linear(x, w)
                continue
            if way == "panel":
                for first in range(0, rows, chunk):
                    cpu_panel_gemm.panel_linear(x[first:first + chunk], packed[k])
                continue
            if way == "padded" and rows < pad_to:
                x = torch.cat([x, x.new_zeros(pad_to - rows, x.shape[1])])
            torch.ops.mkldnn._linear_pointwise(x, packed[k], None, "none", [], "")

    before = cpu_panel_gemm.MAX_ROWS  # the rows linear routes to it, not what it can take
    cpu_panel_gemm.MAX_ROWS = max(before, chunk)
    try:
        return median_s(one_pass, passes, warmups=3) * 1e3
    finally:
        cpu_panel_gemm.MAX_ROWS = before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, a small head (smoke)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--pad-to", type=int, help="the padded way's rows (default: linear's)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    pad_to = args.pad_to or min_packed_rows(dtype)
    if not can_pack(torch.empty(1, 1, dtype=dtype)):
        print(f"oneDNN does not pack {args.dtype} weights on this CPU: nothing to measure")
        return
    threads = torch.get_num_threads()  # (restored after: a caller's process keeps its own)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers, vocab, passes = (2, 1024, 3) if args.quick else (LAYERS, VOCAB, 9)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, one thread, "
          f"{layers} layers, {args.dtype}, padded to {pad_to} rows; the panel GEMM serves "
          f"{'1-' + str(cpu_panel_gemm.MAX_ROWS) if cpu_panel_gemm.beats_onednn(dtype) else 'no'} "
          "rows in linear here")
    try:
        with torch.inference_mode():
            table = [[rows, *("-" if (ms := step_ms(rows, way, layers, vocab, passes, dtype,
                                                    pad_to)) is None else f"{ms:.1f}"
                              for way in WAYS)] for rows in (1, 2, 3, 4, 8, 16, 24, 32)]
    finally:
        torch.set_num_threads(threads)
    print(format_table(["rows", *(f"{way} ms" for way in WAYS)], table))


if __name__ == "__main__":
    main()
