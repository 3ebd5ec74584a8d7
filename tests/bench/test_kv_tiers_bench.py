"""``python -m pdserve.bench.kv_tiers --quick`` runs every case end to end on the tiny model and
prints both tables (it never asserts timings; the token counts it prints are exact)."""

from __future__ import annotations

import re

from pdserve.bench import kv_tiers

CASES = ("no tiers", "host", "host small + disk", "host small, int8", "no reuse, no tiers",
         "no reuse, host small + disk")


def _hits(out: str, case: str) -> list[float]:
    """pool, host, disk, computed percentages of ``case``'s row in the hit table."""
    row = re.search(rf"^\s*{re.escape(case)}\s+\d+\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%\s+"
                    rf"([\d.]+)%", out, re.M)
    assert row, out
    return [float(x) for x in row.groups()]


def test_quick_runs_every_case_and_the_tiers_serve_what_the_pool_lost(tmp_path, capsys):
    kv_tiers.main(["--quick", "--disk-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert re.search(r"working set \d+ tokens = ([4-9]|\d\d+)\.\dx the pool", out), out
    shape = re.search(r"(\d+) conversations x (\d+) turns", out)
    assert shape, out
    requests = int(shape[1]) * int(shape[2])
    for case in CASES:  # the TTFT table: every case measured every request
        assert re.search(rf"^\s*{re.escape(case)}\s+{requests}\s+[\d.,]+\s+[\d.]+x", out, re.M), out
    pool, host, disk, computed = _hits(out, "no tiers")
    assert host == disk == 0 and computed > 0
    with_host = _hits(out, "host")
    assert with_host[0] == pool and with_host[1] > 0 and with_host[3] < computed
    with_disk = _hits(out, "host small + disk")
    assert with_disk[2] > 0 and with_disk[3] == with_host[3]  # the same tokens, lower down
    with_int8 = _hits(out, "host small, int8")  # (a third of the bytes holds every block)
    assert with_int8[0] == pool and with_int8[1] == with_host[1] and with_int8[2] == 0
    for case in CASES[4:]:  # nothing to reuse: every prompt token computed
        assert _hits(out, case) == [0.0, 0.0, 0.0, 100.0]
    assert re.search(r"a plain copy of one block here: memory copy [\d.]+ GB/s, file read "
                     r"[\d.]+ GB/s, CRC-32 [\d.]+ GB/s", out), out
    assert list(tmp_path.iterdir()) == []  # the disk tier's folder is gone
