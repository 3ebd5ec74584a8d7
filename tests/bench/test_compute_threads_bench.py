"""``python -m pdserve.bench.compute_threads --quick --gemms`` prints a row for every
arrangement and every GEMM's weight shape (it never asserts timings)."""

from __future__ import annotations

import re

from pdserve.bench import compute_threads


def test_compute_threads_quick_prints_every_arrangement(capsys):
    compute_threads.main(["--quick", "--gemms"])
    out = capsys.readouterr().out
    for arrangement in compute_threads.ARRANGEMENTS:
        threads = 1 if arrangement == "one thread" else 2
        assert re.search(rf"^\s*{re.escape(arrangement)}\s+{threads}(\s+[\d.,]+){{3}}\s*$",
                         out, re.M), out
    for shape in ("960x576", "576x576", "3072x576", "576x1536"):  # SmolLM2's four GEMMs
        assert re.search(rf"^\s*{shape}(\s+[\d.,]+){{3}}\s*$", out, re.M), out
