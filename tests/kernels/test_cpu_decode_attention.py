"""The C decode attention against paged_decode_attention_torch on random paged batches.

The pools are shuffled and every slot outside a context is NaN (random_paged_batch), so a read
past a context or behind table padding shows as a NaN in the output.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import cpu_decode_attention, native_build
from pdserve.kernels.cpu_decode_attention import paged_decode_attention_cpu
from pdserve.kernels.torch_attention import paged_decode_attention_torch
from pdserve.testing.paged_batches import TOLERANCE, random_paged_batch, relative_error

pytestmark = pytest.mark.skipif(not cpu_decode_attention.available(),
                                reason="no working C compiler on this machine")


def _check(batch, scale, window, threads=1, dtype=torch.float32):
    args = (batch.query, batch.cache, batch.block_tables, batch.context_lens, scale, window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(*args)
    finally:
        torch.set_num_threads(before)
    ref = paged_decode_attention_torch(*args)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "a poisoned slot was read"
    if dtype == torch.bfloat16:  # both sum in float32, then round once: a bf16 step at most
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
    else:
        assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size,window", [
    (1, 2, 64, 16, None),
    (3, 3, 64, 16, None),  # SmolLM2's shape
    (4, 2, 128, 8, None),
    (8, 1, 16, 4, 7),
    (2, 2, 24, 1, None),  # head_dim with a tail past the last 16 lanes
    (1, 1, 80, 16, 33),
    (4, 1, 512, 16, None),  # the widest head it takes
    (12, 1, 32, 4, 20),  # more query heads per kv head than one pass takes
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_reference(gen, group, kv_heads, head_dim, block_size, window, dtype):
    """A float32 pool, and a bfloat16 one read in place (the reference widens it to float32)."""
    lens = [1, block_size + 1, 70] + torch.randint(2, 90, (3,), generator=gen).tolist()
    batch = random_paged_batch(lens, [1] * len(lens), group * kv_heads, kv_heads, head_dim,
                               block_size, dtype, gen)
    _check(batch, head_dim ** -0.5, window, dtype=dtype)


@pytest.mark.parametrize("trial", range(3))
def test_random_configuration_on_several_threads(gen, trial, monkeypatch):
    monkeypatch.setattr(cpu_decode_attention, "PARALLEL_MIN_WORK", 0)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
    group, kv_heads, head_dim = pick([1, 2, 3, 4, 8]), pick([1, 2, 3]), pick([16, 48, 64, 96])
    block_size, window = pick([1, 4, 16, 32]), pick([None, None, 1, 5, 40])
    lens = torch.randint(1, 300, (pick([1, 5, 17]),), generator=gen).tolist()
    dtype = pick([torch.float32, torch.bfloat16])
    print(dict(group=group, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
               window=window, lens=lens, dtype=dtype))
    batch = random_paged_batch(lens, [1] * len(lens), group * kv_heads, kv_heads, head_dim,
                               block_size, dtype, gen)
    _check(batch, 0.1, window, threads=2, dtype=dtype)


def test_a_window_longer_than_the_context_and_a_window_of_one(gen):
    batch = random_paged_batch([5, 40], [1, 1], 2, 2, 64, 4, torch.float32, gen)
    _check(batch, 0.125, 64)
    _check(batch, 0.125, 1)


def test_the_mixed_batch_path_sends_its_decodes_through_the_kernel(gen, monkeypatch):
    """A prefill chunk beside decodes: the native backend's decode rows come from the C kernel
    and the whole batch still matches the torch path."""
    batch = random_paged_batch([30, 9, 51], [12, 1, 1], 4, 2, 64, 8, torch.float32, gen)
    args = (batch.query, batch.cache, batch.cu_seqlens_q, batch.context_lens,
            batch.block_tables, 0.125)
    calls = []
    real = cpu_decode_attention.paged_decode_attention_cpu
    monkeypatch.setattr(cpu_decode_attention, "paged_decode_attention_cpu",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    out = kernels.paged_attention(*args, backend="native")
    ref = kernels.paged_attention(*args, backend="torch")
    assert calls == [2]
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


def test_int8_and_float16_pools_take_the_torch_path(gen):
    for dtype, quantized in ((torch.float32, True), (torch.float16, False)):
        batch = random_paged_batch([20, 3], [1, 1], 4, 2, 64, 4, dtype, gen, quantized=quantized)
        assert not cpu_decode_attention.takes(batch.query, batch.cache)
        args = (batch.query, batch.cache, batch.block_tables, batch.context_lens, 0.125)
        out = kernels.paged_decode_attention(*args, backend="native")
        assert torch.equal(out, paged_decode_attention_torch(*args))
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            paged_decode_attention_cpu(*args)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(block_tables=a["block_tables"] + 1000), "outside the pool"),
    (lambda a: a.update(block_tables=a["block_tables"][:, :1]), "longer than its table"),
    (lambda a: a.update(sliding_window=0), "sliding_window"),
])
def test_bad_tables_are_refused_not_read(gen, change, message):
    batch = random_paged_batch([40, 3], [1, 1], 4, 2, 64, 4, torch.float32, gen)
    args = dict(query=batch.query, cache=batch.cache, block_tables=batch.block_tables,
                context_lens=batch.context_lens, scale=0.1, sliding_window=None)
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_cpu(**args)


def test_the_build_is_cached_and_a_missing_compiler_falls_back(tmp_path, monkeypatch):
    """A second build of the same source loads the cached library; with no compiler the loader
    says why and returns None, and the engine's choice falls back to torch."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = native_build.build("cpu_pointwise")  # (the quickest of the kernels to compile)
    assert first.parent == tmp_path / "native" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native_build.build("cpu_pointwise") == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    native_build.load.cache_clear()
    try:
        assert native_build.load("cpu_decode_attention") is None
    finally:
        native_build.load.cache_clear()


def test_a_changed_header_builds_anew(tmp_path, monkeypatch):
    """cpu_pointwise.c includes native_pointwise.h, which includes native_vec.h: a change to a
    header makes a new library, not the cached one built from the old header."""
    sources = tmp_path / "src"
    sources.mkdir()
    for source in [native_build.SOURCE_DIR / "cpu_pointwise.c",
                   *native_build.SOURCE_DIR.glob("*.h")]:
        (sources / source.name).write_text(source.read_text())
    monkeypatch.setattr(native_build, "SOURCE_DIR", sources)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    before = native_build.build("cpu_pointwise")
    with (sources / "native_vec.h").open("a") as header:
        header.write("/* changed */\n")
    after = native_build.build("cpu_pointwise")
    assert after != before and after.exists() and before.exists()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
    native_build.load.cache_clear()
    try:
        assert native_build.load("cpu_decode_attention") is None
    finally:
        native_build.load.cache_clear()
