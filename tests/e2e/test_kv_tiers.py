"""KV tiers on real clusters: prompts evicted from the workers' pools come back from the host
and disk tiers, disaggregated (the prefill worker loads what it computes from, the decode
worker what it need not receive) and colocated, with the offline engine's tokens; the traces
say where each prompt's leading tokens came from, the stats count them, and no block leaks."""

from __future__ import annotations

import random

import pytest

from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.e2e

MAX_TOKENS = 4
# pools of 40 blocks of 4 tokens: a 61-token prompt takes 17, so the six below overflow them;
# the host tier holds ~10 blocks (1 KiB each for this checkpoint), the disk tier the rest
TIERS = dict(num_kv_blocks=40, kv_offload_cpu_gib=0.00001, kv_offload_disk_gib=0.001)


def prompts() -> list[list[int]]:
    rng = random.Random(48)
    return [[rng.randrange(3, 400) for _ in range(61)] for _ in range(6)]


def rounds(cluster, e2e, batch: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, twice over (the second round finds the first's blocks in tiers)."""
    return [result.token_ids for _ in range(2) for p in batch
            for result in e2e.generate_all(cluster.target, [p], MAX_TOKENS)]


def tier_tokens(source) -> int:
    return 0 if source is None else source.host_tokens + source.disk_tokens


@pytest.fixture(scope="module")
def disaggregated(start_cluster, model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-tiers")
    c = start_cluster(model_dir, num_prefill=1, num_decode=1,
                      engine=dict(TIERS, kv_offload_dir=str(folder)),
                      router=RouterConfig(disaggregation="always"))
    yield c
    c.stop()


def test_disaggregated_tiers_serve_the_offline_tokens(disaggregated, model_dir, e2e):
    batch = prompts()
    expected = e2e.reference(model_dir, batch, MAX_TOKENS)
    assert rounds(disaggregated, e2e, batch) == expected + expected
    assert e2e.wait_idle(disaggregated) == {"prefill-0": 0, "decode-0": 0}
    traces = disaggregated.traces()[-len(batch):]
    assert sum(tier_tokens(t.prefix_source) for t in traces) > 0
    assert sum(tier_tokens(t.decode_prefix_source) for t in traces) > 0
    assert all(t.prefix_source.cached_tokens <= 60 for t in traces)
    stats = disaggregated.worker_stats()
    for worker_id in ("prefill-0", "decode-0"):
        s = stats[worker_id]
        assert s.kv_host_hit_tokens + s.kv_disk_hit_tokens > 0, worker_id
        assert s.kv_disk_written_bytes > 0 and s.kv_tier_read_failures == 0, worker_id


def test_colocated_tiers_serve_the_offline_tokens(start_cluster, model_dir, e2e,
                                                  tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-tiers-colocated")
    cluster = start_cluster(model_dir, colocated=True, num_decode=1,
                            engine=dict(TIERS, kv_offload_dir=str(folder)))
    try:
        batch = prompts()
        expected = e2e.reference(model_dir, batch, MAX_TOKENS)
        assert rounds(cluster, e2e, batch) == expected + expected
        traces = cluster.traces()[-len(batch):]
        assert sum(tier_tokens(t.prefix_source) for t in traces) > 0
        (worker_id, used), = e2e.wait_idle(cluster).items()
        assert used == 0
        assert cluster.worker_stats()[worker_id].kv_bytes_per_block > 0
    finally:
        cluster.stop()
