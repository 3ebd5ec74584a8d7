"""``python -m pdserve.bench.tensor_parallel`` runs end to end on a tiny model: a row per group
size and phase, each with its ratio to TP=1, and the greedy comparison."""

from __future__ import annotations

from pdserve.bench import tensor_parallel


def test_tp_bench_prints_every_size_and_phase(tiny_dir):
    table = tensor_parallel.run(tiny_dir, sizes=[1, 2], device="cpu", dtype="float32",
                                batches=[1, 4], prompt_len=16, steps=2)
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [(r[0], r[2], r[3]) for r in rows] == [
        (size, phase, n) for size in ("1", "2")
        for phase, n in (("prefill", "16"), ("decode", "1"), ("decode", "4"))]
    assert all(r[-1] == "same" for r in rows)
    assert all(r[5] == "1.00" for r in rows[:3])
    assert all(float(r[5]) > 0 for r in rows[3:])  # each a ratio to TP=1
