"""A decode step's GEMMs on the CPU at a few rows: ``python -m pdserve.bench.packed_rows
[--quick]``. Prints; never asserts.

Every linear layer of SmolLM2-135M's shape (30 layers of fused QKV, O, gate-up and down, and
the vocabulary head; random float32 weights, so from memory as a real step reads them), one
thread, at 1-8 rows, three ways: oneDNN's packed weights with the rows padded to
``kernels.linear.MIN_PACKED_ROWS`` (what ``linear`` does), the same without padding, and
``F.linear`` over unpacked weights. The median of 9 passes after 3 warm-ups, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.bench.stats import format_table
from pdserve.kernels.linear import MIN_PACKED_ROWS, can_pack

HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
          (HIDDEN, INTERMEDIATE)]
WAYS = ("padded", "unpadded", "F.linear")


def step_ms(rows: int, way: str, layers: int, vocab: int, passes: int) -> float:
    weights = [torch.randn(o, i) for _ in range(layers) for o, i in SHAPES]
    weights.append(torch.randn(vocab, HIDDEN))
    packed = ([torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
              if way != "F.linear" else None)
    inputs = {i: torch.randn(rows, i) for i in (HIDDEN, INTERMEDIATE)}

    def one_pass() -> None:
        for k, w in enumerate(weights):
            x = inputs[w.shape[1]]
            if packed is None:
                F.linear(x, w)
                continue
            if way == "padded" and rows < MIN_PACKED_ROWS:
                x = torch.cat([x, x.new_zeros(MIN_PACKED_ROWS - rows, x.shape[1])])
            torch.ops.mkldnn._linear_pointwise(x, packed[k], None, "none", [], "")

    for _ in range(3):
        one_pass()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, a small head (smoke)")
    args = parser.parse_args(argv)
    if not can_pack(torch.empty(1, 1)):
        print("oneDNN is not available in this torch build: nothing to measure")
        return
    threads = torch.get_num_threads()  # (restored after: a caller's process keeps its own)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers, vocab, passes = (2, 1024, 3) if args.quick else (LAYERS, VOCAB, 9)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, one thread, "
          f"{layers} layers")
    try:
        with torch.inference_mode():
            table = [[rows, *(step_ms(rows, way, layers, vocab, passes) for way in WAYS)]
                     for rows in (1, 2, 3, 4, 8)]
    finally:
        torch.set_num_threads(threads)
    print(format_table(["rows", *(f"{way} ms" for way in WAYS)], table))


if __name__ == "__main__":
    main()
