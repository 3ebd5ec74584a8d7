"""Section 4 of ``python -m pdserve.bench.disagg``: shipping a decode step's deltas and the
detokenizer's cost print for both forms (timings are never asserted; sizes are exact)."""

from __future__ import annotations

import re

from pdserve.bench.disagg import detokenize_line, shipping_table


def test_shipping_table_prints_both_forms_and_columns_are_smaller():
    table = shipping_table([4], 3)
    sizes = {}
    for line in table.splitlines()[2:]:
        batch, form, _, _, size = re.split(r"\s{2,}", line.strip())
        assert batch == "4"
        sizes[form] = float(size)
    assert set(sizes) == {"RequestDelta each", "columns"}
    assert sizes["columns"] < sizes["RequestDelta each"]


def test_detokenize_line_prints_both_paths():
    line = detokenize_line(repeats=1)
    assert re.fullmatch(r"incremental detokenization, us per token \(text / random ids\): "
                        r"DecodeStream [\d.]+ / [\d.]+, Python decodes [\d.]+ / [\d.]+", line), line
