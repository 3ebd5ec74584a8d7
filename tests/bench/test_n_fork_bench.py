"""``python -m pdserve.bench.n_fork --quick`` runs and prints both setups (it never asserts)."""

from __future__ import annotations

from pdserve.bench import n_fork


def test_n_fork_bench_quick_prints_both_setups(capsys):
    n_fork.main(["--quick", "--n", "3", "--prompt-tokens", "40", "--max-tokens", "4"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "n=" in line]
    assert len(rows) == 2 and all(line.rstrip().endswith("yes") for line in rows), out
