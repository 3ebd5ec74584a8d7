"""bench/kernels.py: exits cleanly without CUDA, and its cases pass at toy shapes under the
Triton interpreter (so the GPU run starts from code that has run)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import kernels as bench


def test_without_cuda_says_so_and_exits_zero(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.triton
def test_tiny_run_checks_every_case(capsys):
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    for name in ("decode attention", "prefill attention int8", "rms_norm+residual", "rotary",
                 "silu_and_mul", "write_kv int8", "pack_blocks", "unpack_blocks", "lora delta"):
        assert name in out
    assert " NO " not in out
