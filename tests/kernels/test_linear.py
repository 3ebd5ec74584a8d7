"""The packed CPU linear against its reference, F.linear, on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_panel_gemm
from pdserve.kernels import linear as klinear
from pdserve.models.llama import Linear


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("in_features, out_features", [(64, 192), (576, 1536), (96, 509)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(gen, rows, in_features, out_features, bias):
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = klinear.pack_weight(weight)
    got = klinear.linear(x, weight, b, packed)
    want = F.linear(x, weight, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # only the summation order


needs_bf16 = pytest.mark.skipif(not klinear.bf16_native(),
                                reason="oneDNN has no bf16 kernels for this CPU")


def test_which_cpu_weights_pack(monkeypatch):
    assert klinear.can_pack(torch.zeros(4, 4))
    bf16 = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert klinear.can_pack(bf16) == klinear.bf16_native()
    monkeypatch.setattr(klinear, "bf16_native", lambda: False)  # a CPU without bf16 kernels
    for weight in (bf16, torch.zeros(4, 4, dtype=torch.float16), torch.zeros(4)):
        assert not klinear.can_pack(weight)
        with pytest.raises(ValueError, match="only a 2-D float32 .* CPU weight packs"):
            klinear.pack_weight(weight)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("in_features, out_features", [(64, 192), (576, 1536), (96, 509)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_the_float32_sums(gen, rows, in_features, out_features,
                                                     bias):
    """oneDNN's bf16 GEMM sums in float32 and rounds each output once to bf16 (the bias may
    add a second rounding): within 2^-7 of each value's size of the exact float32 result."""
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5)
    weight = weight.bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    got = klinear.linear(x, weight, b, klinear.pack_weight(weight))
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 31])
def test_bf16_rows_get_the_same_sums_as_in_a_larger_batch(gen, rows):
    """oneDNN's bf16 kernel gives a row the same sums whatever the number of rows up to 32 (a
    decode step's batch), unpadded: a request's tokens do not depend on its step's batch."""
    weight = (torch.randn(1536, 576, generator=gen) / 24).bfloat16()
    packed = klinear.pack_weight(weight)
    x = torch.randn(32, 576, generator=gen).bfloat16()
    batch = klinear.linear(x, weight, None, packed)
    alone = klinear.linear(x[:rows], weight, None, packed)
    assert torch.equal(alone, batch[:rows])


def test_a_packed_layer_keeps_only_the_packed_weight(gen):
    layer = Linear(32, 48, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 32, generator=gen))
        layer.bias.copy_(torch.randn(48, generator=gen))
    x = torch.randn(5, 32, generator=gen)
    before = layer.forward(x)
    layer.pack()
    assert layer.weight.numel() == 0 and layer.packed.is_mkldnn
    torch.testing.assert_close(layer.forward(x), before, rtol=1e-5, atol=1e-5)
    layer.pack()  # again: a no-op
    torch.testing.assert_close(layer.forward(x), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", range(1, klinear.min_packed_rows(torch.float32)))
@pytest.mark.parametrize("panel_gemm", [True, False])
def test_few_rows_get_the_same_sums_as_in_a_larger_batch(gen, rows, panel_gemm, monkeypatch):
    """A request's logits do not depend on how many others share its step (each row equals
    the same row computed among many): through the C panel GEMM, or, without it, through
    oneDNN with fewer rows than min_packed_rows padded."""
    if not panel_gemm:
        monkeypatch.setattr(cpu_panel_gemm, "takes", lambda x, packed: False)
    weight = torch.randn(1536, 576, generator=gen) / 24
    packed = klinear.pack_weight(weight)
    x = torch.randn(16, 576, generator=gen)
    batch = klinear.linear(x, weight, None, packed)
    alone = klinear.linear(x[:rows], weight, None, packed)
    assert alone.shape == (rows, 1536)
    assert torch.equal(alone, batch[:rows])
