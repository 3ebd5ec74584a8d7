"""The KV tiers' load rule: a block below the pool is loaded when reading it (its bytes over the
tier's measured read rate) costs less than computing its tokens (the measured prefill time per
token); before anything is measured, loads win."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache.offload import COMPUTE_EMA, PoolTiers
from pdserve.engine.kv_cache.tiers import KVTiers
from pdserve.worker_api import KV_TIER_ASSUMED_READ_BYTES_PER_S, KV_TIER_DISK, KV_TIER_HOST

BLOCK_BYTES = 1 << 20
BLOCK = 16


@pytest.fixture
def pool_tiers():
    tiers = KVTiers(bytes(32), BLOCK_BYTES, host_bytes=64 * BLOCK_BYTES)
    yield PoolTiers([], tiers, BLOCK)
    tiers.close()


def test_before_any_compute_is_measured_every_block_loads(pool_tiers):
    assert pool_tiers.worth_loading([KV_TIER_HOST, KV_TIER_DISK, KV_TIER_DISK]) == 3


def test_blocks_load_up_to_the_first_one_computing_would_beat(pool_tiers):
    pool_tiers.note_compute(1000, 0.5)  # 0.5 ms a token: 8 ms a block
    # before a read, the assumed rates: 1 MiB in 0.26 ms from host, 1.05 ms from disk
    assert pool_tiers.read_bytes_per_s(KV_TIER_DISK) == KV_TIER_ASSUMED_READ_BYTES_PER_S[
        KV_TIER_DISK]
    assert pool_tiers.worth_loading([KV_TIER_HOST, KV_TIER_DISK]) == 2
    counters = pool_tiers.tiers.counters  # a slow disk measured: 10 ms a block
    counters.disk_read_bytes, counters.disk_read_s = BLOCK_BYTES, 0.01
    assert pool_tiers.worth_loading([KV_TIER_HOST, KV_TIER_HOST, KV_TIER_DISK,
                                     KV_TIER_HOST]) == 2
    assert pool_tiers.worth_loading([KV_TIER_DISK, KV_TIER_HOST]) == 0


def test_fast_compute_beats_every_load(pool_tiers):
    pool_tiers.note_compute(1000, 0.001)  # 1 us a token: 16 us a block, below a host read
    assert pool_tiers.worth_loading([KV_TIER_HOST]) == 0


def test_the_compute_time_is_a_running_mean_of_the_steps(pool_tiers):
    pool_tiers.note_compute(100, 1.0)
    pool_tiers.note_compute(100, 2.0)
    assert pool_tiers.compute_s_per_token == pytest.approx(0.01 + COMPUTE_EMA * 0.01)
    pool_tiers.note_compute(0, 1.0)  # (a step without prompt tokens says nothing)
    pool_tiers.note_compute(10, 0.0)
    assert pool_tiers.compute_s_per_token == pytest.approx(0.01 + COMPUTE_EMA * 0.01)
