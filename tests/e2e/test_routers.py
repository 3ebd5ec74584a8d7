"""Two routers over one pair of pools (``--routers 2``, the chart's ``router.replicas: 2``):
both serve the offline engine's greedy tokens from the same workers, found through the one
registry in Redis; killing the first router (the one that runs the pools) leaves the second
serving, and the workers it killed none of."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


def test_two_routers_share_the_pools_and_either_survives_the_other(start_cluster, model_dir,
                                                                   e2e):
    cluster = start_cluster(model_dir, num_routers=2)
    try:
        assert len(cluster.targets) == 2 and len(set(cluster.targets)) == 2
        prompts = e2e.prompts(seed=11, n=3)
        expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
        for target in cluster.targets:
            outs = e2e.generate_all(target, prompts, MAX_TOKENS)
            assert [o.token_ids for o in outs] == expected, target
        workers = set(cluster.workers)
        assert {w.split("-")[0] for w in workers} == {"prefill", "decode"}  # one pair, shared

        cluster._ray.kill(cluster.routers[0], no_restart=True)  # the pools' manager goes too
        outs = e2e.generate_all(cluster.targets[1], prompts, MAX_TOKENS)
        assert [o.token_ids for o in outs] == expected
    finally:
        cluster.stop()
