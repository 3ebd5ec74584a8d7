"""The router's sliding windows (what the autoscaler reads) and the pool metrics."""

from __future__ import annotations

from pdserve.router.metrics import RouterMetrics, SlidingWindow


def test_a_window_forgets_samples_older_than_asked_and_weights_its_quantiles():
    w = SlidingWindow(max_age_s=100.0)
    for t in range(10):
        w.add(float(t), now=float(t))
    assert w.quantile(0.9, window_s=4.5, now=9.0) == 9.0  # samples 5..9
    assert w.quantile(0.5, window_s=4.5, now=9.0) == 7.0
    assert w.count(window_s=4.5, now=9.0) == 5 and w.total(window_s=4.5, now=9.0) == 35.0
    assert w.quantile(0.9, window_s=1.0, now=50.0) is None  # nothing recent
    w.add(1.0, weight=99, now=10.0)  # 99 tokens 1 s apart outweigh the rest
    assert w.quantile(0.9, window_s=100.0, now=10.0) == 1.0
    w.add(0.0, now=200.0)  # older than max_age_s are dropped
    assert w.count(window_s=1000.0, now=200.0) == 1


def test_itl_and_ttft_feed_both_the_histograms_and_the_windows():
    m = RouterMetrics()
    m.observe_ttft(0.25)
    m.observe_itl(0.01, 3)
    assert m.ttft_window.count(60) == 1 and m.itl_window.count(60) == 3
    text = _exposition(m)
    assert 'pdserve_inter_token_latency_seconds_count{role="router"} 3.0' in text
    assert 'pdserve_time_to_first_token_seconds_count{role="router"} 1.0' in text


def test_pool_gauges_and_the_decision_counter():
    m = RouterMetrics()
    m.set_pools({"prefill": 2, "decode": 1}, {("prefill", "ready"): 1, ("prefill", "starting"): 1,
                                              ("decode", "ready"): 1})
    m.autoscaler_decisions.labels("prefill", "up", "ttft").inc()
    text = _exposition(m)
    assert 'pdserve_pool_target_workers{role="prefill"} 2.0' in text
    assert 'pdserve_pool_workers{role="prefill",state="starting"} 1.0' in text
    assert 'pdserve_pool_workers{role="decode",state="draining"} 0.0' in text
    assert ('pdserve_autoscaler_decisions_total{direction="up",reason="ttft",role="prefill"} '
            '1.0') in text


def _exposition(m: RouterMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()
