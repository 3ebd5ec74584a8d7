"""``python -m pdserve.bench.engine --quick`` runs and prints its four sections (it never
asserts timings); ``--context`` sets section 1's prompts."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve import kernels
from pdserve.bench import engine
from pdserve.kernels import cpu_decode_layers, cpu_panel_gemm


def test_engine_bench_quick_prints_every_section(capsys):
    engine.main(["--quick"])
    out = capsys.readouterr().out
    for title in ("1. decode step vs memory roofline", "2. engine overhead per decode step",
                  "3. continuous batching vs Hugging Face static batching", "4. prefill steps"):
        assert title in out, out
    native = "native" if kernels.cpu_decode_attention.available() else "torch"
    panel = "panel" if cpu_panel_gemm.beats_onednn() else "onednn"
    fused = "yes" if native == "native" and cpu_decode_layers.serves_dtype(torch.float32) \
        else "no"
    for dtype, gemm, attention, fused_ran in (
            ("float32", panel, native, fused), ("float32", panel, native, "no"),
            ("float32", "onednn", native, "no"), ("float32", panel, "torch", "no"),
            ("float32", "plain", native, "no"), ("bfloat16", "plain", native, "no")):
        assert re.search(rf"^\s*{dtype}\s+{gemm}\s+{attention}\s+{fused_ran}\s+8\s+[\d.]+",
                         out, re.M), out
    for lengths in ("16", "16-31"):  # one prompt length, and a block's worth of lengths
        assert re.search(rf"^\s*8\s+{lengths}\s+greedy\s+[\d.]+", out, re.M), out
    for decoding in [*engine.SAMPLED, f"greedy, window {engine.WINDOW}",
                     f"greedy, window {engine.WINDOW}, general path"]:
        assert re.search(rf"^\s*8\s+16-31\s+{decoding}\s+[\d.]+", out, re.M), out
    assert "pdserve continuous" in out and "HF generate static (batch 8)" in out, out
    assert re.search(r"one join to 8 decode rows, the rows' sync: appended \d+ us, "
                     r"mapped \d+ us, read afresh \d+ us", out), out
    assert re.search(r"arrivals beside 8 decode rows \(one every 4 steps, colocated\): the rows "
                     r"step after each prefill \d+ us outside the forward, the other rows steps "
                     r"\d+ us", out), out
    # the step profile of pdserve's own run: every request's tokens came out of some step
    profile = re.search(r"pdserve's steps: (\d+), (\d+) of them pure decode with ([\d.]+) "
                        r"sequences on average; the forward is (\d+)% of step time", out)
    assert profile, out
    steps, decode, mean_batch, forward = profile.groups()
    assert 0 < int(decode) < int(steps) and 1.0 <= float(mean_batch) <= 16
    assert 0 < int(forward) <= 100
    # section 4: the steps took the prompts asked for (32 tokens each), the mixed one a decode
    for dtype in ("float32", "bfloat16"):
        for step, seqs, tokens in (("1 prompt", 1, 32), ("7 prompts", 7, 224),
                                   (r"1 decode \+ 7 prompts", 8, 224)):
            assert re.search(rf"^\s*{dtype}\s+{step}\s+{seqs}\s+{tokens}\s+[\d.]+", out,
                             re.M), out


def test_the_roofline_decodes_after_prompts_of_the_context_asked_for(capsys, monkeypatch):
    seen = []
    real = engine.decode_steps
    monkeypatch.setattr(engine, "decode_steps", lambda eng, batch, prompt_len, *rest:
                        seen.append(prompt_len) or real(eng, batch, prompt_len, *rest))
    engine.main(["--quick", "--roofline-only", "--context", "300", "--batches", "3"])
    out = capsys.readouterr().out
    assert "1. decode step vs memory roofline (random tiny Llama, prompts of 300 tokens)" in out
    assert seen and set(seen) == {300}
    assert re.search(r"^\s*float32\s+\S+\s+\S+\s+\S+\s+3\s+[\d.]+", out, re.M), out
    assert not re.search(r"^\s*float32\s+\S+\s+\S+\s+\S+\s+8\s+[\d.]+", out, re.M), out
    with pytest.raises(SystemExit) as refused:
        engine.main(["--quick", "--context", "0"])
    assert refused.value.code == 2 and "--context must be at least 1" in capsys.readouterr().err
