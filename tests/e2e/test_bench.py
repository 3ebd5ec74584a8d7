"""``pdserve bench serve`` and the binding resource against a real embedded cluster; colocated
traces that say where TTFT went (``pdserve status --checklist`` prints them)."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from pdserve.cli.main import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def disagg(start_cluster, tiny_dir):
    cluster = start_cluster(tiny_dir, http_port=0)
    yield cluster
    cluster.stop()


def test_bench_serve_result_from_a_real_cluster(disagg, tmp_path, capsys):
    path = tmp_path / "result.json"
    assert main(["bench", "serve", "--target", disagg.target, "--num-prompts", "6",
                 "--request-rate", "50", "--input-mean", "12", "--output-mean", "6",
                 "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(path),
                 "--disable-tqdm", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "where the time went" in out
    result = json.loads(path.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["request_goodput"] > 0 and result["slo_attainment"] == 1.0
    assert result["total_output_tokens"] == sum(result["output_lens"]) > 0
    assert result["total_input_tokens"] == sum(result["input_lens"]) > 0
    for key in ("mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_e2el_ms", "p90_ttft_ms",
                "request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] >= 0
    assert result["num_traces"] == 6
    phases = result["phases"]
    assert set(phases) == {"queue", "prefill", "transfer", "router", "decode"}
    assert phases["prefill"]["mean_ms"] > 0 and phases["decode"]["mean_ms"] > 0
    assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0)
    assert {w["role"] for w in result["workers"].values()} == {"prefill", "decode"}
    assert all(w["ledger"]["num_kv_blocks"] == 128 for w in result["workers"].values())
    pools = result["server_config"]["pools"]
    assert pools["decode"]["engine"]["block_size"] == 4
    assert pools["prefill"]["engine"]["prefix_cache_salt"] == "<secret>"


def test_bench_serve_over_openai_http(disagg, tmp_path):
    from pdserve.bench.serve import ServeOptions, run_serve
    from pdserve.bench.workload import SyntheticShape

    result = run_serve(ServeOptions(target=disagg.target, base_url=disagg.http_url,
                                    num_prompts=4, shape=SyntheticShape(12, 5),
                                    disable_tqdm=True, seed=4))
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == sum(result["output_lens"]) > 4
    assert result["num_traces"] == 4  # the response ids are the router's request ids
    assert result["mean_ttft_ms"] > 0 and result["base_url"] == disagg.http_url


def test_workers_say_what_binds_them_while_serving(disagg, e2e):
    from pdserve.api.admin_client import AdminClient
    from pdserve.api.client import PdserveClient

    def stream():
        with PdserveClient(disagg.target) as client:
            client.generate([5, 6, 7, 8, 9], max_tokens=400, temperature=0.0, ignore_eos=True,
                            timeout=60)

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        with AdminClient(disagg.target) as admin:
            busy = e2e.wait_for(
                lambda: [w for w in admin.list_workers()
                         if w.role == "decode" and w.binding in ("compute", "bandwidth")],
                30, "the decode worker reporting what binds it")
    finally:
        thread.join(60)
    worker = busy[0]
    assert 0 < worker.bandwidth_utilization and 0 < worker.compute_utilization
    assert 0 < worker.busy_fraction <= 1
    assert json.loads(worker.ledger_json)["block_size"] == 4
    text = urllib.request.urlopen(disagg.metrics_url, timeout=10).read().decode()
    assert 'pdserve_worker_compute_utilization{role="decode"' in text
    assert 'pdserve_worker_bandwidth_utilization{role="prefill"' in text


def test_colocated_traces_split_ttft(start_cluster, tiny_dir, e2e, capsys):
    cluster = start_cluster(tiny_dir, colocated=True, num_decode=1)
    try:
        e2e.generate_all(cluster.target, e2e.prompts(5, 3, low=20, high=30), max_tokens=4)
        traces = cluster.traces()
        assert len(traces) == 3
        for t in traces:  # queue and prefill were 0 in colocated traces before
            assert t.prefill > 0 and t.queue >= 0 and t.transfer == 0
            assert t.queue + t.prefill <= t.ttft
        assert main(["status", "--target", cluster.target, "--checklist"]) == 0
        out = capsys.readouterr().out
        assert "1. phase share of time (3 latest requests" in out
        assert "3. memory composition per worker" in out
    finally:
        cluster.stop()
