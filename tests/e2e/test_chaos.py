"""Chaos on real Ray actors, redis-server and gRPC: processes SIGKILLed mid-stream, an engine
loop made to raise, a step longer than the registry TTL, deadlines at a stalled prefill.

One 2 prefill + 2 decode cluster serves the module; every test ends with the pools back at
their targets and every live worker's blocks back to zero. Every stream (greedy and seeded
sampling) must be its request's draws at every position, which a lost or repeated token fails
(``pdserve.testing.draw_check``: up to float rounding, since a request's logits change in the
last bits with the batch it shares).
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from pdserve.bench.failover import (
    busiest,
    chaos_requests,
    sigkill_busiest,
    stream_all,
)
from pdserve.router.config import RouterConfig
from pdserve.testing.draw_check import draw_problems

pytestmark = pytest.mark.e2e

ENGINE = dict(num_kv_blocks=512)


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    # every prompt on a prefill worker: these faults are the disaggregated path's
    c = start_cluster(model_dir, num_prefill=2, num_decode=2, engine=ENGINE,
                      router=RouterConfig(disaggregation="always"))
    yield c
    c.stop()


def back_to_baseline(cluster, e2e) -> None:
    cluster.wait_pools(120)
    cluster.wait_ready(60)
    assert set(e2e.wait_idle(cluster).values()) == {0}


# Streams long enough to be mid-decode when a fault meant for running requests lands: on the
# tiny model a 96-token request can finish in the ~0.1 s between the trigger and the fault.
LONG = dict(min_tokens=192, max_tokens=256)


def run_chaos(cluster, model_dir, prefix: str, fault, tokens: dict | None = None, **traffic):
    cluster.refresh_workers()
    requests = chaos_requests(16, seed=sum(map(ord, prefix)), prefix=prefix, **(tokens or {}))
    records, _ = asyncio.run(stream_all(cluster.target, requests, fault, **traffic))
    traces = {t.request_id: t for t in cluster.traces()}
    assert [r.error for r in records] == [None] * len(records)
    assert draw_problems(str(model_dir), [(r.prompt, r.sampling) for r in requests],
                         [r.token_ids for r in records]) == []
    return records, [traces.get(r.request_id) for r in requests]


def test_decode_worker_sigkilled_mid_stream(cluster, model_dir, e2e):
    records, traces = run_chaos(cluster, model_dir, "kill-d",
                                          sigkill_busiest(cluster, "decode"), tokens=LONG)
    assert any(t.num_migrations for t in traces)  # the kill landed on running streams
    back_to_baseline(cluster, e2e)


PAIRS = "(ab|cd){250}"  # a matcher restarted rather than replayed would run on past 250


def test_constrained_streams_resume_their_grammar_after_a_killed_decode_worker(
        cluster, model_dir, e2e):
    """A migrated constrained request's new decode worker replays the tokens already streamed
    into a fresh matcher: every answer, greedy and sampled, still matches whole."""
    from pdserve.models.checkpoint import open_checkpoint

    requests = chaos_requests(8, seed=7, prefix="kill-g", min_tokens=600, max_tokens=600)
    for r in requests:
        r.sampling.update(ignore_eos=False, structured_outputs={"regex": PAIRS})
    cluster.refresh_workers()
    records, _ = asyncio.run(stream_all(cluster.target, requests,
                                        sigkill_busiest(cluster, "decode")))
    traces = {t.request_id: t for t in cluster.traces()}
    assert [r.error for r in records] == [None] * len(records)
    assert any(traces[r.request_id].num_migrations for r in requests)
    tokenizer = open_checkpoint(str(model_dir)).tokenizer()
    for record in records:
        text = tokenizer.decode(record.token_ids)
        assert re.fullmatch(PAIRS, text), text
    back_to_baseline(cluster, e2e)


def test_prefill_worker_sigkilled_with_prompts_queued(cluster, model_dir, e2e):
    cluster.refresh_workers()
    for wid in [w for w in cluster.workers if w.startswith("prefill")]:
        cluster.workers[wid].inject_fault.remote("stall", 6.0)  # prompts queue behind it

    def kill_after_queueing():
        time.sleep(2.0)  # inside the 6 s stall: the prompts sit at the prefill workers (with
        # time to get there on a machine other work keeps busy)
        sigkill_busiest(cluster, "prefill")()

    records, traces = run_chaos(cluster, model_dir, "kill-p", kill_after_queueing,
                                          fault_after_streams=0)
    assert any(t.num_retries for t in traces)
    back_to_baseline(cluster, e2e)


def test_engine_loop_raising_is_replaced_and_its_requests_move(cluster, model_dir, e2e):
    victims = []

    def crash():
        victims.append(busiest(cluster, "decode"))
        cluster._ray.get(cluster.workers[victims[0]].inject_fault.remote("raise"), timeout=30)

    records, traces = run_chaos(cluster, model_dir, "raise", crash, tokens=LONG)
    assert any(t.num_migrations for t in traces)
    e2e.wait_for(lambda: victims[0] not in {w.worker_id for w in cluster.refresh_workers()
                                            if w.state != "dead"},
                 what=f"{victims[0]} (its engine loop died) leaving the pool")
    back_to_baseline(cluster, e2e)


def test_step_longer_than_the_ttl_is_not_a_death(cluster, model_dir, e2e):
    ttl = cluster.options.ttl_s
    cluster.refresh_workers()
    before = set(cluster.workers)

    def stall_every_decode_worker():
        for wid in [w for w in cluster.workers if w.startswith("decode")]:
            cluster.workers[wid].inject_fault.remote("stall", ttl + 1.5)

    records, traces = run_chaos(cluster, model_dir, "stall",
                                          stall_every_decode_worker)
    assert not any(t.num_migrations or t.num_retries for t in traces)
    back_to_baseline(cluster, e2e)
    cluster.refresh_workers()
    assert set(cluster.workers) == before  # nobody was declared dead or replaced


def test_deadline_while_queued_at_a_stalled_prefill(cluster, e2e):
    from pdserve.api.client import PdserveClient, PdserveError

    cluster.refresh_workers()
    for wid in [w for w in cluster.workers if w.startswith("prefill")]:
        cluster.workers[wid].inject_fault.remote("stall", 2.5)
    with PdserveClient(cluster.target) as client, pytest.raises(PdserveError) as err:
        client.generate([5, 6, 7, 8] * 4, max_tokens=8, temperature=0.0, timeout=1.0)
    assert err.value.code.name == "DEADLINE_EXCEEDED"
    back_to_baseline(cluster, e2e)
