"""The int8 quality matrix runs end to end on one of its shapes (the full matrix is a
benchmark: python -m pdserve.bench.kv_int8_matrix)."""

from __future__ import annotations

from pdserve.bench import kv_int8_matrix


def test_a_shape_row_per_scheme(tmp_path, tiny_dir):
    name = "qwen3 hd32 kv1, words"
    folder = kv_int8_matrix.write_shape(name, tmp_path / "shape", tiny_dir)
    rows = kv_int8_matrix.shape_rows(name, folder, ["hybrid", "static"])
    assert [r[:3] for r in rows] == [[name, "hybrid", "hybrid"], [name, "static", "static"]]
    for row in rows:
        kl, top1 = float(row[3]), float(row[5])
        assert 0 <= kl < 0.02 and top1 >= 80.0  # what the start-up check lets through
