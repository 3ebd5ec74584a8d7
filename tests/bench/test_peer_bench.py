"""``python -m pdserve.bench.peer``: without the peer it says so and exits; its table puts
every figure beside its ratio to vLLM's in the same sitting and how many greedy texts equal
vLLM's; a point that lost requests or tokens stops the run; one client environment; the set-ups
at equal cores."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench import peer


def test_without_the_peer_it_says_what_to_set_up(tmp_path, capsys):
    peer.main(["--vllm", str(tmp_path / "no-vllm"), "--model", str(tmp_path)])
    out = capsys.readouterr().out
    assert "the peer is not installed here" in out and "--vllm" in out


def test_rows_carry_ratios_against_vllm_of_the_same_sitting():
    figures = dict(output_throughput=16.0, median_ttft_ms=600.0, median_tpot_ms=50.0,
                   p99_tpot_ms=60.0)
    results = {("vllm", "c=1"): figures,
               ("pdserve-colocated", "c=1"): {k: v * 1.25 for k, v in figures.items()}}
    results[("vllm", "c=1")]["generated_texts"] = ["a", "b", "c"]
    results[("pdserve-colocated", "c=1")]["generated_texts"] = ["a", "x", "c"]
    rows = peer.rows_of(results, sitting=2)
    assert rows[0] == [2, "vllm", "c=1", "16.0", "600.0", "50.0", "60.0", ""]
    assert rows[1] == [2, "pdserve-colocated", "c=1", "20.0 (1.25x)", "750.0 (1.25x)",
                       "62.5 (1.25x)", "75.0 (1.25x)", "2/3"]


def test_two_core_rows_compare_with_vllm_on_two_threads():
    figures = dict(output_throughput=10.0, median_ttft_ms=1.0, median_tpot_ms=1.0,
                   p99_tpot_ms=1.0)
    results = {("pdserve-2x1", "c=8"): {**figures, "output_throughput": 15.0},
               ("vllm-2t", "c=8"): figures}
    rows = {row[1]: row for row in peer.rows_of(results, sitting=1)}
    assert rows["pdserve-2x1"][3] == "15.0 (1.50x)" and rows["vllm-2t"][3] == "10.0"


@pytest.mark.parametrize("completed, tokens", [(23, 23 * 64), (24, 24 * 64 - 1), (None, None)])
def test_a_point_that_dropped_requests_or_tokens_stops_the_run(completed, tokens):
    with pytest.raises(RuntimeError, match="pdserve-1p1d at c8: .* of 24 requests"):
        peer.check_complete({"completed": completed, "total_output_tokens": tokens}, 24, 64,
                            "pdserve-1p1d at c8")
    peer.check_complete({"completed": 24, "total_output_tokens": 24 * 64}, 24, 64, "ok")


def test_every_server_gets_one_client_environment():
    env = peer.client_env("/nonexistent/bin/vllm")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert peer.client_env("/nonexistent/bin/vllm") == env  # (no server in it)


def test_cores_choose_the_set_ups(tmp_path, monkeypatch):
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    (tmp_path / "config.json").write_text("{}")
    for cores, expected in ((1, {"vllm", "pdserve-colocated", "pdserve-1p1d"}),
                            (2, {"vllm-2t", "pdserve-2x1", "pdserve-1x2", "pdserve-1p1d"})):
        args = argparse.Namespace(vllm=str(vllm), model=str(tmp_path), servers=None,
                                  cores=cores)
        assert peer.find_peer(args) and set(args.servers) == expected
        names = {s.name for s in peer.servers(str(vllm), str(tmp_path), 8100)}
        assert expected <= names
    two = next(s for s in peer.servers(str(vllm), str(tmp_path), 8100) if s.name == "vllm-2t")
    assert two.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
