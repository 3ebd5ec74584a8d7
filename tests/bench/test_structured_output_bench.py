"""``python -m pdserve.bench.structured_output --quick`` runs and prints both sections (it never
asserts timings)."""

from __future__ import annotations

import re

from pdserve.bench import structured_output


def test_structured_output_bench_quick_prints_both_sections(capsys):
    structured_output.main(["--quick"])
    out = capsys.readouterr().out
    assert "1. a constraint's cost before its first token" in out, out
    for line in (r"first constrained request of a fresh engine .*: \d+ ms",
                 r"a new schema on that engine: [\d.]+ ms",
                 r"a schema compiled before .*: \d+ us"):
        assert re.search(line, out), out
    assert "2. decode step time with rows under a JSON schema, against none" in out, out
    for rows in ("none", "1 row", "all 8"):
        assert re.search(rf"^\s*8\s+{rows}\s+[\d.]+\s+[\d.]+$", out, re.M), out
