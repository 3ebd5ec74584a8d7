"""``pdserve demo``'s engine: real traffic through the embedded cluster, then the report."""

from __future__ import annotations

import pytest

from pdserve.cluster.demo import format_report, run_demo
from pdserve.cluster.launcher import ClusterOptions

pytestmark = pytest.mark.e2e


def test_demo_reports_latencies_time_split_and_ledger(ray_session, redis_url, tiny_dir):
    options = ClusterOptions(model=str(tiny_dir), port=0, metrics_port=None,
                             redis_url=redis_url,
                             engine=dict(block_size=4, num_kv_blocks=256,
                                         max_num_batched_tokens=64))
    report = run_demo(num_requests=6, concurrency=3, seed=1, options=options)
    assert len(report.timings) == 6 and len(report.traces) == 6
    assert all(t.num_tokens > 0 and 0 < t.ttft <= t.e2e for t in report.timings)
    assert sorted(report.worker_stats) == ["decode-0", "prefill-0"]
    text = format_report(report)
    for word in ("TTFT", "TPOT", "P99", "queue", "prefill", "transfer", "decode",
                 "weights MiB", "KV B/token", "prefill-0", "decode-0"):
        assert word in text
