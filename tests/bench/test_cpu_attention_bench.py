"""``python -m pdserve.bench.cpu_attention --quick`` prints a row per point (it never asserts
timings), and the case it times reads what the engine's attention reads; likewise its
``--prompts`` section."""

from __future__ import annotations

import re

import torch

from pdserve.bench import cpu_attention
from pdserve.kernels import torch_attention


def test_quick_prints_every_point(capsys):
    cpu_attention.main(["--quick", "--threads", "1"])
    out = capsys.readouterr().out
    for dtype in ("float32", "bfloat16"):
        for batch in (1, 4):
            assert re.search(rf"^\s*{dtype}\s+{batch}\s+64\s+1\s+(C|torch)(\s+[\d.]+){{3}}\s*$",
                             out, re.M), out


def test_the_case_is_a_scattered_pool_the_kernel_reads_right():
    query, cache, tables, lens = cpu_attention.make_case(3, 40, torch.float32)
    assert sorted(tables.flatten().tolist()) == list(range(cache.num_blocks))  # each once
    assert tables.flatten().tolist() != list(range(cache.num_blocks))  # not in order
    scale = cpu_attention.HEAD_DIM ** -0.5
    got = cpu_attention.paged_decode_attention(query, cache, tables, lens, scale,
                                               backend="native")
    expected = torch_attention.paged_decode_attention_torch(query, cache, tables, lens, scale)
    torch.testing.assert_close(got, expected)
    assert cpu_attention.context_bytes(3, 40, torch.float32) == 2 * 3 * 40 * 3 * 64 * 4


def test_quick_prompts_print_a_row_per_thread_count(capsys):
    before = torch.get_num_threads()
    cpu_attention.main(["--quick", "--prompts", "--threads", "1", "2"])
    out = capsys.readouterr().out
    for dtype in ("bfloat16", "float32"):
        for threads in (1, 2):
            row = rf"^\s*64\s+{dtype}\s+{threads}\s+(C AMX|C|SDPA)(\s+[\d.]+){{5}}\s*$"
            assert re.search(row, out, re.M), out
    assert torch.get_num_threads() == before  # restored, not left at the last count


def test_the_prompt_case_is_a_packed_projection_and_its_flops_count_causal_pairs():
    q, k, v = cpu_attention.prompt_case(5)
    assert q.shape == (5, 9, 64) and k.shape == v.shape == (5, 3, 64) and q.dtype == torch.bfloat16
    assert not q.is_contiguous() and q.stride(0) == (9 + 2 * 3) * 64  # rows of one projection
    assert cpu_attention.prompt_flops(5) == 15 * 9 * 4 * 64  # pairs (i, j <= i) of 5 tokens
