"""Two prefill + two decode worker actors: greedy equivalence under concurrency, both prefill
workers used, every block back afterwards, no worker process left after stop."""

from __future__ import annotations

import pytest

from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, num_prefill=2, num_decode=2,
                      router=RouterConfig(disaggregation="always"))  # every KV shipped
    yield c
    c.stop()


def test_concurrent_greedy_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(1, 12)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "prefill-1": 0, "decode-0": 0,
                                      "decode-1": 0}
    stats = cluster.worker_stats()
    assert stats["prefill-0"].prefix_query_tokens > 0
    assert stats["prefill-1"].prefix_query_tokens > 0


def test_shutdown_leaves_no_worker_processes(cluster):
    from pdserve.cluster.processes import is_running

    pids = cluster.started_pids()
    assert len(pids) == 5  # router + 4 workers (Redis and Ray belong to the session)
    cluster.stop()
    assert [pid for pid in pids if is_running(pid)] == []
