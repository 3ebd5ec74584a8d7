"""GPU benchmark of the Triton kernels: ``python -m pdserve.bench.kernels``.

For each kernel at serving shapes (decode: batch 64 x 4k context, 32 query / 8 kv heads,
head_dim 128, bf16; prefill: 4k tokens; norm / rotary / SiLU / KV write / block pack at the
matching sizes; the LoRA delta through SmolLM2's up projection at rank 16, for 8 rows of 4
adapters and 512 rows of one) it checks the output against the torch reference, times the
kernel (median of CUDA-event timings, L2 flushed before each run) and reports achieved GB/s or
TFLOP/s against ceilings measured in the same run: a large device-to-device copy and a large
bf16 matmul. Peers: torch's ``scaled_dot_product_attention`` on the same K/V laid out densely
(attention), the grouped torch path (LoRA) and the torch reference (everything else). A table
with the ratios comes last.

Without CUDA it says so and exits 0; ``--tiny`` instead runs every case at toy shapes under the
Triton interpreter (correctness only, no timings), which is what the test suite does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.bench.stats import format_table
from pdserve.kernels import torch_ops as ref
from pdserve.kernels.kv_layout import KVCacheLayer
from pdserve.kernels.lora import LoraBatch, lora_delta_gather, lora_delta_grouped
from pdserve.kernels.torch_attention import paged_attention_torch, paged_decode_attention_torch
from pdserve.testing.paged_batches import (
    TOLERANCE,
    random_paged_batch,
    random_scales,
    relative_error,
)

DECODE_TARGET = 0.80  # of the measured copy bandwidth
PREFILL_TARGET = 0.50  # of the measured bf16 matmul rate


@dataclass
class Row:
    """One measured case."""

    name: str  # kernel and variant
    shape: str  # the case in words
    rel_err: float  # max |kernel - reference| / max |reference|
    ok: bool  # rel_err within the dtype's tolerance
    ms: float | None  # median kernel time (None: not timed)
    amount: float  # bytes moved (unit GB/s) or FLOPs done (unit TFLOP/s) per call
    unit: str  # "GB/s" or "TFLOP/s"
    peer: str = ""  # what the peer is ("" for none)
    peer_ms: float | None = None  # median peer time


class Bench:
    """Sizes, device, timing and the ceilings of one run."""

    def __init__(self, tiny: bool, reps: int):
        self.tiny = tiny
        self.device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
        self.timed = self.device.type == "cuda"
        self.reps = reps
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self._flush = torch.empty(256 << 20, dtype=torch.int8, device=self.device) \
            if self.timed else None
        self.copy_gbps = self.matmul_tflops = float("nan")

    def time_ms(self, fn: Callable[[], object]) -> float | None:
        """Median milliseconds of ``fn`` over ``reps`` runs, L2 flushed before each."""
        if not self.timed:
            return None
        for _ in range(3):
            fn()
        times = []
        for _ in range(self.reps):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def measure_ceilings(self) -> None:
        if self.timed:
            self.copy_gbps = self._copy_gbps()
            self.matmul_tflops = self._matmul_tflops()

    def _copy_gbps(self, nbytes: int = 1 << 31) -> float:
        """Device-to-device copy rate, counting the read and the write."""
        src = torch.empty(nbytes, dtype=torch.int8, device=self.device)
        dst = torch.empty_like(src)
        return 2 * nbytes / self.time_ms(lambda: dst.copy_(src)) / 1e6

    def _matmul_tflops(self, n: int = 8192) -> float:
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        return 2 * n ** 3 / self.time_ms(lambda: a @ b) / 1e9

    def rate(self, row: Row) -> float:
        return float("nan") if row.ms is None else row.amount / row.ms / \
            (1e6 if row.unit == "GB/s" else 1e9)

    def ceiling(self, row: Row) -> float:
        return self.copy_gbps if row.unit == "GB/s" else self.matmul_tflops


def _row(b: Bench, name, shape, out, want, dtype, fn, amount, unit, peer="", peer_fn=None):
    err = relative_error(out, want)
    return Row(name, shape, err, bool(err < TOLERANCE[dtype]), b.time_ms(fn), amount, unit,
               peer, b.time_ms(peer_fn) if peer_fn else None)


def _gqa_sdpa(q, k, v, causal):
    """Peer: dense flash attention. q: (n, H, L, D); k, v: (n, KH, S, D)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=True)


def decode_case(b: Bench, quantized: bool) -> Row:
    # lazy: imports triton, which only the Triton rows need
    from pdserve.kernels.decode_attention import decode_attention

    seqs, ctx, heads, kv_heads, hd = (3, 40, 8, 2, 64) if b.tiny else (64, 4096, 32, 8, 128)
    batch = random_paged_batch([ctx] * seqs, [1] * seqs, heads, kv_heads, hd, 16,
                               torch.bfloat16, b.gen, quantized=quantized)
    args = (batch.query, batch.cache, batch.block_tables, batch.context_lens, hd ** -0.5)
    fn = lambda: decode_attention(*args, max_context_len=ctx)
    kv_bytes = 2 * seqs * ctx * kv_heads * hd * batch.cache.kv.element_size()
    peer_fn = None
    if not quantized:  # the same K/V laid out densely: (seqs, kv_heads, ctx, hd)
        k = batch.cache.k[batch.block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
        v = batch.cache.v[batch.block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
        q = batch.query[:, :, None]  # (seqs, heads, 1, hd)
        peer_fn = lambda: _gqa_sdpa(q, k, v, False)
    name = "decode attention" + (" int8" if quantized else "")
    return _row(b, name, f"{seqs}x{ctx} ctx, {heads}/{kv_heads}h, d{hd}", fn(),
                paged_decode_attention_torch(*args), torch.bfloat16, fn,
                kv_bytes + 4 * batch.query.numel(), "GB/s", "sdpa dense" if peer_fn else "",
                peer_fn)


def prefill_case(b: Bench, num_seqs: int, quantized: bool = False) -> Row:
    # lazy: imports triton, which only the Triton rows need
    from pdserve.kernels.prefill_attention import prefill_attention

    total, heads, kv_heads, hd = (48, 4, 2, 64) if b.tiny else (4096, 32, 8, 128)
    q_len = total // num_seqs
    batch = random_paged_batch([q_len] * num_seqs, [q_len] * num_seqs, heads, kv_heads, hd, 16,
                               torch.bfloat16, b.gen, quantized=quantized)
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, hd ** -0.5)
    fn = lambda: prefill_attention(*args, max_query_len=q_len)
    flops = 4 * heads * hd * num_seqs * q_len * (q_len + 1) / 2  # visible (q, k) pairs only
    peer_fn = None
    if not quantized:
        kv = batch.cache.kv[:, batch.block_tables.long()].flatten(2, 3)[:, :, :q_len]
        k, v = (x.transpose(1, 2).contiguous() for x in kv)  # (seqs, kv_heads, q_len, hd)
        q = batch.query.view(num_seqs, q_len, heads, hd).transpose(1, 2)  # (seqs, H, L, hd)
        peer_fn = lambda: _gqa_sdpa(q, k, v, True)
    name = "prefill attention" + (" int8" if quantized else "")
    return _row(b, name, f"{num_seqs}x{q_len} tok, {heads}/{kv_heads}h, d{hd}", fn(),
                paged_attention_torch(*args), torch.bfloat16, fn, flops, "TFLOP/s",
                "sdpa causal dense" if peer_fn else "", peer_fn)


def pointwise_cases(b: Bench) -> list[Row]:
    # lazy: imports triton, which only the Triton rows need
    from pdserve.kernels.activation import silu_and_mul
    from pdserve.kernels.norm import rms_norm
    from pdserve.kernels.rotary_embedding import rotary

    tokens, hidden, inter, heads, kv_heads, hd = (8, 96, 80, 4, 2, 64) if b.tiny else \
        (4096, 4096, 14336, 32, 8, 128)
    bf16, dev = torch.bfloat16, b.device
    x = torch.randn(tokens, hidden, device=dev, generator=b.gen).to(bf16)
    r = torch.randn(tokens, hidden, device=dev, generator=b.gen).to(bf16)
    w = torch.randn(hidden, device=dev, generator=b.gen).to(bf16)
    rows = [_row(b, "rms_norm+residual", f"{tokens}x{hidden}", rms_norm(x, w, 1e-6, r)[0],
                 ref.rms_norm_torch(x, w, 1e-6, r)[0], bf16, lambda: rms_norm(x, w, 1e-6, r),
                 8 * x.numel(), "GB/s", "torch ref", lambda: ref.rms_norm_torch(x, w, 1e-6, r))]

    q = torch.randn(tokens, heads, hd, device=dev, generator=b.gen).to(bf16)
    k = torch.randn(tokens, kv_heads, hd, device=dev, generator=b.gen).to(bf16)
    pos = torch.randint(0, 8192, (tokens,), device=dev, generator=b.gen)
    cos_sin = torch.randn(8192, hd, device=dev, generator=b.gen)
    rows.append(_row(b, "rotary", f"{tokens} tok, {heads}/{kv_heads}h, d{hd}",
                     torch.cat(rotary(q, k, pos, cos_sin), 1),
                     torch.cat(ref.rotary_torch(q, k, pos, cos_sin), 1), bf16,
                     lambda: rotary(q, k, pos, cos_sin), 4 * (q.numel() + k.numel())
                     + 4 * tokens * hd, "GB/s", "torch ref",
                     lambda: ref.rotary_torch(q, k, pos, cos_sin)))

    gu = torch.randn(tokens, 2 * inter, device=dev, generator=b.gen).to(bf16)
    rows.append(_row(b, "silu_and_mul", f"{tokens}x{inter}", silu_and_mul(gu),
                     ref.silu_and_mul_torch(gu), bf16, lambda: silu_and_mul(gu),
                     2 * 3 * tokens * inter, "GB/s", "torch ref",
                     lambda: ref.silu_and_mul_torch(gu)))
    return rows


def kv_write_case(b: Bench, quantized: bool) -> Row:
    # lazy: imports triton, which only the Triton rows need
    from pdserve.kernels.kv_write import write_kv

    tokens, kv_heads, hd, bs = (10, 2, 64, 16) if b.tiny else (4096, 8, 128, 16)
    num_blocks = 2 * tokens // bs + 1
    dtype = torch.int8 if quantized else torch.bfloat16
    shape = (2, num_blocks, bs, kv_heads, hd)
    scales = (random_scales(kv_heads, hd, b.gen), random_scales(kv_heads, hd, b.gen)) \
        if quantized else (None, None)
    cache = KVCacheLayer(torch.zeros(shape, dtype=dtype, device=b.device), *scales)
    expected = KVCacheLayer(cache.kv.clone(), *scales)
    key = torch.randn(tokens, kv_heads, hd, device=b.device, generator=b.gen).bfloat16()
    value = torch.randn(tokens, kv_heads, hd, device=b.device, generator=b.gen).bfloat16()
    slots = torch.randperm(num_blocks * bs, device=b.device, generator=b.gen)[:tokens]
    write_kv(key, value, cache, slots)
    ref.write_kv_torch(key, value, expected, slots)
    err = float((cache.kv.float() - expected.kv.float()).abs().max())  # exact is expected
    amount = 2 * key.numel() * (2 + cache.kv.element_size())
    return Row("write_kv" + (" int8" if quantized else ""), f"{tokens} tok, {kv_heads}h, d{hd}",
               err, err == 0.0, b.time_ms(lambda: write_kv(key, value, cache, slots)), amount,
               "GB/s", "torch ref",
               b.time_ms(lambda: ref.write_kv_torch(key, value, expected, slots)))


def block_copy_cases(b: Bench) -> list[Row]:
    # lazy: imports triton, which only the Triton rows need
    from pdserve.kernels.block_copy import pack_blocks, unpack_blocks

    layers, blocks, ids_n, kv_heads, hd = (2, 6, 3, 2, 64) if b.tiny else (32, 1024, 256, 8, 128)
    caches = [KVCacheLayer(torch.randn(2, blocks, 16, kv_heads, hd, device=b.device,
                                       generator=b.gen).bfloat16()) for _ in range(layers)]
    ids = torch.randperm(blocks, device=b.device, generator=b.gen)[:ids_n]
    buffer = pack_blocks(caches, ids)
    want = ref.pack_blocks_torch(caches, ids)
    amount = 2 * buffer.numel() * buffer.element_size()
    shape = f"{layers} layers x {ids_n} blocks"
    rows = [Row("pack_blocks", shape, relative_error(buffer, want), torch.equal(buffer, want),
                b.time_ms(lambda: pack_blocks(caches, ids)), amount, "GB/s", "torch ref",
                b.time_ms(lambda: ref.pack_blocks_torch(caches, ids)))]
    other = torch.randperm(blocks, device=b.device, generator=b.gen)[:ids_n]
    unpack_blocks(buffer, caches, other)
    back = ref.pack_blocks_torch(caches, other)
    rows.append(Row("unpack_blocks", shape, relative_error(back, buffer),
                    torch.equal(back, buffer),
                    b.time_ms(lambda: unpack_blocks(buffer, caches, other)), amount, "GB/s",
                    "torch ref", b.time_ms(lambda: ref.unpack_blocks_torch(buffer, caches, other))))
    return rows


def lora_case(b: Bench, tokens: int, adapters: int) -> Row:
    """The LoRA delta of one linear layer (SmolLM2's up projection, rank 16) for ``tokens``
    rows dealt in turn to ``adapters`` adapters of a pool of 8."""
    # lazy: imports triton, which only the Triton rows need
    from pdserve.kernels.lora_triton import lora_delta_triton

    in_f, out_f, rank, num_slots = (40, 56, 4, 8) if b.tiny else (576, 1536, 16, 8)
    bf16, dev = torch.bfloat16, b.device
    a = (torch.randn(num_slots, rank, in_f, device=dev, generator=b.gen) / in_f ** 0.5).to(bf16)
    lb = (torch.randn(num_slots, out_f, rank, device=dev, generator=b.gen) / rank ** 0.5).to(bf16)
    x = torch.randn(tokens, in_f, device=dev, generator=b.gen).to(bf16)
    slots = torch.arange(tokens, device=dev) % adapters + 1
    out, want = torch.zeros(2, tokens, out_f, dtype=bf16, device=dev)
    lora_delta_triton(out, x, a, lb, slots)
    lora_delta_gather(want, x, a, lb, slots)
    got = out.clone()  # (the timed calls keep adding into out and want)
    batch = LoraBatch.of(slots)
    amount = 2 * (x.numel() + 2 * out.numel() + adapters * rank * (in_f + out_f))
    return _row(b, "lora delta", f"{tokens} rows x {adapters} adapters, {in_f}->{out_f} r{rank}",
                got, want, bf16, lambda: lora_delta_triton(out, x, a, lb, slots), amount, "GB/s",
                "torch grouped", lambda: lora_delta_grouped(want, x, a, lb, batch))


def run(b: Bench) -> list[Row]:
    """Every case, in table order."""
    rows = [decode_case(b, False), decode_case(b, True),
            prefill_case(b, 1), prefill_case(b, 4), prefill_case(b, 1, quantized=True)]
    rows += pointwise_cases(b)
    rows += [kv_write_case(b, False), kv_write_case(b, True)]
    rows += block_copy_cases(b)
    return rows + [lora_case(b, 8, 4), lora_case(b, 24 if b.tiny else 512, 1)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def report(b: Bench, rows: list[Row]) -> str:
    header = ["kernel", "shape", "rel err", "ok", "ms", "achieved", "unit", "% ceiling",
              "peer", "peer ms", "peer/kernel"]
    table = []
    for row in rows:
        rate = b.rate(row)
        speedup = (row.peer_ms / row.ms) if row.ms and row.peer_ms else float("nan")
        table.append([row.name, row.shape, f"{row.rel_err:.1e}", "yes" if row.ok else "NO",
                      _ms(row.ms), rate, row.unit, 100 * rate / b.ceiling(row), row.peer or "-",
                      _ms(row.peer_ms), speedup])
    lines = [f"ceilings: copy {b.copy_gbps:.0f} GB/s (read+write), "
             f"bf16 matmul {b.matmul_tflops:.0f} TFLOP/s", format_table(header, table)]
    for row, target in ((rows[0], DECODE_TARGET), (rows[2], PREFILL_TARGET)):
        if row.ms is None:
            continue
        frac = b.rate(row) / b.ceiling(row)
        verdict = "met" if frac >= target else "NOT met"
        lines.append(f"{row.name}: {100 * frac:.0f} % of ceiling, target {100 * target:.0f} % "
                     f"{verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="toy shapes on CPU under the Triton interpreter, correctness only")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per case")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("pdserve.bench.kernels needs a CUDA device; none here, nothing measured "
              "(--tiny checks the kernels on CPU under the Triton interpreter).")
        return 0
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    b = Bench(args.tiny, args.reps)
    b.measure_ceilings()
    rows = run(b)
    print(report(b, rows))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
