"""``python -m pdserve.bench.spec --quick`` runs and prints every setup (it never asserts)."""

from __future__ import annotations

from pdserve.bench import spec


def test_spec_bench_quick_prints_every_setup(capsys):
    spec.main(["--quick"])
    out = capsys.readouterr().out
    for setup in ("target as draft", "1-layer draft", "n-gram lookup"):
        assert out.count(setup) == 2, out  # batch 1 and 16
    assert "mean accept len" in out and "speedup" in out
    rows = [line for line in out.splitlines() if "draft" in line or "n-gram" in line]
    assert len(rows) == 6 and all(line.rstrip().endswith("yes") for line in rows), out
    assert "100.0%" in rows[0], out  # the target as its own draft accepts everything
