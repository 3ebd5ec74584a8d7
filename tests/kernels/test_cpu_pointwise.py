"""The C RMSNorm, SiLU-and-mul and RoPE against their torch references (and float64) on random
inputs, in float32 and bfloat16, and the dispatch that sends them float32 and bfloat16 CPU
calls under the native backend only; the C K/V write against ``write_kv_torch``."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import KVCacheLayer, cpu_pointwise, dispatch
from pdserve.kernels import torch_ops as ref

pytestmark = pytest.mark.skipif(not cpu_pointwise.available(),
                                reason="no working C compiler on this machine")


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 37), (3, 5, 2 * 16), (0, 8)])
def test_silu_and_mul_matches_the_reference(gen, shape):
    x = torch.randn(*shape, generator=gen) * 4
    got = cpu_pointwise.silu_and_mul_cpu(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref.silu_and_mul_torch(x), rtol=2e-6, atol=1e-7)


def test_silu_and_mul_over_the_whole_float_range():
    """exp is computed sixteen lanes at a time by a polynomial: check it where SiLU saturates
    (large negative gates give -0, large positive the gate itself) and around zero, against
    float64; every width from one lane to past a vector, so the scalar tail runs too."""
    specials = [0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5, 88.8, -88.8, 1e30, -1e30, 3e38, -3e38]
    gate = torch.cat([torch.tensor(specials), torch.linspace(-120, 120, 4001)])
    up = torch.linspace(-1, 1, gate.numel())  # |silu(gate) * up| <= |gate|: no overflow
    for width in (1, 12, 16, 17, gate.numel()):  # the specials in the scalar tail, then lanes
        x = torch.cat([gate[:width], up[:width]])[None]
        got = cpu_pointwise.silu_and_mul_cpu(x).double()
        g, u = gate[:width].double(), up[:width].double()
        want = g / (1 + torch.exp(-g)) * u
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[0], want, rtol=4e-7, atol=1e-30)


def test_silu_and_mul_reads_rows_of_a_wider_tensor(gen):
    wide = torch.randn(6, 50, generator=gen)
    x = wide[:, :48]  # rows 50 apart
    torch.testing.assert_close(cpu_pointwise.silu_and_mul_cpu(x), ref.silu_and_mul_torch(x),
                               rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(1, 576), (9, 576), (4, 37), (5, 3, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(gen, shape, with_residual):
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    residual = torch.randn(*shape, generator=gen) if with_residual else None
    got = cpu_pointwise.rms_norm_cpu(x, weight, 1e-6, residual)
    want = ref.rms_norm_torch(x, weight, 1e-6, residual)
    if with_residual:
        (got, got_sum), (want, want_sum) = got, want
        assert torch.equal(got_sum, want_sum)  # one float32 add: the same bits
        assert torch.equal(x + residual, got_sum)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rms_norm_of_zeros_is_zero_and_eps_counts(gen):
    weight = torch.ones(32)
    assert torch.equal(cpu_pointwise.rms_norm_cpu(torch.zeros(2, 32), weight, 1e-6),
                       torch.zeros(2, 32))
    x = torch.full((1, 32), 1e-3)
    torch.testing.assert_close(cpu_pointwise.rms_norm_cpu(x, weight, 1.0),
                               ref.rms_norm_torch(x, weight, 1.0))


def bf16_steps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between each pair (both bf16, finite, of one sign or zero)."""
    as_int = lambda t: t.view(torch.int16).to(torch.int32)
    return (as_int(got) - as_int(want)).abs()


def test_bf16_silu_and_mul_rounds_where_the_reference_does(gen):
    """SiLU in float32, rounded to bf16, times up, rounded: the reference's roundings; the exp
    differs from torch's in the last float32 bits, so a SiLU right at a rounding boundary
    may land one bf16 step away (and its product with it)."""
    x = (torch.randn(33, 2 * 200, generator=gen) * 4).bfloat16()
    got, want = cpu_pointwise.silu_and_mul_cpu(x), ref.silu_and_mul_torch(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    steps = bf16_steps_apart(got, want)
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01


@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rms_norm_rounds_where_the_reference_does(gen, with_residual):
    """The residual sum is the reference's bits (one add, rounded once); the norm agrees but
    where the two float32 inverse roots differ in their last bit at a bf16 boundary."""
    x = (torch.randn(17, 576, generator=gen) * 3).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    residual = torch.randn(17, 576, generator=gen).bfloat16() if with_residual else None
    got = cpu_pointwise.rms_norm_cpu(x, weight, 1e-6, residual)
    want = ref.rms_norm_torch(x, weight, 1e-6, residual)
    if with_residual:
        (got, got_sum), (want, want_sum) = got, want
        assert got_sum.dtype == torch.bfloat16 and torch.equal(got_sum, want_sum)
    assert got.dtype == torch.bfloat16
    steps = bf16_steps_apart(got, want)
    assert steps.max() <= 2 and (steps > 0).float().mean() < 0.01


def test_the_native_backend_routes_float32_and_bf16_cpu_calls_here(gen, monkeypatch):
    calls = []
    for name in ("rms_norm_cpu", "silu_and_mul_cpu"):
        real = getattr(cpu_pointwise, name)
        monkeypatch.setattr(cpu_pointwise, name,
                            lambda *args, _real=real, _name=name: calls.append(_name) or
                            _real(*args))
    x, weight = torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen)
    kernels.rms_norm(x, weight, 1e-6, backend="native")
    kernels.silu_and_mul(x, backend="native")
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu"]
    kernels.rms_norm(x, weight, 1e-6, backend="torch")
    kernels.silu_and_mul(x, backend="torch")
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu"]
    half = x.to(torch.bfloat16)
    kernels.rms_norm(half, weight.to(torch.bfloat16), 1e-6, backend="native")
    kernels.silu_and_mul(half, backend="native")
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu"] * 2
    kernels.rms_norm(half, weight, 1e-6, backend="native")  # a float32 weight: torch's path
    kernels.silu_and_mul(half.half(), backend="native")  # float16: torch's path
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu"] * 2


def test_refuses_what_it_does_not_take(gen):
    with pytest.raises(ValueError, match="even width"):
        cpu_pointwise.silu_and_mul_cpu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="even width"):
        cpu_pointwise.silu_and_mul_cpu(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="a weight as wide as x's last dimension"):
        cpu_pointwise.rms_norm_cpu(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="a residual shaped as x"):
        cpu_pointwise.rms_norm_cpu(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(3, 8))


@pytest.mark.parametrize("head_dim", [8, 64, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_the_reference_to_the_bit(gen, head_dim, dtype):
    """q and k packed in a wider qkv row (strided, as the model has them) and apart: the C RoPE
    gives rotary_torch's bits (the same products and sums, none fused, a bf16 result rounded
    once from float32), so Hugging Face's."""
    heads, kv_heads, tokens = 4, 2, 7
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen) * 5).to(dtype)
    qk = qkv[:, :heads + kv_heads]
    theta = torch.rand(40, head_dim // 2, generator=gen) * 30
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    pos = torch.tensor([0, 39, 3, 3, 17, 1, 22])
    table = ref.rope_table_torch(pos, cache)
    q_want, k_want = ref.rotary_torch(qk[:, :heads], qk[:, heads:], pos, cache)
    q_got, k_got = dispatch.rotary_packed(qk, heads, pos, cache, backend="native", table=table)
    assert q_got.dtype == dtype and torch.equal(q_got, q_want) and torch.equal(k_got, k_want)
    q_got, k_got = kernels.rotary(qk[:, :heads], qk[:, heads:], pos, cache, backend="native")
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_want)


def test_rotary_refuses_what_it_does_not_take(gen):
    cos = sin = torch.ones(3, 1, 8)
    with pytest.raises(ValueError, match="D even"):
        cpu_pointwise.rotary_cpu(torch.randn(3, 2, 7), cos, sin)
    with pytest.raises(ValueError, match="D even"):
        cpu_pointwise.rotary_cpu(torch.randn(4, 2, 8), cos, sin)  # a table for 3 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_threads_give_the_bits_of_one(gen, monkeypatch, dtype):
    """Each kernel splits its rows over the threads: SiLU-and-mul, RMSNorm with and without a
    residual and RoPE return the same bits on two threads (however small the call) as on
    one."""
    rows, hidden, heads, head_dim = 37, 96, 3, 16
    x = (torch.randn(rows, 2 * hidden, generator=gen) * 4).to(dtype)
    h, r = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(dtype)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, 1, head_dim, generator=gen) * 6  # RoPE's float32 table
    cos, sin = angles.cos(), angles.sin()

    def run_all():
        return [cpu_pointwise.silu_and_mul_cpu(x), cpu_pointwise.rms_norm_cpu(h, weight, 1e-5),
                *cpu_pointwise.rms_norm_cpu(h, weight, 1e-5, r.clone()),
                cpu_pointwise.rotary_cpu(q.clone(), cos, sin)]

    monkeypatch.setattr(cpu_pointwise, "PARALLEL_MIN_WORK", 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run_all()
        torch.set_num_threads(2)
        split = run_all()
    finally:
        torch.set_num_threads(before)
    for one, two in zip(alone, split, strict=True):
        assert torch.equal(one, two)


def _kv_step(gen, tokens, dtype, blocks=12, block=4, kv_heads=3, head_dim=16):
    """A pool (KVCacheLayer, random contents), and one step's key and value as the model
    passes them (views of a packed projection's rows) bound for shuffled slots of it."""
    cache = KVCacheLayer(torch.randn(2, blocks, block, kv_heads, head_dim, generator=gen)
                         .to(dtype))
    qkv = torch.randn(tokens, (2 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    width = kv_heads * head_dim
    key = qkv[:, 2 * head_dim:2 * head_dim + width].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * head_dim + width:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    return cache, key, value, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 29, 48])  # one; some; every slot of the pool
def test_write_kv_copies_what_the_torch_path_copies(gen, dtype, tokens):
    cache, key, value, slots = _kv_step(gen, tokens, dtype)
    want = KVCacheLayer(cache.kv.clone())
    ref.write_kv_torch(key, value, want, slots)
    k_rows, v_rows = cache.slot_rows()
    assert tokens == 1 or key.stride(0) > key[0].numel()  # rows of a wider projection
    assert cpu_pointwise.takes_kv(key, value, k_rows, v_rows, slots)
    cpu_pointwise.write_kv_cpu(key, value, k_rows, v_rows, slots)
    assert torch.equal(cache.kv, want.kv)


def test_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(gen):
    for bad in (-1, 48, 2 ** 40):
        cache, key, value, slots = _kv_step(gen, 5, torch.float32)
        before = cache.kv.clone()
        slots[3] = bad
        with pytest.raises(IndexError, match="outside the pool of 48 slots"):
            cpu_pointwise.write_kv_cpu(key, value, *cache.slot_rows(), slots)
        assert torch.equal(cache.kv, before)


def test_write_kv_goes_to_c_for_an_unquantized_cpu_pool_only(gen, monkeypatch):
    calls = []
    real = cpu_pointwise.write_kv_cpu
    monkeypatch.setattr(cpu_pointwise, "write_kv_cpu",
                        lambda *a: calls.append(a[0].dtype) or real(*a))
    cache, key, value, slots = _kv_step(gen, 6, torch.bfloat16)
    dispatch.write_kv(key, value, cache, slots, backend="native")
    dispatch.write_kv(key, value, cache, slots, backend="torch")
    dispatch.write_kv(key.float(), value.float(), cache, slots, backend="native")  # casts: torch
    assert calls == [torch.bfloat16]
    with pytest.raises(ValueError, match="each row one run of memory"):
        cpu_pointwise.write_kv_cpu(key.transpose(1, 2), value.transpose(1, 2),
                                   *cache.slot_rows(), slots)


def test_write_kv_on_two_threads_writes_what_one_does(gen, monkeypatch):
    monkeypatch.setattr(cpu_pointwise, "PARALLEL_MIN_WORK", 0)
    cache, key, value, slots = _kv_step(gen, 48, torch.bfloat16)
    one, two = KVCacheLayer(cache.kv.clone()), KVCacheLayer(cache.kv.clone())
    before = torch.get_num_threads()
    try:
        for pool, count in ((one, 1), (two, 2)):
            torch.set_num_threads(count)
            cpu_pointwise.write_kv_cpu(key, value, *pool.slot_rows(), slots)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.kv, two.kv) and not torch.equal(one.kv, cache.kv)
