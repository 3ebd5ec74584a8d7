"""Two colocated LoRA workers on real Ray, Redis and gRPC: their adapter slots reach the
router through the registry (its records carry the LoRA fields), ``pdserve status`` (the real
CLI) shows the LORA column and the router's metrics the per-worker LoRA series; base-model
requests on LoRA workers still equal the offline engine.

Requests under an adapter need the request edge (the ``model`` field naming an adapter);
the in-process router tests (tests/router/test_lora_router.py) send them through the same
router code."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
WORKERS = ("colocated-0", "colocated-1")


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, colocated=True, num_decode=2,
                      engine=dict(num_kv_blocks=256, enable_lora=True, max_loras=2))
    yield c
    c.stop()


def pdserve_status(cluster, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "status", "--target",
                             cluster.target, *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_base_model_greedy_on_lora_workers_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(3, 4)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    assert [r.token_ids for r in e2e.generate_all(cluster.target, prompts, MAX_TOKENS)] == \
        expected


def test_status_and_metrics_show_each_workers_adapter_slots(cluster, e2e):
    report = json.loads(pdserve_status(cluster, "--json"))
    workers = {w["worker_id"]: w for w in report["workers"]}
    assert set(workers) == set(WORKERS)
    assert all((w["lora_slots"], w["lora_resident"]) == (2, []) for w in workers.values())
    lines = pdserve_status(cluster).splitlines()
    header = next(line for line in lines if line.startswith("WORKER")).split()
    assert "LORA" in header
    for worker_id in WORKERS:
        row = next(line for line in lines if line.startswith(worker_id)).split()
        assert "0/2" in row

    def slots() -> bool:  # (the router's metrics follow its next stats refresh)
        text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
        return all(f'pdserve_lora_slots{{role="colocated",worker="{w}"}} 2.0' in text
                   for w in WORKERS)

    e2e.wait_for(slots, 30, "the router's per-worker LoRA gauges")
