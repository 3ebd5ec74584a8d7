"""The C panel GEMM (a decode step's few rows against oneDNN's packed weight) against F.linear
in float64 on random inputs, and the routing that sends it only the calls it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_panel_gemm
from pdserve.kernels import linear as klinear

pytestmark = pytest.mark.skipif(not cpu_panel_gemm.available(),
                                reason="no working C compiler on this machine")
bf16_kernel = pytest.mark.skipif(not cpu_panel_gemm.beats_onednn(torch.bfloat16),
                                 reason="the bf16 kernel runs on AMX, which this CPU lacks")


def _packed(gen, out_features, in_features):
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    packed = klinear.pack_weight(weight)
    if not cpu_panel_gemm.record_layout(weight, packed):
        pytest.skip("oneDNN packs this shape in another layout on this CPU")
    return weight, packed


def _reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, cpu_panel_gemm.MAX_ROWS])
@pytest.mark.parametrize("in_features, out_features", [
    (64, 192),
    (576, 1536),  # SmolLM2's gate-up
    (70, 100),  # in past a multiple of 16, out past a multiple of 64: both paddings
    (33, 129),
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(gen, rows, in_features, out_features, bias):
    weight, packed = _packed(gen, out_features, in_features)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    got = cpu_panel_gemm.panel_linear(x, packed, b)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, weight, b), rtol=1e-5, atol=1e-5)


def test_rows_of_a_wider_tensor_are_read_only_up_to_in_features(gen):
    """x a column slice (row stride > in): what lies past it (NaN here) is never read."""
    weight, packed = _packed(gen, 200, 80)
    wide = torch.randn(9, 85, generator=gen)
    wide[:, 80:] = float("nan")
    x = wide[:, :80]
    got = cpu_panel_gemm.panel_linear(x, packed)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _reference(x, weight, None), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rows_beside_it(gen):
    """Each row sums in the same order alone or among others, bit for bit."""
    weight, packed = _packed(gen, 1536, 576)
    x = torch.randn(cpu_panel_gemm.MAX_ROWS, 576, generator=gen)
    batch = cpu_panel_gemm.panel_linear(x, packed)
    for rows in (1, 3, 7):
        assert torch.equal(cpu_panel_gemm.panel_linear(x[:rows], packed), batch[:rows])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16,
                                                               marks=bf16_kernel)])
def test_several_threads_give_the_same_sums(gen, monkeypatch, dtype):
    weight, packed = (_packed if dtype == torch.float32 else _packed_bf16)(gen, 960, 576)
    x = torch.randn(8, 576, generator=gen).to(dtype)
    alone = cpu_panel_gemm.panel_linear(x, packed)
    monkeypatch.setattr(cpu_panel_gemm, "PARALLEL_MIN_WORK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_panel_gemm.panel_linear(x, packed), alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("registers_fit", [True, False])
def test_linear_sends_few_rows_to_the_kernel_and_more_to_onednn(gen, monkeypatch,
                                                                registers_fit):
    """Where the kernel's rows stay in registers (AVX-512) up to MAX_ROWS rows go to it;
    elsewhere every row goes to oneDNN."""
    weight, packed = _packed(gen, 192, 64)
    calls = []
    real = cpu_panel_gemm.panel_linear
    monkeypatch.setattr(cpu_panel_gemm, "panel_linear",
                        lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    monkeypatch.setattr(cpu_panel_gemm, "beats_onednn",
                        lambda dtype=torch.float32: registers_fit)
    for rows in (1, cpu_panel_gemm.MAX_ROWS, cpu_panel_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        got = klinear.linear(x, weight, None, packed)
        torch.testing.assert_close(got.double(), _reference(x, weight, None), rtol=1e-5,
                                   atol=1e-5)
    assert calls == ([1, cpu_panel_gemm.MAX_ROWS] if registers_fit else [])


def test_the_build_says_whether_its_rows_stay_in_registers():
    """AVX-512 (the compiler's target here: -march=native) and only it."""
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
    assert cpu_panel_gemm.beats_onednn() == ("avx512f" in flags)


def test_the_layout_check_refuses_what_is_not_the_panels(gen):
    lib = cpu_panel_gemm._library()
    weight = torch.randn(100, 70, generator=gen)
    packed = klinear.pack_weight(weight)
    ptr, nbytes = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    if not lib.panel_layout_matches(weight.data_ptr(), 100, 70, ptr, nbytes):
        pytest.skip("oneDNN packs this shape in another layout on this CPU")
    other = weight.clone()
    other[99, 69] += 1.0  # one weight differs: the last panel's last real value
    assert not lib.panel_layout_matches(other.data_ptr(), 100, 70, ptr, nbytes)
    assert not lib.panel_layout_matches(weight.data_ptr(), 100, 70, ptr, nbytes - 4)
    assert not lib.panel_layout_matches(weight.data_ptr(), 70, 100, ptr, nbytes)


def test_a_shape_whose_layout_was_not_confirmed_stays_with_onednn(gen, monkeypatch):
    weight, packed = _packed(gen, 192, 64)
    monkeypatch.setitem(cpu_panel_gemm._confirmed, (192, 64, torch.float32), False)
    x = torch.randn(2, 64, generator=gen)
    assert not cpu_panel_gemm.takes(x, packed)
    with pytest.raises(ValueError, match="record_layout confirmed"):
        cpu_panel_gemm.panel_linear(x, packed)
    torch.testing.assert_close(klinear.linear(x, weight, None, packed).double(),
                               _reference(x, weight, None), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_take(gen):
    weight, packed = _packed(gen, 192, 64)
    for x, match in ((torch.randn(cpu_panel_gemm.MAX_ROWS + 1, 64), "1-16 rows of the weight"),
                     (torch.randn(2, 64, dtype=torch.float64), "1-16 rows of the weight"),
                     (torch.randn(2, 65), "x has 65 features, the weight takes 64")):
        with pytest.raises(ValueError, match=match):
            cpu_panel_gemm.panel_linear(x, packed)


def _packed_bf16(gen, out_features, in_features):
    weight = (torch.randn(out_features, in_features, generator=gen)
              / in_features ** 0.5).to(torch.bfloat16)
    packed = klinear.pack_weight(weight)
    if not cpu_panel_gemm.record_layout(weight, packed):
        pytest.skip("oneDNN packs this bf16 shape in another layout on this CPU")
    return weight, packed


@bf16_kernel
@pytest.mark.parametrize("rows", [1, 2, 7, cpu_panel_gemm.MAX_ROWS])
@pytest.mark.parametrize("in_features, out_features", [
    (576, 960),  # SmolLM2's qkv
    (1536, 576),  # its down projection
    (37, 100),  # in past a multiple of 32, out past a multiple of 32: both paddings
    (5, 7),
])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matches_f_linear_and_onednn(gen, rows, in_features, out_features, bias):
    """To bf16's rounding of the float64 product, and bit for bit what oneDNN's own bf16
    GEMM gives on the same packed weight."""
    weight, packed = _packed_bf16(gen, out_features, in_features)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    got = cpu_panel_gemm.panel_linear(x, packed, b)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _reference(x, weight, b), rtol=1e-2, atol=1e-2)
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""))


@bf16_kernel
def test_bf16_rows_of_a_wider_tensor_are_read_only_up_to_in_features(gen):
    weight, packed = _packed_bf16(gen, 64, 40)
    wide = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    wide[:, 40:] = float("nan")
    got = cpu_panel_gemm.panel_linear(wide[:, :40], packed)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _reference(wide[:, :40], weight, None), rtol=1e-2,
                               atol=1e-2)


def test_the_bf16_layout_check_refuses_what_is_not_the_panels(gen):
    lib = cpu_panel_gemm._library()
    weight = torch.randn(100, 70, generator=gen).to(torch.bfloat16)
    packed = klinear.pack_weight(weight)
    ptr, nbytes = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    if not lib.panel_layout_matches_bf16(weight.data_ptr(), 100, 70, ptr, nbytes):
        pytest.skip("oneDNN packs this bf16 shape in another layout on this CPU")
    other = weight.clone()
    other[99, 69] += 1.0
    assert not lib.panel_layout_matches_bf16(other.data_ptr(), 100, 70, ptr, nbytes)
    assert not lib.panel_layout_matches_bf16(weight.data_ptr(), 100, 70, ptr, nbytes - 64)
    assert not lib.panel_layout_matches_bf16(weight.data_ptr(), 70, 100, ptr, nbytes)


def test_the_bf16_kernel_runs_where_amx_is():
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
    if "amx_bf16" not in flags:
        assert not cpu_panel_gemm.beats_onednn(torch.bfloat16)
    else:  # the kernel also needs Linux to grant the tiles, which every kernel since 5.16 does
        assert cpu_panel_gemm.beats_onednn(torch.bfloat16)


@bf16_kernel
@pytest.mark.parametrize("rows", [17, 31, 32, 33, 70])
def test_bf16_past_one_tile_of_rows(gen, rows, monkeypatch):
    """Past 16 rows a pass over the weight takes two tiles of rows, past 32 another pass: each
    row's sums are those of the row alone, and up to 32 rows oneDNN's, bit for bit (past 32
    oneDNN takes other kernels). The call on its own takes MAX_ROWS rows; the fused decode
    hands it up to 32."""
    monkeypatch.setattr(cpu_panel_gemm, "MAX_ROWS", 128)
    weight, packed = _packed_bf16(gen, 576, 1536)
    b = torch.randn(576, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 1536, generator=gen).to(torch.bfloat16)
    got = cpu_panel_gemm.panel_linear(x, packed, b)
    torch.testing.assert_close(got.double(), _reference(x, weight, b), rtol=1e-2, atol=1e-2)
    alone = torch.cat([cpu_panel_gemm.panel_linear(x[i:i + 1], packed, b) for i in range(rows)])
    assert torch.equal(got, alone)
    if rows <= 32:
        assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [],
                                                                   ""))
