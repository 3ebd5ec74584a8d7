"""bench/load_tools/summary.py reads each tool's report (the keys of the real reports of
aiperf 0.13.0, guidellm 0.8.1, inference-perf 0.7.0 and pdserve bench serve, cut down to
them), the router's metrics scraped around a run and the client's CPU time, into one table."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.load_tools.summary import collect, main, table


def _write(folder: Path, name: str, doc: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(doc))


def _scrape(folder: Path, when: str, ttft_sum: float, ttft_count: int, itl_sum: float,
            itl_count: int) -> None:
    lines = [f'pdserve_time_to_first_token_seconds_sum{{role="router"}} {ttft_sum}',
             f'pdserve_time_to_first_token_seconds_count{{role="router"}} {ttft_count}',
             f'pdserve_inter_token_latency_seconds_sum{{role="router"}} {itl_sum}',
             f'pdserve_inter_token_latency_seconds_count{{role="router"}} {itl_count}',
             'pdserve_inter_token_latency_seconds_bucket{le="0.1",role="router"} 7.0']
    (folder / f"metrics-{when}.txt").write_text("# HELP ...\n" + "\n".join(lines) + "\n")


def _reports(root: Path) -> None:
    for rep, ttft in ((1, 100.0), (2, 300.0)):
        _write(root / f"pdserve-c4-r{rep}", "pdserve.json",
               {"median_ttft_ms": ttft, "median_itl_ms": 20.0, "median_tpot_ms": 21.0,
                "output_throughput": 50.0, "completed": 8, "failed": 0})
    _write(root / "aiperf-c4-r1", "profile_export_aiperf.json",
           {"time_to_first_token": {"p50": 400.0}, "inter_chunk_latency": {"p50": 30.0},
            "inter_token_latency": {"p50": 31.0}, "output_token_throughput": {"avg": 40.0},
            "request_count": {"avg": 8.0}})
    metrics = {"time_to_first_token_ms": {"successful": {"median": 220.0}},
               "inter_token_latency_ms": {"successful": {"median": 22.0}},
               "output_tokens_per_second": {"successful": {"mean": 45.0}}}
    _write(root / "guidellm-c4-r1", "guidellm.json", {"benchmarks": [{
        "metrics": metrics,
        "scheduler_metrics": {"requests_made": {"successful": 7, "errored": 1}}}]})
    latency = {"time_to_first_token": {"median": 0.2}, "inter_token_latency": {"median": 0.02},
               "time_per_output_token": {"median": 0.021}}
    _write(root / "inference-perf-c4-r1", "summary_lifecycle_metrics.json", {
        "successes": {"count": 8, "latency": latency,
                      "throughput": {"output_tokens_per_sec": 50.0}},
        "failures": {"count": 0}})
    (root / "aiperf-c4-r1" / "client-cpu.txt").write_text("0m0.010s 0m0.002s\n1m2.500s 0m3.250s\n")
    _scrape(root / "aiperf-c4-r1", "before", 1.0, 10, 2.0, 100)
    _scrape(root / "aiperf-c4-r1", "after", 3.0, 18, 3.5, 150)


def test_every_report_is_read_with_the_router_s_view(tmp_path):
    _reports(tmp_path)
    (tmp_path / "guidellm-c4-r2").mkdir()  # a run that wrote no report: left out
    runs = collect(tmp_path)
    assert sorted(runs) == [("aiperf", 4), ("guidellm", 4), ("inference-perf", 4),
                            ("pdserve", 4)]
    assert [r["ttft_p50_ms"] for r in runs[("pdserve", 4)]] == [100.0, 300.0]
    aiperf = runs[("aiperf", 4)][0]
    assert (aiperf["itl_p50_ms"], aiperf["tpot_p50_ms"]) == (30.0, 31.0)
    assert aiperf["server_ttft_mean_ms"] == 250.0  # 2 s over 8 first tokens
    assert aiperf["server_itl_mean_ms"] == 30.0  # 1.5 s over 50 gaps
    assert aiperf["client_cpu_s"] == 65.75  # the children's user and system time
    assert runs[("pdserve", 4)][0]["client_cpu_s"] is None
    assert runs[("guidellm", 4)][0]["itl_p50_ms"] is None
    assert (runs[("guidellm", 4)][0]["completed"], runs[("guidellm", 4)][0]["failed"]) == (7, 1)
    assert runs[("inference-perf", 4)][0]["itl_p50_ms"] == 20.0
    assert runs[("pdserve", 4)][0]["server_itl_mean_ms"] is None  # (not scraped)
    rows = table(runs).splitlines()
    assert rows[2].startswith("| pdserve | 4 | 100.0 / 300.0 |")  # pdserve first, both reps
    aiperf_row = next(r for r in rows if r.startswith("| aiperf"))
    assert "400.0 (2.00x)" in aiperf_row and "250.0" in aiperf_row  # over pdserve's mean 200


def test_main_writes_the_summary_and_fails_on_an_empty_folder(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    _reports(tmp_path)
    assert main([str(tmp_path)]) == 0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(written) == ["aiperf-c4", "guidellm-c4", "inference-perf-c4", "pdserve-c4"]
    assert "| guidellm | 4 | 220.0 (1.10x) |" in capsys.readouterr().out
