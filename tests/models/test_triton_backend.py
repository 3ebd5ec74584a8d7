"""The decoder on the Triton kernels equals the decoder on the torch references.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set here before any Triton kernel module
is imported; the CPU path never imports one); on CUDA the same test runs the compiled kernels.
It checks how the model feeds the kernels (strided q/k/v views of the fused qkv, per-head
q/k norm, per-layer windows), which the kernel tests alone do not.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.models import load_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 9, 33, 7, 100, 4, 8, 200, 11, 12, 13], [300, 2, 77]]


def _two_steps(model, paged_batch, backend: str) -> torch.Tensor:
    """Prefill both prompts, then decode one token each; logits of both steps, stacked."""
    batch = paged_batch(model.config, len(PROMPTS), 16, seed=3, device=DEVICE, backend=backend)
    ids, pos, meta = batch.step({s: (0, p) for s, p in enumerate(PROMPTS)})
    first = model.compute_logits(model(ids, pos, batch.caches, meta))
    ids, pos, meta = batch.step({s: (len(p), [42]) for s, p in enumerate(PROMPTS)})
    second = model.compute_logits(model(ids, pos, batch.caches, meta))
    return torch.cat([first, second]).cpu()


@pytest.mark.triton
@pytest.mark.parametrize("name", ["qwen3-qknorm", "mistral-window"])
def test_triton_backend_matches_torch(hf_checkpoint, paged_batch, name):
    model = load_model(hf_checkpoint(name), device=DEVICE)
    ref = _two_steps(model, paged_batch, "torch")
    out = _two_steps(model, paged_batch, "triton")
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
