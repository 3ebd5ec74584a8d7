"""Triton RMSNorm (with fused residual add), rotary embedding and SiLU-and-mul against their
torch references."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.torch_ops import rms_norm_torch, rotary_torch, silu_and_mul_torch
from pdserve.testing.paged_batches import TOLERANCE, relative_error

pytestmark = pytest.mark.triton


def _close(out, ref, dtype=None):
    """Compare at the tolerance of ``dtype`` (the inputs' precision; default the output's)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten or poisoned output"
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype or out.dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype,w_dtype,hidden,residual", [
    (torch.float32, torch.float32, 96, False),
    (torch.bfloat16, torch.bfloat16, 100, True),
    (torch.bfloat16, torch.float32, 64, True),
    (torch.float16, torch.float16, 128, False),
])
def test_rms_norm(gen, dtype, w_dtype, hidden, residual):
    from pdserve.kernels.norm import rms_norm

    x = (3 * torch.randn(2, 3, hidden, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(w_dtype)
    r = torch.randn(2, 3, hidden, generator=gen).to(dtype) if residual else None
    out, ref = rms_norm(x, w, 1e-6, r), rms_norm_torch(x, w, 1e-6, r)
    if residual:
        _close(out[0], ref[0], dtype)
        # The new residual is the same rounded sum (the interpreter truncates fp32 -> bf16
        # where a GPU rounds to nearest, so allow one bf16 step there).
        rtol = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(out[1], ref[1], rtol=rtol, atol=0.0)
    else:
        _close(out, ref, dtype)


def _cos_sin(max_pos, head_dim, gen):
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]  # (max_pos, head_dim / 2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads", [
    (torch.float32, 64, 4, 1), (torch.bfloat16, 128, 2, 2), (torch.float16, 64, 8, 1),
])
def test_rotary(gen, dtype, head_dim, heads, kv_heads):
    from pdserve.kernels.rotary_embedding import rotary

    tokens = 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]  # strided views, as the model has
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cache = _cos_sin(64, head_dim, gen)
    out_q, out_k = rotary(q, k, positions, cache)
    ref_q, ref_k = rotary_torch(q, k, positions, cache)
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    assert torch.equal(q, qkv[:, :heads])  # inputs untouched


def test_rotary_packed_dispatches_to_the_kernel(gen):
    from pdserve.kernels.dispatch import rotary_packed

    qkv = torch.randn(3, 4 + 2 * 2, 16, generator=gen)
    positions = torch.tensor([0, 5, 9])
    cache = _cos_sin(16, 16, gen)
    got = rotary_packed(qkv[:, :6], 4, positions, cache, backend="triton")
    want = rotary_torch(qkv[:, :4], qkv[:, 4:6], positions, cache)
    for out, ref in zip(got, want, strict=True):
        _close(out, ref)


@pytest.mark.parametrize("dtype,inter", [(torch.float32, 40), (torch.bfloat16, 1100)])
def test_silu_and_mul(gen, dtype, inter):
    from pdserve.kernels.activation import silu_and_mul

    x = (4 * torch.randn(3, 2 * inter, generator=gen)).to(dtype)
    _close(silu_and_mul(x), silu_and_mul_torch(x))


def test_pointwise_reject_bad_input(gen):
    from pdserve.kernels.activation import silu_and_mul
    from pdserve.kernels.norm import rms_norm
    from pdserve.kernels.rotary_embedding import rotary

    x = torch.randn(2, 8, generator=gen)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8), 1e-6, residual=x[:1])
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.randn(2, 7))
    q = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="positions"):
        rotary(q, q, torch.arange(2), torch.randn(10, 8))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary(q, q, torch.arange(3), torch.randn(10, 6))


def test_rotary_with_llama3_scaled_cache(gen):
    """llama3 frequency scaling lives in the model's cos/sin table; the kernel rotates by it."""
    from pdserve.kernels.rotary_embedding import rotary
    from pdserve.models.rope import build_cos_sin_cache

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    cache = build_cos_sin_cache(64, 300, 500000.0, scaling)
    q = torch.randn(6, 4, 64, generator=gen)
    k = torch.randn(6, 2, 64, generator=gen)
    positions = torch.tensor([0, 1, 31, 32, 200, 299])
    for got, want in zip(rotary(q, k, positions, cache), rotary_torch(q, k, positions, cache),
                         strict=True):
        _close(got, want)
