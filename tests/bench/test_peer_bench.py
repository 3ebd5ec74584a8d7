"""``python -m pdserve.bench.peer``: without the peer it says so and exits; its table puts
every figure beside its ratio to vLLM's in the same sitting."""

from __future__ import annotations

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
    rows = peer.rows_of(results, sitting=2)
    assert rows[0] == [2, "vllm", "c=1", "16.0", "600.0", "50.0", "60.0"]
    assert rows[1] == [2, "pdserve-colocated", "c=1", "20.0 (1.25x)", "750.0 (1.25x)",
                       "62.5 (1.25x)", "75.0 (1.25x)"]
