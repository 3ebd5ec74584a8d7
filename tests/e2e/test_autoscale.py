"""The autoscaler on real Ray, Redis and gRPC: a load ramp grows prefill 1 -> 2 and decode
1 -> 2; when the load stops both drain back to 1. No request fails, greedy outputs equal the
offline engine's, no block is left owned, the decisions are counted in the metrics.

Tight SLOs and second-long delays keep it short on 2 cores: the signal logic itself is tested
on synthetic traces in ``tests/cluster/test_autoscale_decision.py``; this is the loop end to end."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from pdserve.cluster.autoscale.config import AutoscaleConfig

pytestmark = pytest.mark.e2e

AUTOSCALE = AutoscaleConfig(
    enabled=True, min_prefill=1, max_prefill=2, min_decode=1, max_decode=2,
    scale_interval_s=1.0, scale_up_delay_s=1.0, scale_down_delay_s=2.0,
    scale_down_grace_s=2.0, window_s=2.0, ttft_slo_ms=5.0, itl_slo_ms=5.0,
    prefill_queue_up_tokens=64, prefill_queue_down_tokens=32, min_samples=3)
MAX_TOKENS = 24
GROW_S = 150.0  # bound on both pools reaching 2 ready workers under load
SHRINK_S = 90.0  # bound on both pools draining back to 1 once the load stops


def pools(cluster) -> dict:
    return {p.role: p for p in cluster._ray.get(cluster.router.pools_info.remote(), timeout=30)}


def grown(cluster) -> bool:
    now = pools(cluster)
    return all(now[r].target == 2 and now[r].ready == 2 for r in ("prefill", "decode"))


def shrunk(cluster) -> bool:
    now = pools(cluster)
    return all(now[r].target == 1 and now[r].ready == 1 and now[r].draining == 0
               for r in ("prefill", "decode"))


async def ramp(target: str, prompts: list[list[int]], until, timeout: float):
    """Streams from a growing number of clients (one more every second, up to 12) until
    ``until()`` holds; returns (results, errors)."""
    from pdserve.api.client import AsyncPdserveClient

    results, errors, stop = [], [], asyncio.Event()

    async def client_loop(client, k: int):
        i = k
        while not stop.is_set():
            prompt = prompts[i % len(prompts)]
            try:
                out = await client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            ignore_eos=True, timeout=120)
                results.append((i % len(prompts), out))
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                errors.append(repr(exc))
            i += 12

    async with AsyncPdserveClient(target) as client:
        tasks, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(tasks) < 12:
                tasks.append(asyncio.create_task(client_loop(client, len(tasks))))
            if await asyncio.to_thread(until):
                break
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
    return results, errors


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, num_prefill=1, num_decode=1, autoscale=AUTOSCALE,
                      engine=dict(max_num_seqs=4, num_kv_blocks=256))
    yield c
    c.stop()


def test_a_load_ramp_grows_both_pools_and_they_drain_back_when_it_stops(cluster, e2e,
                                                                        model_dir):
    prompts = e2e.prompts(seed=8, n=12, low=20, high=60)
    results, errors = asyncio.run(ramp(cluster.target, prompts, lambda: grown(cluster),
                                       GROW_S))
    assert errors == []
    assert grown(cluster), f"pools did not grow: {pools(cluster)}"
    reference = e2e.reference(model_dir, prompts, MAX_TOKENS)
    assert results and all(out.token_ids == reference[k] for k, out in results)
    assert all(out.finish_reason == "length" for _, out in results)

    e2e.wait_for(lambda: shrunk(cluster), SHRINK_S, "both pools to drain back to 1")
    cluster.refresh_workers()
    assert sorted(w.split("-")[0] for w in cluster.workers) == ["decode", "prefill"]
    assert not any(e2e.wait_idle(cluster).values())  # no block left owned

    after = e2e.generate_all(cluster.target, prompts[:2], MAX_TOKENS)
    assert [o.token_ids for o in after] == reference[:2]
    metrics = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    for role in ("prefill", "decode"):
        assert f'pdserve_pool_target_workers{{role="{role}"}} 1.0' in metrics
        for direction in ("up", "down"):
            assert any(line.startswith("pdserve_autoscaler_decisions_total{")
                       and f'direction="{direction}"' in line and f'role="{role}"' in line
                       for line in metrics.splitlines()), (role, direction)
