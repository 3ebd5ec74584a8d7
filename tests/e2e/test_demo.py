"""``pdserve demo``'s engine: real traffic through the embedded cluster, then the report."""

from __future__ import annotations

import pytest

from pdserve.cli.demo import format_report, run_demo
from pdserve.cluster.options import ClusterOptions

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


def test_demo_on_any_checkpoint_colocated_says_where_ttft_went(ray_session, redis_url,
                                                               hf_checkpoint):
    model = hf_checkpoint("qwen2", max_position_embeddings=128)  # prompts must be cut to fit
    options = ClusterOptions(model=str(model), colocated=True, num_decode=1, port=0,
                             metrics_port=None, redis_url=redis_url,
                             engine=dict(block_size=4, num_kv_blocks=256,
                                         max_num_batched_tokens=64))
    report = run_demo(num_requests=4, concurrency=2, seed=2, options=options)
    assert len(report.timings) == 4 and not report.builtin_model
    assert all(t.prefill > 0 and t.queue + t.prefill <= t.ttft for t in report.traces)
    text = format_report(report)
    assert "colocated-0" in text and "random weights" not in text
