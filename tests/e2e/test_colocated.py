"""Colocated worker actors (both phases in one worker): the baseline, end to end."""

from __future__ import annotations

import grpc
import pytest

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, colocated=True, num_decode=1, engine=dict(num_kv_blocks=512))
    yield c
    c.stop()


def test_concurrent_greedy_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(0, 8)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)


def test_constrained_greedy_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(5, 4)
    sampling = {"ignore_eos": False, "structured_outputs": {"regex": "[a-d]{3}-[0-9]{2}"}}
    expected = e2e.reference(model_dir, prompts, 24, **sampling)
    results = e2e.generate_all(cluster.target, prompts, 24, **sampling)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "stop" for r in results)


def test_cancel_mid_stream_and_deadline_free_every_block(cluster, e2e):
    code, got = e2e.cancel_then_deadline(cluster.target)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got, "the deadline should expire mid-stream, after token 0"
    assert e2e.wait_idle(cluster) == {"colocated-0": 0}
