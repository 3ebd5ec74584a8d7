"""``python -m pdserve.bench.cpu_dtypes --quick`` prints a row for every dtype, thread count and
figure (it never asserts timings)."""

from __future__ import annotations

import re

from pdserve.bench import cpu_dtypes


def test_cpu_dtypes_quick_prints_every_figure(capsys):
    cpu_dtypes.main(["--quick", "--threads", "1,2"])
    out = capsys.readouterr().out
    for threads in (1, 2):
        for dtype in cpu_dtypes.DTYPES:
            for figure in ("decode b1 ms", "decode b8 ms", "prefill 64 tok/s"):
                assert re.search(rf"^\s*{threads}\s+{dtype}\s+{figure}(\s+[\d.,]+){{3}}\s*$",
                                 out, re.M), out
