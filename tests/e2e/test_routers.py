"""Several routers over one pair of pools (``--routers 3``, the chart's ``router.replicas``),
found through the one registry in Redis; one cluster serves the module, in this order:

1. requests sent before any worker is ready wait and finish once the workers come up; one
   with a short deadline fails DEADLINE_EXCEEDED saying what it waited for;
2. every router serves the offline engine's greedy tokens; many aborted and refused requests
   through two routers leave the decode worker's mailboxes and owner map empty;
   ``bench serve`` spreads a prefix-heavy workload over two routers in turn;
3. the third router killed mid-stream: its requests are freed on the workers within
   ``orphan_timeout_s`` while the others keep polling, and the first router's streams finish
   with the right tokens;
4. the first router (the one that runs the pools) killed: the second keeps serving, and the
   workers it killed none of.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request

import pytest

from pdserve.bench.chaos_routers import decode_mailboxes, forgotten_by_decode_workers, kill_router
from pdserve.bench.failover import StreamRecord, chaos_requests, stream_one
from pdserve.testing.waits import async_wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
ORPHAN_S = 3.0
ENGINE = dict(num_kv_blocks=1024)


def _waiting(cluster) -> float:
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_router_requests_waiting_for_workers "))


class EarlyRequests:
    """Sent by the cluster fixture once the routers serve and before any worker starts."""

    def __init__(self, e2e, model_dir):
        self.prompts = e2e.prompts(seed=5, n=3)
        self.expected = e2e.reference(model_dir, self.prompts, MAX_TOKENS)
        self.outs: list = []
        self.short_deadline = None  # the PdserveError of the request with a 1 s deadline
        self.thread: threading.Thread | None = None

    def send(self, cluster, e2e) -> None:
        from pdserve.api.client import PdserveClient, PdserveError

        target = cluster.targets[0]
        self.thread = threading.Thread(target=lambda: self.outs.extend(
            e2e.generate_all(target, self.prompts, MAX_TOKENS)), daemon=True)
        self.thread.start()
        e2e.wait_for(lambda: _waiting(cluster) == len(self.prompts), 30,
                     "the early requests waiting for workers")
        with PdserveClient(target) as client, pytest.raises(PdserveError) as err:
            client.generate([5, 6, 7], max_tokens=4, timeout=1.0)
        self.short_deadline = err.value


@pytest.fixture(scope="module")
def early(e2e, model_dir):
    return EarlyRequests(e2e, model_dir)


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir, early, e2e):
    c = start_cluster(model_dir, num_routers=3, orphan_timeout_s=ORPHAN_S, engine=ENGINE,
                      stage=lambda c: early.send(c, e2e))
    yield c
    c.stop()


def test_requests_sent_before_any_worker_is_ready_wait_for_one(cluster, early):
    early.thread.join(60)
    assert [o.token_ids for o in early.outs] == early.expected
    assert early.short_deadline.code.name == "DEADLINE_EXCEEDED"
    assert "no worker is ready" in str(early.short_deadline)
    assert _waiting(cluster) == 0


def test_every_router_serves_and_aborted_requests_leave_no_owner(cluster, model_dir, e2e):
    prompts = e2e.prompts(seed=11, n=3)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    for target in cluster.targets:
        outs = e2e.generate_all(target, prompts, MAX_TOKENS)
        assert [o.token_ids for o in outs] == expected, target
    assert {w.split("-")[0] for w in cluster.workers} == {"prefill", "decode"}  # one pair

    # long prompts that the decode pool cannot all hold (reserves refused for lack of room)
    # and deadlines that end them all mid-way (aborted), through two routers
    big = [dataclasses.replace(r, prompt=(r.prompt * 40)[:300 + i]) for i, r in
           enumerate(chaos_requests(24, seed=3, prefix="big", min_tokens=1200, max_tokens=1500))]
    records = asyncio.run(_stream_with_deadline(cluster.targets[:2], big, 1.5))
    errors = {r.error for r in records}
    assert None not in errors and errors <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    assert set(e2e.wait_idle(cluster).values()) == {0}
    e2e.wait_for(lambda: all((s.num_owned, s.num_boxed) == (0, 0)
                             for s in decode_mailboxes(cluster)), 30,
                 "every decode worker's owner map and mailboxes empty")


def test_bench_spreads_conversations_over_two_routers(cluster):
    from pdserve.bench.serve import ServeOptions, run_serve
    from pdserve.bench.workload import SyntheticShape

    result = run_serve(ServeOptions(target=",".join(cluster.targets[:2]), dataset="prefix",
                                    num_prompts=12, max_concurrency=4, disable_tqdm=True,
                                    shape=SyntheticShape(input_mean=64, output_mean=4)))
    # request i went to router i mod 2; each router's Admin gives the traces of its own
    assert (result["completed"], result["failed"], result["num_traces"]) == (12, 0, 12)
    # the 4 system prompts are shared by 16 conversations: turns after the first hit
    assert result["prefix_hit_rate"] > 0


def test_every_router_answers_admin_as_the_first_does(cluster, capsys):
    """Operators reach any router (a Service spreads them): the others ask the first router,
    which runs the pools, and answer alike; its errors keep their codes."""
    from pdserve.api.admin_client import AdminClient
    from pdserve.cli.main import main

    reports = []
    for target in cluster.targets:
        assert main(["status", "--target", target, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        reports.append((report["pools"], sorted(w["worker_id"] for w in report["workers"]),
                        report["control_plane"]["degraded"]))
    assert reports[1:] == reports[:1] * (len(reports) - 1)
    with pytest.raises(SystemExit) as exc:
        main(["drain", "--target", cluster.targets[2], "no-such-worker"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "unknown worker 'no-such-worker'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with AdminClient(cluster.targets[1]) as admin:
        assert admin.get_config()["pools"].keys() == {"prefill", "decode"}


async def _stream_with_deadline(targets, requests, deadline_s: float) -> list[StreamRecord]:
    from pdserve.api.client import AsyncPdserveClient

    records = [StreamRecord(r.request_id) for r in requests]
    clients = [AsyncPdserveClient(t) for t in targets]
    try:
        await asyncio.gather(*(stream_one(clients[i % len(clients)], r, rec, deadline_s)
                               for i, (r, rec) in enumerate(zip(requests, records,
                                                                strict=True))))
    finally:
        for client in clients:
            await client.close()
    return records


def test_a_router_killed_mid_stream_has_its_requests_freed(cluster, model_dir, e2e):
    from pdserve.api.client import AsyncPdserveClient

    prompts = e2e.prompts(seed=13, n=4)
    expected = e2e.reference(model_dir, prompts, 64)
    doomed = chaos_requests(6, seed=7, prefix="doomed", min_tokens=1500, max_tokens=1900)

    async def main():
        async with AsyncPdserveClient(cluster.targets[2]) as dying:
            lost = [StreamRecord(r.request_id) for r in doomed]
            tasks = [asyncio.create_task(stream_one(dying, r, rec, 120))
                     for r, rec in zip(doomed, lost, strict=True)]
            await async_wait_for(lambda: all(len(r.token_ids) >= 8 for r in lost), 30,
                                 "the third router's streams under way")
            kept = asyncio.create_task(asyncio.to_thread(e2e.generate_all, cluster.targets[0],
                                                         prompts, 64))
            killed = time.monotonic()
            kill_router(cluster, 2)
            await asyncio.to_thread(e2e.wait_for,
                                    lambda: forgotten_by_decode_workers(cluster, 2), 30,
                                    "the killed router forgotten by the decode worker", 0.05)
            freed_s = time.monotonic() - killed
            running = sum(s.num_running + s.num_waiting for wid, s in
                          (await asyncio.to_thread(cluster.worker_stats)).items()
                          if wid.startswith("decode"))
            await asyncio.gather(*tasks)
            return await kept, freed_s, running

    outs, freed_s, running = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected  # the first router's streams went on
    # freed by the orphan clock (the doomed requests had over a thousand tokens to go)
    assert ORPHAN_S - 0.5 < freed_s < ORPHAN_S + 10 and running <= len(prompts)
    assert set(e2e.wait_idle(cluster).values()) == {0}
    sizes = decode_mailboxes(cluster)
    assert all((s.num_owned, s.num_boxed) == (0, 0) and s.num_routers <= 2 for s in sizes)


def test_the_second_router_survives_the_first(cluster, model_dir, e2e):
    prompts = e2e.prompts(seed=11, n=3)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    workers = set(cluster.workers)
    kill_router(cluster, 0)  # the pools' manager goes too
    outs = e2e.generate_all(cluster.targets[1], prompts, MAX_TOKENS)
    assert [o.token_ids for o in outs] == expected
    stats = cluster._ray.get([a.stats.remote() for a in cluster.workers.values()], timeout=30)
    assert {s.worker_id for s in stats} == workers
