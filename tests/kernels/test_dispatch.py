"""The dispatch point: backend names, Triton forced on CPU (interpreter) matches torch, and the
CPU serving path never imports triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pdserve import kernels
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error


def test_resolve_backend():
    cpu = torch.device("cpu")
    native = kernels.cpu_decode_attention.available()
    assert kernels.resolve_backend("auto", cpu) == ("native" if native else "torch")
    assert kernels.resolve_backend("torch", cpu) == "torch"
    assert kernels.resolve_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        kernels.resolve_backend("cuda", cpu)
    with pytest.raises(ValueError, match="native"):
        kernels.resolve_backend("native", torch.device("meta"))


@pytest.mark.triton
def test_forced_triton_matches_torch_through_dispatch(gen):
    batch = random_paged_batch([13, 6], [5, 1], 4, 2, 64, 4, torch.float32, gen)
    outs = {}
    for backend in ("torch", "triton"):
        prefill = kernels.paged_attention(
            batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.125, 4, backend=backend, max_query_len=5,
            max_context_len=13)
        decode = kernels.paged_decode_attention(
            batch.query[[4, 5]], batch.cache, batch.block_tables, batch.context_lens, 0.125,
            backend=backend, max_context_len=13)
        norm = kernels.rms_norm(batch.query, torch.ones(64), 1e-6, backend=backend)
        outs[backend] = (prefill, decode, norm)
    for got, want in zip(outs["triton"], outs["torch"], strict=True):
        assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.triton
def test_every_op_dispatches_to_triton_and_leaves_the_package_intact(gen):
    """Each op runs through its Triton module; importing those modules must not rebind the
    package's functions (a submodule named like a function would replace it)."""
    batch = random_paged_batch([6], [6], 2, 1, 16, 4, torch.float32, gen)
    q, k = batch.query, batch.query[:, :1].contiguous()
    kernels.write_kv(k, k, batch.cache, batch.slot_mapping, backend="triton")
    kernels.rotary(q, k, torch.arange(6), torch.randn(8, 16), backend="triton")
    kernels.silu_and_mul(q, backend="triton")
    buffer = kernels.pack_blocks([batch.cache], torch.tensor([1]), backend="triton")
    kernels.unpack_blocks(buffer, [batch.cache], torch.tensor([2]), backend="triton")
    for name in kernels.__all__:
        if name not in ("BACKENDS", "KVCacheLayer"):
            assert callable(getattr(kernels, name)) and not isinstance(
                getattr(kernels, name), type(kernels)), name


def test_cpu_path_never_imports_triton():
    code = textwrap.dedent("""
        import sys, torch
        from pdserve import kernels
        from pdserve.testing.paged_batches import random_paged_batch
        from pdserve.models.attention import Attention, AttentionMetadata
        b = random_paged_batch([5], [5], 2, 1, 16, 4, torch.float32, torch.Generator())
        meta = AttentionMetadata(b.slot_mapping, b.cu_seqlens_q, b.context_lens,
                                 b.block_tables, 5, 5)
        q = b.query
        Attention(2, 1, 16, 0.25).forward(q, q[:, :1], q[:, :1], b.cache, meta)
        kernels.rms_norm(q, torch.ones(16), 1e-6)
        kernels.pack_blocks([b.cache], torch.tensor([1]))
        assert "triton" not in sys.modules, "the CPU path imported triton"
    """)
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)
