"""The one place that picks a kernel implementation: Triton on CUDA tensors, C and torch on CPU.

``backend`` is ``"auto"`` (Triton when the tensor is on CUDA and Triton imports; on CPU
``"native"`` when the C kernels build here, else ``"torch"``), ``"torch"``, ``"native"`` (torch
with the C decode attention, :mod:`pdserve.kernels.cpu_decode_attention`, for float32 and
bfloat16 pools, the C causal attention of prompts, :mod:`pdserve.kernels.cpu_causal_attention`
(float32, and whole bf16 ones on AMX where the CPU has it, else through torch's bf16 SDPA), and
the C RMSNorm, SiLU-and-mul and RoPE, :mod:`pdserve.kernels.cpu_pointwise`, for float32 and bf16;
a decode step through :mod:`pdserve.kernels.cpu_decode_layers` where the model takes it) or
``"triton"`` (forced; on CPU it needs ``TRITON_INTERPRET=1`` set before triton is imported).
Triton modules are imported lazily so the CPU path never imports triton.
"""

from __future__ import annotations

import functools
import importlib

import torch

from pdserve.kernels import (
    cpu_causal_attention,
    cpu_decode_attention,
    cpu_pointwise,
    lora,
    torch_attention,
)
from pdserve.kernels import torch_ops as ref
from pdserve.kernels.backends import BACKENDS
from pdserve.kernels.kv_layout import KVCacheLayer


@functools.cache
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``auto`` to a concrete backend for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "native" if cpu_decode_attention.available() else "torch"
    if backend == "triton" and not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package: pip install triton")
    if backend == "native" and (device.type != "cpu" or not cpu_decode_attention.available()):
        raise ValueError("attention_backend='native' runs on the CPU and needs a C compiler "
                         "(the log says why the build failed); use 'auto' or 'torch'")
    return backend


def _decode_attention_cpu(query, cache, block_tables, context_lens, scale, sliding_window):
    """The C decode attention where it takes the pool, else the torch one."""
    if cpu_decode_attention.takes(query, cache):
        return cpu_decode_attention.paged_decode_attention_cpu(
            query, cache, block_tables, context_lens, scale, sliding_window)
    return torch_attention.paged_decode_attention_torch(query, cache, block_tables,
                                                        context_lens, scale, sliding_window)


def _causal_attention_cpu(q, k, v, scale):
    """Causal prompts through the C attention where it takes them, else torch's SDPA."""
    if cpu_causal_attention.takes(q, k, v):
        return cpu_causal_attention.causal_attention_cpu(q, k, v, scale)
    return torch_attention._causal_sdpa_in_chunks(q, k, v, scale)


def _causal_bf16_cpu(q, k, v, scale):
    """One bf16 prompt (T, heads, hd) attending to itself: the C kernel on AMX's tiles where it
    takes the prompt, else torch's own bf16 attention kernel (products on the CPU's bf16
    instructions, softmax and sums in float32; the kernel transformers runs in bf16), both
    faster than the C float32 kernel on float32 copies (docs/cpu-speed.md): (T, heads, hd)
    bf16."""
    if cpu_causal_attention.takes_bf16(q, k, v, scale):
        return cpu_causal_attention.causal_attention_bf16_cpu(q, k, v, scale)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)  # (1, heads, T, hd)
    return out[0].transpose(0, 1)


def _triton(module: str):
    return importlib.import_module(f"pdserve.kernels.{module}")


def write_kv(key, value, cache: KVCacheLayer, slot_mapping, backend: str = "auto") -> None:
    resolved = resolve_backend(backend, key.device)
    if resolved == "triton":
        return _triton("kv_write").write_kv(key, value, cache, slot_mapping)
    if resolved == "native" and not cache.is_quantized:
        k_rows, v_rows = cache.slot_rows()
        if cpu_pointwise.takes_kv(key, value, k_rows, v_rows, slot_mapping):
            return cpu_pointwise.write_kv_cpu(key, value, k_rows, v_rows, slot_mapping)
    return ref.write_kv_torch(key, value, cache, slot_mapping)


def paged_attention(query, cache: KVCacheLayer, cu_seqlens_q, context_lens, block_tables,
                    scale: float, sliding_window: int | None = None, backend: str = "auto",
                    max_query_len: int | None = None, max_context_len: int | None = None):
    """Packed variable-length causal attention over paged KV (prefill, chunked prefill, mixed)."""
    resolved = resolve_backend(backend, query.device)
    if resolved == "triton":
        return _triton("prefill_attention").prefill_attention(
            query, cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
            max_query_len=max_query_len)
    if resolved == "native":
        return torch_attention.paged_attention_torch(
            query, cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
            decode=_decode_attention_cpu, causal=_causal_attention_cpu)
    return torch_attention.paged_attention_torch(query, cache, cu_seqlens_q, context_lens,
                                                 block_tables, scale, sliding_window)


def prompt_attention(q, k, v, scale: float, backend: str = "auto"):
    """One whole prompt (no cached prefix, no window) attending to itself from its own q
    (T, heads, hd), k and v (T, kv_heads, hd), not read back from the cache: what
    :func:`paged_attention` computes for it when the cache holds k and v as they are. None on
    Triton, whose paged kernel reads the cache as fast."""
    resolved = resolve_backend(backend, q.device)
    if resolved == "triton":
        return None
    if resolved == "native" and q.dtype == torch.bfloat16:
        return _causal_bf16_cpu(q, k, v, scale)
    causal = (_causal_attention_cpu if resolved == "native"
              else torch_attention._causal_sdpa_in_chunks)
    out = causal(ref.as_dtype(q, torch.float32).transpose(0, 1)[None],
                 ref.as_dtype(k, torch.float32)[None], ref.as_dtype(v, torch.float32)[None], scale)
    return out[0].transpose(0, 1).to(q.dtype)  # (T, heads, hd)


def paged_decode_attention(query, cache: KVCacheLayer, block_tables, context_lens, scale: float,
                           sliding_window: int | None = None, backend: str = "auto",
                           max_context_len: int | None = None):
    """One query token per sequence against its paged KV."""
    resolved = resolve_backend(backend, query.device)
    if resolved == "triton":
        return _triton("decode_attention").decode_attention(
            query, cache, block_tables, context_lens, scale, sliding_window,
            max_context_len=max_context_len)
    if resolved == "native":
        return _decode_attention_cpu(query, cache, block_tables, context_lens, scale,
                                     sliding_window)
    return torch_attention.paged_decode_attention_torch(query, cache, block_tables, context_lens,
                                                        scale, sliding_window)


def rms_norm(x, weight, eps: float, residual=None, backend: str = "auto"):
    resolved = resolve_backend(backend, x.device)
    if resolved == "triton":
        return _triton("norm").rms_norm(x, weight, eps, residual)
    if resolved == "native" and cpu_pointwise.takes(x, weight, residual):
        return cpu_pointwise.rms_norm_cpu(x, weight, eps, residual)
    return ref.rms_norm_torch(x, weight, eps, residual)


def rope_table(positions, cos_sin_cache, backend: str = "auto"):
    """What :func:`rotary` can reuse across a forward's layers for these ``positions`` (the
    torch path's cos/sin rows; ``None`` for Triton, whose kernel reads the cache itself)."""
    if resolve_backend(backend, positions.device) == "triton":
        return None
    return ref.rope_table_torch(positions, cos_sin_cache)


def rotary(q, k, positions, cos_sin_cache, backend: str = "auto", table=None):
    """Rotate-half RoPE of q and k; ``table``: :func:`rope_table` of ``positions``."""
    resolved = resolve_backend(backend, q.device)
    if resolved == "triton":
        # Not "rotary": importing pdserve.kernels.rotary would rebind this package's
        # ``rotary`` attribute to the submodule.
        return _triton("rotary_embedding").rotary(q, k, positions, cos_sin_cache)
    if resolved == "native" and cpu_pointwise.takes(q, k):
        cos, sin = table if table is not None else ref.rope_table_torch(positions, cos_sin_cache)
        return cpu_pointwise.rotary_cpu(q, cos, sin), cpu_pointwise.rotary_cpu(k, cos, sin)
    return ref.rotary_torch(q, k, positions, cos_sin_cache, table)


def rotary_packed(qk, num_heads: int, positions, cos_sin_cache, backend: str = "auto",
                  table=None):
    """:func:`rotary` of q and k packed side by side as ``qk`` (T, heads + kv_heads, D);
    returns (q, k)."""
    resolved = resolve_backend(backend, qk.device)
    if resolved == "triton":
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        return _triton("rotary_embedding").rotary(q, k, positions, cos_sin_cache)
    if resolved == "native" and cpu_pointwise.takes(qk):
        cos, sin = table if table is not None else ref.rope_table_torch(positions, cos_sin_cache)
        rotated = cpu_pointwise.rotary_cpu(qk, cos, sin)
        return rotated[:, :num_heads], rotated[:, num_heads:]
    return ref.rotary_packed_torch(qk, num_heads, positions, cos_sin_cache, table)


def silu_and_mul(x, backend: str = "auto"):
    resolved = resolve_backend(backend, x.device)
    if resolved == "triton":
        return _triton("activation").silu_and_mul(x)
    if resolved == "native" and cpu_pointwise.takes(x):
        return cpu_pointwise.silu_and_mul_cpu(x)
    return ref.silu_and_mul_torch(x)


def pack_blocks(caches: list[KVCacheLayer], block_ids, backend: str = "auto"):
    if resolve_backend(backend, block_ids.device) == "triton":
        return _triton("block_copy").pack_blocks(caches, block_ids)
    return ref.pack_blocks_torch(caches, block_ids)


def unpack_blocks(buffer, caches: list[KVCacheLayer], block_ids, backend: str = "auto") -> None:
    if resolve_backend(backend, block_ids.device) == "triton":
        return _triton("block_copy").unpack_blocks(buffer, caches, block_ids)
    return ref.unpack_blocks_torch(buffer, caches, block_ids)


def lora_delta(out, x, a, b, batch, backend: str = "auto") -> None:
    """Add each row's LoRA update into ``out`` in place (:mod:`pdserve.kernels.lora`)."""
    if resolve_backend(backend, x.device) == "triton":
        return _triton("lora_triton").lora_delta_triton(out, x, a, b, batch.token_slots)
    return lora.lora_delta_cpu(out, x, a, b, batch)
