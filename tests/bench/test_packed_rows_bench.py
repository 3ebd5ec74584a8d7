"""``python -m pdserve.bench.packed_rows --quick`` prints its table (it never asserts timings)."""

from __future__ import annotations

import re

import pytest

from pdserve.bench import packed_rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_rows_quick_prints_every_row_count(capsys, dtype):
    packed_rows.main(["--quick", "--dtype", dtype])
    out = capsys.readouterr().out
    if "nothing to measure" in out:
        return
    assert all(f"{way} ms" in out for way in packed_rows.WAYS), out
    for rows in (1, 2, 3, 4, 8, 16, 32):
        assert re.search(rf"^\s*{rows}(\s+[\d.]+){{3}}\s+([\d.]+|-)\s*$", out, re.M), out
