"""``python -m pdserve.bench.peer``: without the peer it says so and exits; the grid (shapes,
dtypes, closed loops, Poisson points at fractions of vLLM's capacity); a point that lost
requests or tokens, each request against its own requested length, stops the run; the report
puts every figure beside its ratio to vLLM's in the same sitting, marks the goals and draws the
ratios; one client environment; the set-ups at equal cores."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench import peer, peer_report
from pdserve.bench.peer_grid import Load, Point, Shape, grid, parse_shape, passes, rate_of


def test_without_the_peer_it_says_what_to_set_up(tmp_path, capsys):
    peer.main(["--vllm", str(tmp_path / "no-vllm"), "--model", str(tmp_path)])
    out = capsys.readouterr().out
    assert "the peer is not installed here" in out and "--vllm" in out


@pytest.mark.parametrize("text, shape", [
    ("256/64", Shape(256, 64)),
    ("1024~0.5/256~0.5", Shape(1024, 256, 0.5, 0.5)),
    (" 2048/128~0.25", Shape(2048, 128, 0.0, 0.25)),
])
def test_shapes_parse_and_print_back(text, shape):
    assert parse_shape(text) == shape
    assert parse_shape(shape.label) == shape and shape.label == text.strip()


@pytest.mark.parametrize("text, why", [
    ("256", "is not IN/OUT"), ("256/64/2", "is not IN/OUT"), ("x/64", "is not LEN"),
    ("256/64~y", "is not LEN"), ("0/64", "at least 1"), ("256/64~1.0", r"in \[0, 1\)"),
    ("256~-0.1/64", r"in \[0, 1\)"),
])
def test_a_bad_shape_is_refused_naming_the_flag(text, why):
    with pytest.raises(ValueError, match=f"--shapes: .*{why}"):
        parse_shape(text)


def test_a_spread_shape_asks_the_client_for_its_range_ratios():
    args = parse_shape("1024~0.5/256~0.25").client_args()
    assert args[:4] == ["--random-input-len", "1024", "--random-output-len", "256"]
    assert args[4:] == ["--random-range-ratio", '{"input": 0.5, "output": 0.25}']


def test_the_grid_runs_each_dtype_closed_loop_first_then_poisson():
    shapes = [Shape(256, 64), Shape(128, 512)]
    points = grid(["float32", "bfloat16"], shapes, [8, 1], [0.5, 1.2])
    assert len(points) == 2 * 2 * (2 + 2)
    labels = [p.label for p in points[:8]]
    assert labels == ["float32 256/64 c=1", "float32 256/64 c=8", "float32 128/512 c=1",
                      "float32 128/512 c=8", "float32 256/64 0.5 cap",
                      "float32 256/64 1.2 cap", "float32 128/512 0.5 cap",
                      "float32 128/512 1.2 cap"]
    assert {p.dtype for p in points[8:]} == {"bfloat16"}
    assert len(passes("float32", shapes, [1], [])) == 1  # no fractions: no Poisson pass
    with pytest.raises(ValueError, match="--dtypes"):
        passes("int8", shapes, [1], [])
    with pytest.raises(ValueError, match="--concurrency"):
        Load(concurrency=0)
    with pytest.raises(ValueError, match="--rate-fractions"):
        Load(capacity_fraction=0.0)


def test_a_closed_loop_sends_at_least_two_requests_per_slot():
    assert Point("float32", Shape(256, 64), Load(concurrency=32)).num_prompts(24) == 64
    assert Point("float32", Shape(256, 64), Load(concurrency=4)).num_prompts(24) == 24
    assert Point("float32", Shape(256, 64), Load(capacity_fraction=1.0)).num_prompts(24) == 24


def test_poisson_rates_are_fractions_of_vllms_highest_closed_loop_point():
    shape, other = Shape(256, 64), Shape(2048, 128)
    peer_results = {Point("float32", shape, Load(concurrency=c)): {"request_throughput": rps}
                    for c, rps in ((1, 0.5), (16, 2.0), (8, 1.8))}
    peer_results[Point("bfloat16", shape, Load(concurrency=32))] = {"request_throughput": 9.0}
    assert rate_of(Point("float32", shape, Load(capacity_fraction=0.8)), peer_results) == \
        pytest.approx(1.6)
    assert rate_of(Point("float32", shape, Load(concurrency=4)), peer_results) is None
    with pytest.raises(RuntimeError, match="no closed-loop point of vLLM at float32 2048/128"):
        rate_of(Point("float32", other, Load(capacity_fraction=1.0)), peer_results)


def saved(outputs, inputs=(10, 12, 9), completed=None):
    """A saved result as ``vllm bench serve --save-detailed`` writes it (the fields read)."""
    return {"completed": len(outputs) if completed is None else completed,
            "input_lens": list(inputs), "output_lens": list(outputs)}


def test_every_request_must_get_its_own_requested_output_length():
    asked = peer.Lengths([10, 12, 9], [130, 384, 200])
    peer.check_complete(saved([130, 384, 200]), asked, "ok")
    with pytest.raises(RuntimeError, match="pdserve-1p1d at p: 1 of 3 requests did not get "
                                           r"the output tokens .*request 1 got 383 of 384"):
        peer.check_complete(saved([130, 383, 200]), asked, "pdserve-1p1d at p")
    # the same total, spread over the wrong requests: still not complete
    with pytest.raises(RuntimeError, match="2 of 3 requests did not get"):
        peer.check_complete(saved([384, 130, 200]), asked, "x")
    with pytest.raises(RuntimeError, match="x: 2 of 3 requests completed"):
        peer.check_complete(saved([130, 384, 0], completed=2), asked, "x")
    with pytest.raises(RuntimeError, match="x: None of 3 requests completed"):
        peer.check_complete({}, asked, "x")
    with pytest.raises(RuntimeError, match="saved prompt lengths are not the ones"):
        peer.check_complete(saved([130, 384, 200], inputs=(10, 12, 8)), asked, "x")
    peer.check_complete(saved([64] * 3), peer.Lengths.fixed(3, 64), "fixed")


def figures(scale: float = 1.0, **over) -> dict:
    base = dict(output_throughput=16.0, median_ttft_ms=600.0, median_tpot_ms=50.0,
                p99_tpot_ms=60.0, request_rate="inf")
    return {**{k: v * scale for k, v in base.items() if k != "request_rate"},
            "request_rate": base["request_rate"], **over}


C1 = Point("float32", Shape(256, 64), Load(concurrency=1))
C16 = Point("float32", Shape(256, 64), Load(concurrency=16))
P08 = Point("float32", Shape(256, 64), Load(capacity_fraction=0.8))


def test_goals_are_marked_per_load():
    fast = dict(output_throughput=1.4, median_ttft_ms=0.9, median_tpot_ms=0.7)
    assert all(g.met for g in peer_report.goals(C1, fast))
    assert [g.name for g in peer_report.goals(C1, fast)][-1] == "TTFT P50 <= 1.0x"
    assert "TTFT P50 <= 1.0x" not in [g.name for g in peer_report.goals(C16, fast)]
    slow_ttft = {**fast, "median_ttft_ms": 1.1}
    assert [g.met for g in peer_report.goals(C1, slow_ttft)] == [True, True, False]
    c8 = Point("float32", Shape(256, 64), Load(concurrency=8))
    assert [g.met for g in peer_report.goals(c8, slow_ttft)] == [True, True, False]
    assert all(g.met for g in peer_report.goals(C16, slow_ttft))
    assert [g.met for g in peer_report.goals(C1, {**fast, "median_tpot_ms": 0.81})] == \
        [True, False, True]
    assert [(g.name, g.met) for g in peer_report.goals(P08, {**fast, "output_throughput": 1.0})] \
        == [("throughput >= 1.0x", True)]
    assert not peer_report.goals(P08, {**fast, "output_throughput": 0.99})[0].met


def test_rows_carry_ratios_goals_and_equal_texts_against_vllm():
    results = {("pdserve-colocated", C1): figures(1.25, generated_texts=["a", "x", "c"]),
               ("vllm", C1): figures(generated_texts=["a", "b", "c"]),
               ("pdserve-colocated", P08): figures(1.1, request_rate=1.234),
               ("vllm", P08): figures(request_rate=1.234)}
    rows = peer_report.rows_of(results, [C1, P08], "vllm")
    assert rows[0] == ["float32", "256/64", "c=1", "vllm", "16.0", "600.0", "50.0", "60.0",
                       "", ""]
    assert rows[1][3:9] == ["pdserve-colocated", "20.0 (1.25x)", "750.0 (1.25x)",
                            "62.5 (1.25x)", "75.0 (1.25x)", "2/3"]
    assert rows[1][9] == ("throughput >= 1.3x NOT met; TPOT P50 <= 0.8x NOT met; "
                          "TTFT P50 <= 1.0x NOT met")
    assert rows[3][2:4] == ["0.8 cap (1.23/s)", "pdserve-colocated"]
    assert rows[3][9] == "throughput >= 1.0x met"
    assert peer_report.goal_tally(rows) == "1 of 2 rows meet every goal"


def test_two_core_rows_compare_with_vllm_on_two_threads():
    results = {("pdserve-2x1", C1): figures(output_throughput=15.0),
               ("vllm-2t", C1): figures(output_throughput=10.0)}
    assert peer.peer_of(["pdserve-2x1", "vllm-2t"]) == "vllm-2t"
    assert peer.peer_of(["pdserve-2x1"]) is None
    rows = {row[3]: row for row in peer_report.rows_of(results, [C1], "vllm-2t")}
    assert rows["pdserve-2x1"][4] == "15.0 (1.50x)" and rows["vllm-2t"][4] == "10.0"


def test_the_report_and_plot_are_written(tmp_path):
    results = {("vllm", C1): figures(), ("pdserve-colocated", C1): figures(0.5),
               ("pdserve-1p1d", C1): figures(2.0), ("vllm", C16): figures(),
               ("pdserve-colocated", C16): figures(1.5)}
    points = [C1, C16]
    series = peer_report.ratio_series(results, points, "vllm", "output_throughput")
    assert series == {"pdserve-1p1d": [2.0, None], "pdserve-colocated": [0.5, 1.5]}
    rows = peer_report.rows_of(results, points, "vllm")
    section = peer_report.sitting_section(3, ["seed 3001; vLLM thread binding vllm auto"], rows)
    assert section.startswith("## Sitting 3\n\n- seed 3001")
    assert "| float32 | 256/64 | c=16 | pdserve-colocated | 24.0 (1.50x) |" in section
    assert "0 of 3 rows meet every goal" in section
    png = peer_report.write_plot(results, points, "vllm", tmp_path / "ratios.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_poisson_points_need_vllm_among_the_servers(tmp_path):
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    (tmp_path / "config.json").write_text("{}")
    args = argparse.Namespace(vllm=str(vllm), model=str(tmp_path), servers="pdserve-2x1",
                              cores=1, rate_fractions=[1.0])
    with pytest.raises(ValueError, match="--rate-fractions"):
        peer.find_peer(args)
    args = argparse.Namespace(vllm=str(vllm), model=str(tmp_path), servers="pdserve-2x1",
                              cores=1, rate_fractions=[])
    assert peer.find_peer(args)


def test_every_server_gets_one_client_environment():
    env = peer.client_env("/nonexistent/bin/vllm")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert peer.client_env("/nonexistent/bin/vllm") == env  # (no server in it)


def test_both_servers_get_the_dtype(tmp_path):
    for server in peer.servers("vllm", str(tmp_path), 8100, "bfloat16"):
        assert server.command[server.command.index("--dtype") + 1] == "bfloat16"


def test_cores_choose_the_set_ups(tmp_path):
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    (tmp_path / "config.json").write_text("{}")
    for cores, expected in ((1, {"vllm", "pdserve-colocated", "pdserve-1p1d"}),
                            (2, {"vllm-2t", "pdserve-2x1", "pdserve-1x2", "pdserve-1p1d"})):
        args = argparse.Namespace(vllm=str(vllm), model=str(tmp_path), servers=None,
                                  cores=cores, rate_fractions=[1.0])
        assert peer.find_peer(args) and set(args.servers) == expected
        names = {s.name for s in peer.servers(str(vllm), str(tmp_path), 8100)}
        assert expected <= names
    two = next(s for s in peer.servers(str(vllm), str(tmp_path), 8100) if s.name == "vllm-2t")
    assert two.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_the_bounded_two_core_server_is_pdserve_1x2_with_the_bound(tmp_path):
    by_name = {s.name: s for s in peer.servers("vllm", str(tmp_path), 8100)}
    bounded = by_name["pdserve-1x2-prefill-batch"].command
    at = bounded.index("--prefill-batch-tokens")
    assert int(bounded[at + 1]) == 512
    assert bounded[:at] + bounded[at + 2:] == by_name["pdserve-1x2"].command


def fake_sitting(tmp_path, monkeypatch, fail_at: str | None = None) -> tuple:
    """``peer.run`` with the servers and the client replaced: records every start and every
    point's (server, name, concurrency, rate); vLLM completes c/2 requests/s at c."""
    starts, points = [], []
    monkeypatch.setattr(peer, "start", lambda server, port, log: starts.append(server) or server)
    monkeypatch.setattr(peer, "stop", lambda proc: None)
    monkeypatch.setattr(peer, "requested_lengths", lambda vllm, workloads, out: {
        key: peer.Lengths.fixed(4, 8) for key in workloads})

    def bench_point(vllm, server, port, requests, out, name, concurrency, rate, expected):
        if fail_at and fail_at in name:
            raise RuntimeError(f"{name}: 3 of 4 requests completed")
        points.append((server.name, name, concurrency, rate))
        speed = 1.0 if server.name == "vllm" else 1.5
        return figures(speed, request_throughput=(concurrency or 0) / 2 * speed,
                       request_rate=rate if rate is not None else "inf")
    monkeypatch.setattr(peer, "bench_point", bench_point)
    args = argparse.Namespace(vllm="vllm", model=str(tmp_path), port=8100, seed=7,
                              servers=["pdserve-colocated", "vllm"], dtypes=["float32"],
                              shapes=[Shape(256, 64), Shape(128, 512)], concurrency=[1, 4],
                              rate_fractions=[0.5, 1.2], num_prompts=4, sittings=1,
                              out=str(tmp_path / "out"))
    return starts, points, args


def test_a_sitting_runs_poisson_points_at_fractions_of_vllms_capacity(tmp_path, monkeypatch):
    starts, points, args = fake_sitting(tmp_path, monkeypatch)
    table = peer.run(args)
    assert [s.name for s in starts].count("vllm") == 2  # once per pass
    assert len(starts) == 4 and len(points) == 2 * 2 * (2 + 2)
    closed, poisson = points[:8], points[8:]
    assert all(rate is None for *_, rate in closed)
    # vLLM's capacity at each shape: 2 requests/s at c=4 (its highest), for both servers
    assert sorted({(name.split("-float32-")[1], rate) for _, name, _, rate in poisson}) == [
        ("128_512-0.5-cap", 1.0), ("128_512-1.2-cap", 2.4), ("256_64-0.5-cap", 1.0),
        ("256_64-1.2-cap", 2.4)]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "float32 poisson pass: order" in report and "256/64 0.5 cap = 1.00 req/s" in report
    assert "| float32 | 128/512 | 1.2 cap (2.40/s) | pdserve-colocated | 24.0 (1.50x)" in report
    assert (tmp_path / "out" / "ratios-sitting-1.png").is_file()
    assert "pdserve-colocated" in table


def test_a_stopped_sitting_still_reports_what_it_measured(tmp_path, monkeypatch):
    _, points, args = fake_sitting(tmp_path, monkeypatch, fail_at="128_512-c=4")
    with pytest.raises(RuntimeError, match="3 of 4 requests completed"):
        peer.run(args)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| float32 | 256/64 | c=4 |" in report and "128/512 | c=4" not in report
