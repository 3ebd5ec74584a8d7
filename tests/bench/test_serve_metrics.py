"""``pdserve bench``: result keys and values from scripted timings, the workload, the compare
scoring and its plots (no server: the e2e tests run it against a real cluster)."""

from __future__ import annotations

import json
import math
import random

import pytest

from pdserve.bench.compare import CompareOptions, derive_slos, run_compare, score
from pdserve.bench.plots import write_plots
from pdserve.bench.report import dump_json, format_compare, format_serve
from pdserve.bench.serve import ServeOptions, compute_metrics, hit_rate, traced_hit_rate
from pdserve.bench.workload import (
    NUM_SYSTEM_PROMPTS,
    RequestOutcome,
    SyntheticShape,
    arrival_times,
    jsonl_requests,
    prefix_requests,
    synthetic_requests,
)

VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput"}


def _outcomes() -> list[RequestOutcome]:
    return [
        RequestOutcome("a", 10, 5, ttft=0.1, itl=[0.01, 0.02, 0.03, 0.04], e2el=0.2,
                       success=True),
        RequestOutcome("b", 20, 1, ttft=0.3, itl=[], e2el=0.3, success=True),  # no TPOT
        RequestOutcome("c", 30, 3, ttft=0.05, itl=[0.2, 0.2], e2el=0.45, success=True),
        RequestOutcome("d", 40, 0, e2el=0.5, error="UNAVAILABLE: no workers"),
    ]


def test_result_keys_and_values_follow_vllm():
    result = compute_metrics(_outcomes(), duration=2.0, goodput={"ttft": 200, "tpot": 100},
                             metric_percentiles=(50, 99, 99.9))
    assert VLLM_KEYS <= set(result)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99", "p99.9"):
            assert f"{stat}_{metric}_ms" in result
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["total_input_tokens"] == 60 and result["total_output_tokens"] == 9
    assert result["request_throughput"] == 1.5 and result["output_throughput"] == 4.5
    assert result["total_token_throughput"] == 34.5
    # TPOT = (e2e - ttft) / (n - 1): a 25 ms, c 200 ms; b (one token) has none
    assert result["mean_tpot_ms"] == pytest.approx(112.5)
    assert result["median_ttft_ms"] == pytest.approx(100.0)
    assert result["std_ttft_ms"] == pytest.approx(math.sqrt(((100 - 150) ** 2 + 150 ** 2
                                                             + 100 ** 2) / 3))
    assert result["mean_itl_ms"] == pytest.approx(1e3 * 0.5 / 6)  # pooled over requests
    # good: a (ttft 100, tpot 25) and b (ttft 300 fails); c's tpot 200 fails
    assert result["request_goodput"] == 0.5 and result["slo_attainment"] == 0.25
    assert result["errors"] == ["", "", "", "UNAVAILABLE: no workers"]
    no_slo = compute_metrics(_outcomes(), 2.0)
    assert no_slo["request_goodput"] is None
    text = format_serve(result)
    assert "Serving Benchmark Result" in text and "P99.9 TTFT (ms):" in text


def test_result_json_is_strict(tmp_path):
    result = {"request_rate": math.inf, "values": [1.0, math.nan]}
    dump_json(result, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail) == {
        "request_rate": "inf", "values": [1.0, None]}


def test_options_name_the_bad_field():
    with pytest.raises(ValueError, match="goodput"):
        ServeOptions(goodput={"itl": 5})
    with pytest.raises(ValueError, match="percentile_metrics"):
        ServeOptions(percentile_metrics=("ttfx",))
    with pytest.raises(ValueError, match="burstiness"):
        ServeOptions(burstiness=0)
    with pytest.raises(ValueError, match="dataset_path"):
        ServeOptions(dataset="jsonl")
    with pytest.raises(ValueError, match="target must be HOST:PORT or a comma list"):
        ServeOptions(target="127.0.0.1:1,,127.0.0.1:2")
    with pytest.raises(ValueError, match="with base_url give one"):
        ServeOptions(target="127.0.0.1:1,127.0.0.1:2", base_url="http://127.0.0.1:3")
    assert ServeOptions(target="127.0.0.1:1, 127.0.0.1:2").targets == ["127.0.0.1:1",
                                                                       "127.0.0.1:2"]


def _seeded_trace_that_fits(build, n: int, seed: int, max_context: int, shape):
    """``build``'s trace, checked: the same for the same seed, every request within the
    context with at least one output token, prompt ids past the special ones."""
    trace = build(n, seed, vocab_size=512, max_context=max_context, shape=shape)
    assert trace == build(n, seed, vocab_size=512, max_context=max_context, shape=shape)
    assert all(r.prompt_len + r.output_len <= max_context and r.output_len >= 1 for r in trace)
    assert all(len(r.prompt) == r.prompt_len and 3 <= min(r.prompt) for r in trace)
    return trace


def test_synthetic_trace_is_seeded_and_fits_the_context():
    shape = SyntheticShape(input_mean=220, output_mean=200, sigma=1.0)
    _seeded_trace_that_fits(synthetic_requests, 200, 7, 256, shape)
    wide = synthetic_requests(2000, 1, vocab_size=512, max_context=1 << 20)
    mean_in = sum(r.prompt_len for r in wide) / len(wide)
    assert 180 < mean_in < 260  # ShareGPT-like ~220 (log-normal, long tail)
    assert max(r.prompt_len for r in wide) > 3 * mean_in


def test_prefix_trace_resends_each_conversations_history_over_shared_system_prompts():
    shape = SyntheticShape(input_mean=100, output_mean=20, sigma=0.5)
    trace = _seeded_trace_that_fits(prefix_requests, 64, 3, 400, shape)
    systems = {tuple(r.prompt[:100]) for r in trace}
    assert len(systems) == NUM_SYSTEM_PROMPTS  # every prompt opens with one of them
    resent = [r for r in trace[1:] if any(
        len(e.prompt) > 100 and r.prompt[:len(e.prompt)] == e.prompt for e in trace[:r.index])]
    assert len(resent) > len(trace) // 2  # a turn resends its conversation's history


def test_hit_rate_is_the_runs_share_of_looked_up_tokens_the_caches_served():
    assert hit_rate((100, 1000), (400, 2000)) == pytest.approx(0.3)
    assert hit_rate(None, (1, 2)) is None and hit_rate((5, 10), (5, 10)) is None
    assert hit_rate((500, 1000), (0, 1500)) == 0.0  # a replaced worker restarted its counters


def test_traced_hit_rate_counts_each_prompt_where_it_was_computed():
    def trace(tokens, location, pool=0, host=0, disk=0):
        source = {"pool_tokens": pool, "host_tokens": host, "disk_tokens": disk, "load_s": 0.0}
        return {"num_prompt_tokens": tokens, "prefill_location": location,
                "prefix_source": source}

    # a remote prefill's hits, a decode worker's own prompt's (pool and host), a colocated miss
    traces = [trace(64, "remote", pool=32), trace(64, "local", pool=16, host=16),
              trace(128, None)]
    assert traced_hit_rate(traces) == pytest.approx(64 / 256)
    unsourced = dict(trace(100, "remote"), prefix_source=None)  # (a failed request)
    assert traced_hit_rate(traces + [unsourced]) == pytest.approx(64 / 256)
    assert traced_hit_rate([unsourced]) is None and traced_hit_rate([]) is None


def test_arrivals_poisson_gamma_and_inf():
    assert arrival_times(4, math.inf) == [0.0] * 4
    times = arrival_times(4000, 10.0, 1.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0 and sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    bursty = arrival_times(4000, 10.0, 0.25, seed=3)
    spread = lambda ts: _cv([b - a for a, b in zip(ts, ts[1:], strict=False)])  # noqa: E731
    assert spread(bursty) > 1.5 > spread(times) > 0.8  # gamma CV = 1 / sqrt(shape)
    slower = arrival_times(10, 5.0, 1.0, seed=3)  # the same trace, scaled by the rate
    assert slower == pytest.approx([2 * t for t in arrival_times(10, 10.0, 1.0, seed=3)])


def _cv(xs):
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) / mean


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 7}\n'
                    '{"prompt": [5, 6, 7]}\n\n{"prompt_len": 12, "output_len": 300}\n')
    reqs = jsonl_requests(path, 5, seed=0, vocab_size=100, max_context=64)
    assert reqs[0].prompt == "hello there" and reqs[0].output_len == 7
    assert reqs[1].prompt == [5, 6, 7] and reqs[1].prompt_len == 3
    assert reqs[2].prompt_len == 12 and reqs[2].output_len == 64 - 12  # capped to the context
    assert reqs[3].prompt == "hello there"  # cycled
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        jsonl_requests(path, 1, seed=0, vocab_size=100, max_context=64)


def _fake_run(rate: float, slow: float, rng: random.Random) -> dict:
    n = 10
    outcomes = [RequestOutcome(f"r{i}", 100, 20, ttft=slow * rate * rng.uniform(0.05, 0.15),
                               itl=[0.01] * 19, e2el=0.0, success=True) for i in range(n)]
    for o in outcomes:
        o.e2el = o.ttft + 19 * 0.01 * slow * rate
    result = compute_metrics(outcomes, 5.0)
    result["phases"] = {p: {"mean_ms": 10.0 * (i + 1), "p50_ms": 0.0, "p99_ms": 0.0,
                            "share": 0.2} for i, p in enumerate(
        ("queue", "prefill", "transfer", "router", "decode"))}
    return result


def test_compare_scoring_and_plots(tmp_path):
    rng = random.Random(0)
    runs = {"disaggregated": {r: _fake_run(r, 1.0, rng) for r in (1.0, 2.0, 4.0)},
            "auto": {r: _fake_run(r, 0.5, rng) for r in (1.0, 2.0, 4.0)},
            "colocated": {r: _fake_run(r, 2.0, rng) for r in (1.0, 2.0, 4.0)}}
    derived = derive_slos(runs)  # the better mode at the lowest rate: TTFT x 3, TPOT x 2
    assert derived["ttft"] == pytest.approx(3 * runs["auto"][1.0]["median_ttft_ms"])
    assert derived["tpot"] == pytest.approx(2 * runs["auto"][1.0]["median_tpot_ms"])
    slos = {"ttft": 1000.0, "tpot": 25.0}  # TPOT is 10 ms x rate x slowness here
    scored = score(runs, slos)
    att = {m: [scored["table"][m][r]["slo_attainment"] for r in (1.0, 2.0, 4.0)]
           for m in runs}
    assert att == {"disaggregated": [1.0, 1.0, 0.0], "auto": [1.0, 1.0, 1.0],
                   "colocated": [1.0, 0.0, 0.0]}
    assert scored["best_rate"] == {"disaggregated": 2.0, "auto": 4.0, "colocated": 1.0}
    assert scored["ratios"] == {"disaggregated": 2.0, "auto": 4.0}
    assert scored["ratio"] == 2.0
    doc = {**scored, "slos_ms": slos, "slos_derived": True, "attainment_target": 0.9}
    text = format_compare(doc)
    assert "highest rate at >= 90% SLO attainment" in text
    assert "disaggregated / colocated: 2.00x" in text and "auto / colocated: 4.00x" in text
    paths = write_plots(doc, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["goodput_vs_rate.png", "p99_tpot_vs_rate.png",
                                             "p99_ttft_vs_rate.png", "phases.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_compare_modes_are_checked():
    assert CompareOptions(modes=("colocated", "auto")).modes == ("auto", "colocated")
    with pytest.raises(ValueError, match="modes"):
        CompareOptions(modes=("disaggregated", "sometimes"))


def test_compare_rescores_a_saved_result(tmp_path):
    rng = random.Random(1)
    runs = {"disaggregated": {r: _fake_run(r, 1.0, rng) for r in (1.0, 2.0, 4.0)},
            "colocated": {r: _fake_run(r, 2.0, rng) for r in (1.0, 2.0, 4.0)}}
    dump_json({"runs": {m: {str(r): res for r, res in by.items()} for m, by in runs.items()}},
              str(tmp_path / "saved.json"))
    doc = run_compare(CompareOptions(from_result=str(tmp_path / "saved.json"),
                                     goodput={"ttft": 1000.0, "tpot": 25.0},
                                     output_dir=str(tmp_path / "out")))
    assert doc["best_rate"] == {"disaggregated": 2.0, "colocated": 1.0} and doc["ratio"] == 2
    assert not doc["slos_derived"] and (tmp_path / "out" / "compare.json").is_file()
    assert len(doc["plots"]) == 4
