"""``python -m pdserve.bench.bf16_ties`` at its smallest prints its table (it never asserts how
far the runs lie apart)."""

from __future__ import annotations

import re

from pdserve.bench import bf16_ties


def test_bf16_ties_prints_a_row_per_checkpoint(capsys):
    bf16_ties.main(["--seeds", "1", "--prompts", "2", "--tokens", "3"])
    out = capsys.readouterr().out
    assert "worst |ours - hf bf16|" in out, out
    assert re.search(r"^\s*0\s+[\d.]+\s+[\d.]+\s+[012]\s+\S+\s*$", out, re.M), out
