"""Operating a running 1 prefill + 2 decode cluster on real Ray, Redis and gRPC: ``pdserve
status`` and ``pdserve drain`` (the real CLI in a subprocess), a SIGKILLed worker replaced, the
router actor killed and restarted by Ray, and no process left after stop. Then small
clusters of their own (one colocated worker each): a worker that cannot start (its error
reaches the launcher), and a detached cluster left running by one launcher and adopted by the
next, and one left running on a Redis that is gone, which the next launcher replaces.

The shared cluster's tests run in file order; each leaves the pools at their targets for the
next (the drain lowers the decode target to 1 for good).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from pdserve.api.client import AsyncPdserveClient, PdserveClient
from pdserve.cluster.processes import is_running

pytestmark = pytest.mark.e2e

LONG_TOKENS = 600  # a stream that outlives the drain by seconds on any machine
START_S = 120.0  # bound on a replacement worker or a restarted router coming up
# Each look through the real CLI starts an interpreter, each look at health opens a gRPC
# channel: on 2 cores, looking every 0.02 s (wait_for's default) takes the CPU from the worker
# or router being waited for.
POLL_S = 0.5
# The small clusters of their own: one colocated worker (a disaggregated pair would only
# start one more worker actor; what these tests check is the launcher's, for any pool).
SMALL = dict(colocated=True, num_decode=1)


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, num_prefill=1, num_decode=2, engine=dict(num_kv_blocks=512))
    yield c
    c.stop()


def pdserve(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real ``pdserve`` command line."""
    result = subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args],
                            capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def status(cluster) -> dict:
    out = pdserve("status", "--target", cluster.target, "--json").stdout
    return json.loads(out)


def serving(cluster) -> bool:
    with PdserveClient(cluster.target, timeout=5) as client:
        return client.health(timeout=5) == "SERVING"


def live(report: dict, role: str) -> list[dict]:
    return [w for w in report["workers"] if w["role"] == role and w["state"] != "dead"]


def test_status_json_lists_every_worker_with_its_real_pid(cluster):
    report = status(cluster)
    assert report["pools"]["prefill"]["target"] == 1 and report["pools"]["prefill"]["ready"] == 1
    assert report["pools"]["decode"]["target"] == 2 and report["pools"]["decode"]["ready"] == 2
    workers = {w["worker_id"]: w for w in report["workers"]}
    assert set(workers) == {"prefill-0", "decode-0", "decode-1"}
    for worker_id, w in workers.items():
        assert w["state"] == "ready" and w["restarts"] == 0
        assert w["pid"] == cluster.worker_info[worker_id]["pid"] and is_running(w["pid"])
        assert w["pid"] != os.getpid() and w["node"] == "127.0.0.1"
        assert w["kv_total_blocks"] == 512 and w["heartbeat_age_s"] >= 0
    table = pdserve("status", "--target", cluster.target).stdout
    assert "decode-1" in table and "POOL" in table


def test_drain_lets_its_streams_finish_then_stops_the_worker_for_good(cluster, e2e):
    async def stream(client, prompt):
        return await client.generate(prompt, max_tokens=LONG_TOKENS, temperature=0.0,
                                     ignore_eos=True, timeout=300)

    async def main():
        async with AsyncPdserveClient(cluster.target) as client:
            prompts = [[5 + i, 6, 7, 8] for i in range(4)]
            tasks = [asyncio.create_task(stream(client, p)) for p in prompts]

            def busy_decode():  # the decode worker streaming the most requests now
                stats = cluster.worker_stats()
                running = {w: s.num_running for w, s in stats.items() if s.role == "decode"}
                best = max(running, key=running.get)
                return best if running[best] else None

            victim = await asyncio.to_thread(e2e.wait_for, busy_decode, 60,
                                             "a decode worker streaming a request")
            drained = await asyncio.to_thread(pdserve, "drain", "--target", cluster.target,
                                              victim)
            report = await asyncio.to_thread(status, cluster)
            during = await client.generate([9, 10, 11], max_tokens=4, temperature=0.0,
                                           timeout=120)
            return victim, drained, report, during, await asyncio.gather(*tasks), prompts

    victim, drained, report, during, results, prompts = asyncio.run(main())
    assert f"draining {victim}" in drained.stderr
    assert {w["worker_id"]: w["state"] for w in report["workers"]}[victim] == "draining"
    assert report["pools"]["decode"]["target"] == 1
    assert during.finish_reason == "length"
    assert [r.usage.completion_tokens for r in results] == [LONG_TOKENS] * len(prompts)
    assert all(r.finish_reason == "length" for r in results)
    pid = cluster.worker_info[victim]["pid"]
    e2e.wait_for(lambda: not is_running(pid), START_S, f"{victim} to exit")

    def gone():
        report = status(cluster)
        return report if victim not in {w["worker_id"] for w in report["workers"]} else None

    final = e2e.wait_for(gone, START_S, f"{victim} to leave the status", POLL_S)
    assert final["pools"]["decode"]["target"] == 1 and final["pools"]["decode"]["ready"] == 1
    assert len(live(final, "decode")) == 1 and final["pools"]["decode"]["restarts"] == 0
    again = e2e.generate_all(cluster.target, prompts[:1], LONG_TOKENS)[0]
    assert again.token_ids == results[0].token_ids  # greedy: the drain changed nothing


def test_sigkilled_worker_is_replaced_and_its_series_dropped(cluster, model_dir, e2e):
    [old] = live(status(cluster), "decode")
    cluster.kill_worker_process(old["worker_id"])

    def replaced():
        report = status(cluster)
        new = [w for w in live(report, "decode") if w["worker_id"] != old["worker_id"]]
        pool = report["pools"]["decode"]
        return report if new and pool["ready"] == pool["target"] == 1 else None

    report = e2e.wait_for(replaced, START_S, "a replacement decode worker", POLL_S)
    [new] = live(report, "decode")
    assert new["restarts"] == 1 and report["pools"]["decode"]["restarts"] == 1
    assert is_running(new["pid"]) and not is_running(old["pid"])
    e2e.wait_for(lambda: serving(cluster), START_S, "SERVING again", POLL_S)
    prompts = e2e.prompts(3, 4)
    results = e2e.generate_all(cluster.target, prompts, 8)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, 8)

    def series_dropped():
        text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
        return text if f'worker="{old["worker_id"]}"' not in text else None

    text = e2e.wait_for(series_dropped, 30, "the dead worker's series gone")
    assert 'pdserve_worker_restarts_total{role="decode"} 1.0' in text
    assert f'worker="{new["worker_id"]}"' in text


def test_killed_router_is_restarted_by_ray_and_adopts_the_pools(cluster, model_dir, e2e):
    before = {w["worker_id"]: w["pid"] for w in status(cluster)["workers"]
              if w["state"] != "dead"}
    router_pid = cluster._ray.get(cluster.router.info.remote(), timeout=30)["pid"]
    os.kill(router_pid, signal.SIGKILL)
    e2e.wait_for(lambda: not is_running(router_pid), 30, "the router process to die")
    e2e.wait_for(lambda: serving(cluster), START_S, "the restarted router SERVING", POLL_S)

    def adopted():  # the same workers (same processes), ready again, none started
        report = status(cluster)
        states = {w["worker_id"]: w["state"] for w in report["workers"]}
        return report if all(states.get(w) == "ready" for w in before) else None

    after = e2e.wait_for(adopted, START_S, "the pools adopted", POLL_S)
    assert {w["worker_id"]: w["pid"] for w in after["workers"] if w["state"] != "dead"} == before
    assert after["pools"]["decode"]["target"] == 1 and after["pools"]["prefill"]["target"] == 1
    prompts = e2e.prompts(4, 3)
    results = e2e.generate_all(cluster.target, prompts, 8)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, 8)


def test_unknown_worker_is_a_one_line_error(cluster):
    result = pdserve("drain", "--target", cluster.target, "decode-99", check=False)
    assert result.returncode == 2
    assert "unknown worker 'decode-99'" in result.stderr and "Traceback" not in result.stderr


def test_stop_leaves_no_process_replacements_included(cluster):
    pids = cluster.started_pids()
    # 2 routers (one killed), prefill-0, decode-0, decode-1, the replacement decode worker
    assert len(pids) == 6
    cluster.stop()
    assert [pid for pid in pids if is_running(pid)] == []


def test_a_worker_that_cannot_start_fails_the_start_with_its_own_error(start_cluster,
                                                                       model_dir):
    from pdserve.cli.preflight import user_error
    from pdserve.cluster.pools.manager import WorkerStartError

    with pytest.raises(WorkerStartError, match="MemoryBudgetError") as err:
        start_cluster(model_dir, **SMALL,
                      engine=dict(memory_budget_bytes=1 << 20, num_kv_blocks=None))
    assert "--memory-budget-mib" in str(user_error(err.value))


def test_a_detached_cluster_left_running_is_adopted_by_the_next_launcher(start_cluster,
                                                                         model_dir, e2e):
    import uuid

    name = f"adopt{uuid.uuid4().hex[:6]}"
    first = start_cluster(model_dir, **SMALL, cluster_name=name, detached=True,
                          detach_on_stop=True)
    pids = first.started_pids()
    workers = {w: info["pid"] for w, info in first.worker_info.items()}
    first.stop()  # leaves the router and its pools running
    assert all(is_running(pid) for pid in pids)
    second = start_cluster(model_dir, **SMALL, cluster_name=name, detached=True)
    try:
        assert second.port == first.port and second.started_pids() == pids
        assert {w: info["pid"] for w, info in second.worker_info.items()} == workers
        prompts = e2e.prompts(5, 2)
        results = e2e.generate_all(second.target, prompts, 8)
        assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, 8)
    finally:
        second.stop()
    assert [pid for pid in pids if is_running(pid)] == []


def test_a_left_router_of_another_redis_is_replaced_not_adopted(start_cluster, model_dir, e2e,
                                                                caplog):
    """A detached router left running on a Redis that is gone is stale to the next launcher
    of its cluster name: it and its workers are killed, and fresh ones serve. The warning
    that says so shows that Redis's URL without its password."""
    import uuid

    from pdserve.cluster.processes import wait_gone
    from pdserve.cluster.redis_server import url_password

    name = f"stale{uuid.uuid4().hex[:6]}"
    first = start_cluster(model_dir, **SMALL, own_redis=True, cluster_name=name,
                          detached=True, detach_on_stop=True)
    left = first.actor_pids()
    first.stop()  # leaves the router and its pools running, stops the Redis they use
    assert left and all(is_running(pid) for pid in left)
    password = url_password(first.redis_url)
    second = start_cluster(model_dir, **SMALL, cluster_name=name, detached=True)
    try:
        stale = [r.getMessage() for r in caplog.records if "stale router" in r.getMessage()]
        assert stale and ":***@" in stale[0], stale
        assert password and password not in caplog.text
        assert wait_gone(left, START_S) == set()
        assert second.actor_pids().isdisjoint(left)
        prompts = e2e.prompts(6, 2)
        results = e2e.generate_all(second.target, prompts, 8)
        assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, 8)
    finally:
        second.stop()
