"""Pools that differ, on worker actors: with ``--disaggregation auto`` a short prompt is
prefilled on the decode actor itself, a long one on the prefill actor, and greedy tokens equal
the offline engine's either way; each pool runs the torch threads it was given."""

from __future__ import annotations

import urllib.request

import pytest

from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
LOCAL_LIMIT = 16  # --max-local-prefill-length


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, num_prefill=1, num_decode=1, prefill_worker_cpus=2,
                      router=RouterConfig(disaggregation="auto",
                                          max_local_prefill_length=LOCAL_LIMIT))
    yield c
    c.stop()


def locations(cluster) -> dict[str, float]:
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    out = {"local": 0.0, "remote": 0.0}
    for line in text.splitlines():
        for where in out:
            if line.startswith(f'pdserve_prefill_location_total{{location="{where}"}}'):
                out[where] += float(line.rsplit(" ", 1)[1])
    return out


def test_short_prompts_on_the_decode_actor_long_ones_shipped(cluster, model_dir, e2e):
    # the first prompt goes remote (no transfer measured yet), the rest at once
    prompts = [[(5 * i + 3 * j) % 400 + 3 for j in range(n)]
               for i, n in enumerate((20, 6, 40, 9, 12, 33, 4, 28))]
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    first = e2e.generate_all(cluster.target, prompts[:1], MAX_TOKENS)
    rest = e2e.generate_all(cluster.target, prompts[1:], MAX_TOKENS)
    assert [r.token_ids for r in first + rest] == expected
    counts = locations(cluster)
    # the three long prompts (over the limit) and the first one went remote; some short
    # ones prefilled locally (each local one is sooner than a remote one with a transfer)
    assert counts["remote"] >= 4 and counts["local"] >= 1
    assert counts["local"] + counts["remote"] == len(prompts)
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "bb", "ccc"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


def test_a_constraint_gives_the_same_output_on_either_path(cluster, model_dir, e2e):
    """Short prompts are prefilled on the decode actor, long ones on the prefill actor (whose
    token 0 the decode actor replays into its matcher): the same greedy output as offline."""
    prompts = [[(7 * i + 5 * j) % 400 + 3 for j in range(n)]
               for i, n in enumerate((5, 30, 8, 44))]
    sampling = {"ignore_eos": False, "structured_outputs": {"json": SCHEMA}}
    before = locations(cluster)
    expected = e2e.reference(model_dir, prompts, 40, **sampling)
    results = e2e.generate_all(cluster.target, prompts, 40, **sampling)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "stop" for r in results)
    after = locations(cluster)
    assert after["remote"] > before["remote"] and after["local"] > before["local"]
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}


def test_each_pool_runs_the_threads_it_asked_for(cluster):
    stats = cluster.worker_stats()
    threads = {s.role: s.ledger["num_threads"] for s in stats.values()}
    assert threads == {"prefill": 2, "decode": 1}
