"""``python -m pdserve.bench.cuda_graphs --quick`` runs on the CPU with the stand-in capture
and prints its table: both modes timed, and the same greedy tokens from both (it never
asserts timings)."""

from __future__ import annotations

import re

from pdserve.bench import cuda_graphs


def test_cuda_graphs_bench_quick_prints_both_modes_with_equal_tokens(capsys):
    cuda_graphs.main(["--quick"])
    out = capsys.readouterr().out
    assert "decode step, eager against CUDA graphs (CPU, stand-in capture" in out, out
    for batch in (1, 3):  # 3 replays the graph of 4 with a padding row
        row = re.search(rf"^\s*tiny\s+float32\s+{batch}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)",
                        out, re.M)
        assert row, out
        assert float(row[1]) > 0 and float(row[2]) > 0
        assert row[4] == "yes", out
