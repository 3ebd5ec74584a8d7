"""Paged decode attention on the CPU against a plain read of the same bytes:
``python -m pdserve.bench.cpu_attention [--quick] [--threads 1 2] [--prompts]``. Prints; never
asserts.

One decode step's attention of one layer at SmolLM2-135M's shape (9 query heads over 3 KV
heads of 64), blocks of 16 scattered over a pool as they are after churn (each sequence's
block table a random draw of the pool's blocks), at a few batches and context lengths, in
float32 and bfloat16, through what the engine runs (``kernels.paged_decode_attention`` on the
``native`` backend: the C kernel where it takes the pool, else torch's gather). Each call
reads every K and V row of every sequence's context once; its rate is those bytes over its
time, set beside the rate of a plain copy of the same bytes (one contiguous tensor into
another: bytes copied over its time, what the memory gives one pass over them) on the same
threads, in the same run. The median of
``--repeats`` calls after warm-ups, interleaved by round.

``--prompts`` times whole prompts attending to themselves instead, at the same shape, a few
lengths and both dtypes: what the engine runs (``kernels.prompt_attention`` on the ``native``
backend: in bf16 the C kernel on AMX's tiles where it takes the prompt, in float32 the C
float32 kernel) against torch's SDPA with grouped heads in the same dtype (what bf16 ran
before, and runs where the CPU has no AMX), each in ms and in TFLOPS of the causal products
(two of 2 x head_dim flops per query-key pair and head).
"""

from __future__ import annotations

import argparse
import random

import torch

from pdserve.bench.stats import format_table, median_s
from pdserve.kernels import (
    KVCacheLayer,
    cpu_causal_attention,
    cpu_decode_attention,
    paged_decode_attention,
    prompt_attention,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make_case(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """(query, cache, block_tables, context_lens): ``batch`` sequences of ``context`` tokens
    over a pool of exactly their blocks, shuffled."""
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = torch.tensor(order, dtype=torch.int32).view(batch, per_seq)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return query, KVCacheLayer(kv), tables, lens


def context_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    """K and V bytes one call reads."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * batch * context * KV_HEADS * HEAD_DIM * element


def measure(batch: int, context: int, dtype: torch.dtype,
            repeats: int) -> tuple[float, float, str]:
    """(attention GB/s, plain copy GB/s, path) of one point on the current threads."""
    query, cache, tables, lens = make_case(batch, context, dtype)
    scale = HEAD_DIM ** -0.5
    path = "C" if cpu_decode_attention.takes(query, cache) else "torch"
    nbytes = context_bytes(batch, context, dtype)
    source = torch.ones(nbytes // 4, dtype=torch.float32)  # (the same bytes, contiguous)
    target = torch.empty_like(source)
    attention_s = median_s(lambda: paged_decode_attention(
        query, cache, tables, lens, scale, backend="native"), repeats)
    copy_s = median_s(lambda: target.copy_(source), repeats)
    return nbytes / attention_s / 1e9, nbytes / copy_s / 1e9, path


def prompt_case(length: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """(q, k, v) of one prompt as the model passes them: views of a packed projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(length, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    return (q.view(length, HEADS, HEAD_DIM), k.view(length, KV_HEADS, HEAD_DIM),
            v.view(length, KV_HEADS, HEAD_DIM))


def prompt_flops(length: int) -> int:
    """The causal products' flops of one layer: query-key pairs x heads x 2 x 2 x head_dim."""
    return length * (length + 1) // 2 * HEADS * 4 * HEAD_DIM


def prompt_kernel(q, k, v, scale: float) -> str:
    """The kernel ``prompt_attention`` runs for this prompt on the ``native`` backend."""
    if q.dtype == torch.bfloat16:
        return "C AMX" if cpu_causal_attention.takes_bf16(q, k, v, scale) else "SDPA"
    return "C" if cpu_causal_attention.takes(q, k, v) else "SDPA"


def measure_prompt(length: int, dtype: torch.dtype, repeats: int) -> tuple[float, float, str]:
    """(engine ms, SDPA ms, the engine's kernel) of one prompt on the current threads."""
    q, k, v = prompt_case(length, dtype)
    scale = HEAD_DIM ** -0.5
    path = prompt_kernel(q, k, v, scale)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    engine_s = sdpa_s = float("inf")
    for _ in range(3):  # rounds, interleaved
        engine_s = min(engine_s, median_s(
            lambda: prompt_attention(q, k, v, scale, backend="native"), repeats))
        sdpa_s = min(sdpa_s, median_s(lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True), repeats))
    return engine_s * 1e3, sdpa_s * 1e3, path


def prompt_rows(lengths: list[int], threads: list[int], repeats: int) -> list[list]:
    rows = []
    for length in lengths:
        for dtype in (torch.bfloat16, torch.float32):
            for count in threads:
                torch.set_num_threads(count)
                engine_ms, sdpa_ms, path = measure_prompt(length, dtype, repeats)
                flops = prompt_flops(length)
                rows.append([length, str(dtype).removeprefix("torch."), count, path,
                             f"{engine_ms:.3f}", f"{sdpa_ms:.3f}",
                             f"{flops / engine_ms / 1e9:.2f}", f"{flops / sdpa_ms / 1e9:.2f}",
                             f"{sdpa_ms / engine_ms:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", action="store_true",
                        help="whole prompts' attention (bf16 and float32) instead of decode "
                             "steps'")
    args = parser.parse_args(argv)
    threads_before = torch.get_num_threads()
    if args.prompts:
        lengths = [64] if args.quick else [32, 256, 1024, 2048]
        try:
            rows = prompt_rows(lengths, args.threads, 3 if args.quick else args.repeats)
        finally:
            torch.set_num_threads(threads_before)
        print(format_table(["prompt", "dtype", "threads", "engine's kernel", "engine ms",
                            "SDPA ms", "engine TFLOPS", "SDPA TFLOPS", "SDPA / engine"], rows))
        return
    batches, contexts = ([1, 4], [64]) if args.quick else ([1, 8, 32], [512, 2048])
    repeats = 3 if args.quick else args.repeats
    if not cpu_decode_attention.available():
        print("the C decode attention does not build here: every point runs torch's gather")
    rows = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for batch in batches:
                for context in contexts:
                    for threads in args.threads:
                        torch.set_num_threads(threads)
                        attention, plain, path = measure(batch, context, dtype, repeats)
                        rows.append([str(dtype).removeprefix("torch."), batch, context, threads,
                                     path, f"{attention:.1f}", f"{plain:.1f}",
                                     f"{attention / plain:.2f}"])
    finally:
        torch.set_num_threads(threads_before)
    print(format_table(["dtype", "batch", "context", "threads", "kernel", "attention GB/s",
                        "plain copy GB/s", "attention / copy"], rows))


if __name__ == "__main__":
    main()
