"""The chart's Grafana dashboard (helm/pdserve/dashboards/pdserve.json) and Prometheus Operator
objects: the ConfigMap carrying the dashboard renders only when enabled and holds the file's
JSON; every series a panel queries is one the router's /metrics really serves (scraped over
loopback from a RouterMetrics fed a little of everything), with the labels the panel filters
and groups by; the PodMonitor scrapes what the ServiceMonitor does."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics
from pdserve.worker_api import WorkerStats
from pdserve.worker_api.adapters import AdapterRef

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
DASHBOARD = CHART / "dashboards" / "pdserve.json"
KUBERNETES = "1.31.0"  # the Kubernetes version test_chart.py validates against
# what Prometheus (and the Operator's relabelling) adds to every scraped series
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum",
                                                                          "_count")}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset"}


def scraped_series() -> dict[str, set[str]]:
    """series name -> its label names, from the router's /metrics over loopback, after one of
    each kind of observation (so every labelled family has a series to read labels from)."""
    metrics = RouterMetrics()
    metrics.observe_ttft(0.2)
    metrics.observe_itl(0.01, 3)
    metrics.e2e.labels("router").observe(1.0)
    for histogram in (metrics.queue, metrics.prefill, metrics.transfer):
        histogram.labels("prefill", "w0").observe(0.01)
    metrics.transfer_bytes.labels("prefill", "w0").inc(4096)
    metrics.router_running.labels("router").set(1)
    metrics.waiting_for_workers.set(0)
    metrics.set_worker(WorkerStats(
        worker_id="w1", role="decode", total_blocks=100, free_blocks=60, used_blocks=40,
        cached_blocks=5, num_running=2, num_waiting=1, queued_tokens=0, num_preemptions=1,
        prefix_hit_tokens=10, prefix_query_tokens=40, spec_num_drafts=1, lora_slots=2,
        lora_resident=("d1",), kv_host_capacity_bytes=1 << 20, kv_disk_capacity_bytes=1 << 30))
    metrics.set_pools({"prefill": 1, "decode": 2}, {("decode", "ready"): 1})
    metrics.observe_adapter(AdapterRef("sql", "/models/sql", "0" * 64))
    for counter, label in ((metrics.migrations, "worker_died"),
                           (metrics.prefill_location, "remote"),
                           (metrics.worker_restarts, "decode"),
                           (metrics.requests_failed, "UNAVAILABLE"),
                           (metrics.malformed_records, "worker"),
                           (metrics.untrusted_records, "worker"),
                           (metrics.control_plane_repairs, "pool")):
        counter.labels(label).inc()
    metrics.autoscaler_decisions.labels("decode", "up", "ttft").inc()
    metrics.control_plane_degraded.set(0)
    server, thread = metrics.start_http(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics",
                                    timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = {name for sample in family.samples for name in sample.labels} - {"le"}
        for suffix in SERIES_SUFFIXES.get(family.type, ()):
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


@pytest.fixture(scope="module")
def series() -> dict[str, set[str]]:
    return scraped_series()


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included (rows themselves left out)."""
    found = []
    for panel in dashboard["panels"]:
        found += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return found


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names its matchers name) for every series selector in ``expr``."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range windows
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = []
    for match in re.finditer(r"\b([A-Za-z_:][\w:]*)\b(?!\s*\()(\{[^}]*\})?", expr):
        name, matchers = match.group(1), match.group(2) or ""
        if name in PROMQL_WORDS or re.fullmatch(r"[\d.e]+", name):
            continue
        found.append((name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))))
    return found


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


def problems(dashboard: dict, series: dict[str, set[str]]) -> list[str]:
    """What a panel's queries name that the router does not export: series, matcher labels,
    grouping labels."""
    found = []
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr, where = target["expr"], f"{panel['title']!r} {target['refId']}"
            metrics = selectors(expr)
            if not metrics:
                found.append(f"{where}: no series in {expr}")
            known = set(TARGET_LABELS)
            for name, labels in metrics:
                if name not in series:
                    found.append(f"{where}: {name} is not exported")
                    continue
                known |= series[name]
                if unknown := labels - series[name] - TARGET_LABELS:
                    found.append(f"{where}: {name} has no label {unknown}")
            if not grouping_labels(expr) <= known:
                found.append(f"{where}: groups by {grouping_labels(expr) - known}")
    return found


def test_every_series_a_panel_queries_is_exported(series):
    dashboard = json.loads(DASHBOARD.read_text())
    assert problems(dashboard, series) == []
    queried = {name for panel in panels(dashboard) for target in panel["targets"]
               for name, _ in selectors(target["expr"])}
    assert len(queried) >= 40  # (the selectors were found, not skipped)


@pytest.mark.parametrize("old, new, expected", [
    ("pdserve_kv_cache_usage_ratio", "pdserve_kv_cache_usage", "is not exported"),
    ("pdserve_request_migrations_total", "pdserve_request_migrations", "is not exported"),
    ("rate(pdserve_lora_requests_total{job", "rate(pdserve_lora_requests_total{worker=\"w\", job",
     "has no label {'worker'}"),
    ("sum by (code)", "sum by (status)", "groups by {'status'}"),
])
def test_the_check_catches_a_name_the_router_does_not_export(series, old, new, expected):
    dashboard = json.loads(DASHBOARD.read_text())
    target = next(t for p in panels(dashboard) for t in p["targets"] if old in t["expr"])
    target["expr"] = target["expr"].replace(old, new)
    assert any(expected in problem for problem in problems(dashboard, series))


def test_dashboard_shape(series):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] == "pdserve"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    metrics = {}
    for name in ("job", "role"):
        metric, label = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?, (\w+)\)",
                                     variables[name]["query"]["query"]).groups()
        assert label == name and label in series[metric] | TARGET_LABELS
        metrics[name] = metric
    assert series[metrics["job"]] == set()  # unlabelled: exported from the router's start
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in panels(dashboard)
                                                   if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])


def test_dashboard_configmap_renders_only_when_enabled(render):
    import kubernetes_validate

    assert not [c for c in render().of("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    config_map = render({"metrics": {"grafanaDashboard": {"enabled": True}}}).one(
        "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "serving"
    assert json.loads(config_map["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    kubernetes_validate.validate(config_map, KUBERNETES, strict=True)
    elsewhere = render({"metrics": {"grafanaDashboard": {
        "enabled": True, "namespace": "monitoring", "label": "grafana.example/dashboard",
        "labelValue": "pdserve", "annotations": {"grafana_folder": "LLM"}}}}).one(
        "ConfigMap", "-dashboard")
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert elsewhere["metadata"]["labels"]["grafana.example/dashboard"] == "pdserve"
    assert "grafana_dashboard" not in elsewhere["metadata"]["labels"]
    as_set = render({"metrics": {"grafanaDashboard": {"enabled": True, "labelValue": 1}}})
    assert as_set.one("ConfigMap", "-dashboard")["metadata"]["labels"]["grafana_dashboard"] \
        == "1"  # (helm --set labelValue=1 gives a number)
    assert elsewhere["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    kubernetes_validate.validate(elsewhere, KUBERNETES, strict=True)


def test_pod_monitor_scrapes_the_router_pods_with_the_admin_key(render):
    rendered = render({"metrics": {"podMonitor": {"enabled": True, "labels": {"team": "llm"}}},
                       "adminApiKey": {"existingSecret": "pdserve-admin-key", "secretKey": "key"}})
    assert not rendered.of("ServiceMonitor")
    monitor = rendered.one("PodMonitor", "-router")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["team"] == "llm"
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s",
                        "authorization": {"type": "Bearer", "credentials": {
                            "name": "pdserve-admin-key", "key": "key"}}}
    cluster = rendered.one("RayCluster")
    router = next(g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "router")
    pod = router["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert "metrics" in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    open_metrics = render({"metrics": {"podMonitor": {"enabled": True}}}).one("PodMonitor")
    assert "authorization" not in open_metrics["spec"]["podMetricsEndpoints"][0]
    assert not render().of("PodMonitor")


@pytest.mark.parametrize("values, message", [
    ({"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}, "enable one"),
    ({"grafanaDashboard": {"enabled": True, "lable": "x"}}, "lable"),
    ({"grafanaDashboard": {"enabled": True, "label": "two words"}}, "label"),
])
def test_bad_metrics_values_fail_with_a_message(values, message):
    import helm_python

    with pytest.raises(helm_python.HelmError, match=message):
        helm_python.Chart.load(str(CHART)).render({"metrics": values}, name="pd",
                                                  namespace="serving")
