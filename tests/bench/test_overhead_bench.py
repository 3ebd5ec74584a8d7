"""``python -m pdserve.bench.overhead``: its offline path runs every request to its length at
the asked concurrency, and its table puts the served figures beside their offline ratio."""

from __future__ import annotations

from pdserve.bench import overhead
from pdserve.bench.workload import SyntheticShape, synthetic_requests


def test_offline_runs_every_request_to_its_length(tiny_dir):
    shape = SyntheticShape(input_mean=12, output_mean=5, sigma=0.0)
    requests = synthetic_requests(5, 0, 256, 1 << 30, shape)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(12, 5)] * 5
    result = overhead.offline(str(tiny_dir), requests, concurrency=2)
    assert result["completed"] == 5 and result["failed"] == 0
    assert result["output_lens"] == [5] * 5 and result["total_output_tokens"] == 25
    assert all(t > 0 for t in result["ttfts"])
    assert [len(itl) for itl in result["itls"]] == [4] * 5
    starts = sorted(result["start_times"])
    assert starts[1] < min(result["e2els"]) < starts[2]  # two at once, then one per finish


def test_served_rows_carry_their_ratio_to_offline():
    base = dict(output_throughput=20.0, median_ttft_ms=500.0, median_tpot_ms=50.0)
    served = {k: v * 1.5 for k, v in base.items()} | {
        "phases": {"queue": {"p50_ms": 1.0}, "prefill": {"p50_ms": 400.0},
                   "router": {"p50_ms": 12.0}},
        "cpu_ms_per_token": {"computing": 20.5, "other": 3.25}}
    text = overhead.table({("offline", 1): base, ("grpc", 1): served})
    offline_row, grpc_row = text.splitlines()[2:]
    assert "(" not in offline_row and offline_row.split()[-5:] == ["-"] * 5
    assert grpc_row.split() == ["grpc", "1", "30.0", "(1.50x)", "750.0", "(1.50x)", "75.0",
                                "(1.50x)", "1.0", "400.0", "12.0", "20.50", "3.25"]
