"""Batched LoRA deltas: the CPU paths (grouped, span, the choice between them) and the Triton
kernel against the gather reference (mixed adapters, base-model rows, one adapter for all
rows), and the kernel's refusal of bad inputs."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.dispatch import lora_delta
from pdserve.kernels.lora import (
    LoraBatch,
    lora_delta_cpu,
    lora_delta_gather,
    lora_delta_grouped,
    lora_delta_span,
)

NUM_SLOTS = 3


def _weights(in_features, out_features, rank, gen, dtype=torch.float32):
    """Slot pools a (slots, rank, in) and b (slots, out, rank), scaled so a delta is O(1)."""
    a = torch.randn(NUM_SLOTS, rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(NUM_SLOTS, out_features, rank, generator=gen) / rank ** 0.5
    return a.to(dtype), b.to(dtype)


def _slots(kind: str, num_tokens: int, gen) -> torch.Tensor:
    if kind == "mixed":  # every slot and the base model, in random order
        return torch.randint(-1, NUM_SLOTS, (num_tokens,), generator=gen)
    if kind == "base":
        return torch.full((num_tokens,), -1)
    return torch.full((num_tokens,), NUM_SLOTS - 1)  # "one": every row one adapter


@pytest.mark.parametrize("path", [lora_delta_grouped, lora_delta_span, lora_delta_cpu])
@pytest.mark.parametrize("kind,num_tokens", [("mixed", 13), ("mixed", 64), ("one", 9),
                                             ("one", 1), ("mixed", 1), ("mixed", 8)])
def test_cpu_paths_equal_gather(gen, kind, num_tokens, path):
    in_features, out_features, rank = 40, 24, 8
    x = torch.randn(num_tokens, in_features, generator=gen)
    a, b = _weights(in_features, out_features, rank, gen)
    slots = _slots(kind, num_tokens, gen)
    want = torch.randn(num_tokens, out_features, generator=gen)
    got = want.clone()
    lora_delta_gather(want, x, a, b, slots)
    batch = LoraBatch.of(slots)
    if batch is None:  # a single base-model row
        assert (slots == -1).all()
        return
    path(got, x, a, b, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_base_model_rows_are_untouched(gen):
    x = torch.randn(5, 16, generator=gen)
    a, b = _weights(16, 12, 4, gen)
    slots = _slots("base", 5, gen)
    assert LoraBatch.of(slots) is None  # the layer skips the LoRA step altogether
    before = torch.randn(5, 12, generator=gen)
    out = before.clone()
    lora_delta_gather(out, x, a, b, slots)
    lora_delta_grouped(out, x, a, b, LoraBatch(slots, ()))
    assert torch.equal(out, before)


def test_grouped_rows_of_a_sub_batch(gen):
    """``of_rows`` keeps each row's slot: a prompt's rows alone get the same deltas."""
    x = torch.randn(10, 16, generator=gen)
    a, b = _weights(16, 12, 4, gen)
    slots = _slots("mixed", 10, gen)
    rows = torch.tensor([7, 2, 3])
    want = torch.zeros(10, 12)
    lora_delta_gather(want, x, a, b, slots)
    sub = LoraBatch.of(slots).of_rows(rows)
    got = torch.zeros(3, 12)
    if sub is not None:
        lora_delta_grouped(got, x[rows], a, b, sub)
    torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)


def _triton_case(num_tokens, in_features, out_features, rank, dtype, gen):
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a, b = _weights(in_features, out_features, rank, gen, dtype)
    slots = _slots("mixed", num_tokens, gen)
    slots[0] = NUM_SLOTS - 1  # at least one row with an adapter
    if num_tokens > 1:
        slots[1] = -1  # and one without
    out = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    return out, x, a, b, slots


TRITON_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
                    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}  # a bf16 ulp or two


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,rank", [(1, 1), (3, 4), (17, 16), (3, 16), (17, 1)])
def test_triton_equals_gather(gen, dtype, num_tokens, rank):
    from pdserve.kernels.lora_triton import lora_delta_triton

    # in and out are no multiple of the interpreter's 16-wide tiles, and span several.
    out, x, a, b, slots = _triton_case(num_tokens, 37, 45, rank, dtype, gen)
    want = out.clone()
    lora_delta_gather(want, x, a, b, slots)
    lora_delta_triton(out, x, a, b, slots)
    torch.testing.assert_close(out, want, **TRITON_TOLERANCE[dtype])


@pytest.mark.triton
def test_triton_skips_base_rows_and_takes_mixed_dtypes_and_strides(gen):
    """A base-model row's output is never written (its NaN and its -0.0 stay, its NaN input
    is never read); x a strided view in bf16, the weights fp16, out fp32, int32 slots."""
    from pdserve.kernels.lora_triton import lora_delta_triton

    wide = torch.randn(6, 50, generator=gen).bfloat16()
    x = wide[:, 3:40]  # (6, 37), row stride 50
    a, b = _weights(37, 20, 4, gen, torch.float16)
    slots = torch.tensor([2, -1, 0, -1, 1, 2], dtype=torch.int32)
    x[1] = float("nan")
    out = torch.randn(6, 20, generator=gen)
    out[3] = float("nan")
    out[1] = -0.0  # -0.0 + 0.0 is +0.0: rewritten even with a zero delta, it loses its sign
    want = out.clone()
    lora_delta_gather(want, x, a, b, slots)
    lora_delta_triton(out, x, a, b, slots)
    assert torch.equal(out.isnan(), want.isnan()) and out[3].isnan().all()
    assert out[1].signbit().all()
    torch.testing.assert_close(out.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_dispatch_routes_triton(gen):
    out, x, a, b, slots = _triton_case(5, 20, 18, 4, torch.float32, gen)
    want = out.clone()
    batch = LoraBatch.of(slots)
    lora_delta(want, x, a, b, batch, backend="torch")
    lora_delta(out, x, a, b, batch, backend="triton")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# (the argument the error must name, how to break a valid (out, x, a, b, token_slots))
BAD_INPUTS = [
    ("out", lambda o, x, a, b, s: (o[:-1], x, a, b, s)),  # T differs from x's
    ("out", lambda o, x, a, b, s: (o.int(), x, a, b, s)),
    ("out", lambda o, x, a, b, s: (o.t().contiguous().t(), x, a, b, s)),
    ("x", lambda o, x, a, b, s: (o, x[0], a, b, s)),
    ("x", lambda o, x, a, b, s: (o, x.tolist(), a, b, s)),
    ("a", lambda o, x, a, b, s: (o, x, a[:, :, :-1], b, s)),  # in differs from x's
    ("a", lambda o, x, a, b, s: (o, x, a[0], b, s)),
    ("b", lambda o, x, a, b, s: (o, x, a, b[:, :-1], s)),  # out differs
    ("b", lambda o, x, a, b, s: (o, x, a, b[:, :, :-1], s)),  # rank differs from a's
    ("b", lambda o, x, a, b, s: (o, x, a, b[:-1], s)),  # slots differ from a's
    ("token_slots", lambda o, x, a, b, s: (o, x, a, b, s[:-1])),
    ("token_slots", lambda o, x, a, b, s: (o, x, a, b, s.float())),
    ("token_slots", lambda o, x, a, b, s: (o, x, a, b, torch.stack([s, s], 1)[:, 0])),
]


@pytest.mark.triton
@pytest.mark.parametrize("field,breaker", BAD_INPUTS)
def test_bad_inputs_raise_naming_the_argument(gen, field, breaker):
    from pdserve.kernels.lora_triton import lora_delta_triton

    args = breaker(*_triton_case(4, 20, 18, 4, torch.float32, gen))
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        lora_delta_triton(*args)
