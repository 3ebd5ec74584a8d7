"""``python -m pdserve.bench.lora_delta --quick`` prints a row per (step, layer) with every way
timed and their deltas agreeing (it never asserts timings)."""

from __future__ import annotations

import re

from pdserve.bench import lora_delta


def test_quick_run_prints_every_case(capsys):
    lora_delta.main(["--quick"])
    out = capsys.readouterr().out
    for step, rows, adapters in lora_delta.STEPS:
        for layer in lora_delta.LAYERS:
            line = re.search(rf"^\s*{step}\s+{rows}\s+{adapters}\s+{layer}"
                             rf"((\s+[\d.,]+){{5}})\s+(\S+)\s*$", out, re.M)
            assert line, out
            assert float(line.group(3)) < 1e-4, line.group(0)  # the ways agree
