"""Worker-side failure paths: deadlines, a dead engine loop, no router polling, long steps.
Each ends in a leak check."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve import SamplingParams
from pdserve.engine.engine_loop import EngineDeadError, EngineStalledError
from pdserve.testing.waits import wait_for
from pdserve.worker_api import WorkRequest

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def drain_until(worker, done, timeout: float = 10.0) -> list:
    """Poll ``worker``'s deltas until ``done(all deltas so far)``."""
    deltas = []
    wait_for(lambda: deltas.extend(worker.poll(0.05)) or done(deltas), timeout,
             "the expected deltas")
    return deltas


def test_worker_drops_expired_work_without_the_router(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    req = WorkRequest("late", [3, 4, 5], params, seed=1, arrival_time=time.time(),
                      deadline=time.time() + 0.3)
    reservation = pair.decode.reserve(req).result(5)
    pair.decode.loop.inject_fault("stall", 0.6)  # its first decode step outlasts the deadline
    pair.prefill.prefill(req, reservation).result(10)
    deltas = drain_until(pair.decode, lambda ds: any(d.finish_reason for d in ds))
    last = deltas[-1]
    assert last.finish_reason == "abort" and last.deadline_exceeded
    assert pair.used_blocks() == (0, 0)

def test_a_dead_loop_refuses_work_and_says_so(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    req = WorkRequest("a", [3, 4, 5], GREEDY, seed=1, arrival_time=time.time())
    pair.decode.reserve(req).result(5)
    pair.prefill.prefill(req, pair.decode.reserve(dataclasses.replace(
        req, request_id="b")).result(5))
    pair.decode.loop.inject_fault("raise")
    deltas = drain_until(pair.decode, lambda ds: len({d.request_id for d in ds if d.error}) == 2)
    assert {d.request_id for d in deltas if d.error and "died" in d.error} == {"a", "b"}
    assert pair.decode.snapshot().error is not None
    with pytest.raises(EngineDeadError):
        pair.decode.reserve(dataclasses.replace(req, request_id="c")).result(5)


def test_unpolled_worker_aborts_its_requests(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    pair.decode.orphan_timeout_s = 0.3
    pair.decode.loop.inject_fault("stall", 0.5)  # so the request is still running by then
    params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    req = WorkRequest("orphan", [3, 4, 5], params, seed=1, arrival_time=time.time())
    pair.prefill.prefill(req, pair.decode.reserve(req).result(5)).result(10)
    wait_for(lambda: pair.used_blocks() == (0, 0), 10, "the orphan's blocks freed")  # no poll
    assert any("has not polled this worker" in (d.error or "") for d in pair.decode.poll(0))


def test_a_long_step_does_not_hide_the_snapshot(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    pair.decode.loop.inject_fault("stall", 3.0)
    req = WorkRequest("s", [3, 4, 5], GREEDY, seed=1, arrival_time=time.time())
    pair.prefill.prefill(req, pair.decode.reserve(req).result(5)).result(10)
    wait_for(lambda: pair.decode.loop.busy_since is not None, 10, "the stalled step")
    snapshot = pair.decode.snapshot()
    assert pair.decode.loop.busy_since is not None  # answered while the step still stalls
    assert snapshot.worker_id == pair.decode.worker_id and snapshot.error is None
    stats = pair.decode.stats()
    with pytest.raises(TimeoutError):  # the loop itself is busy for the stall
        stats.result(0.2)
    pair.decode.abort("s").result(10)


def test_a_prefill_sent_to_a_stuck_prefill_worker_fails_at_once(hf_checkpoint, make_pair):
    """A prefill worker whose step runs past its step bound refuses a prefill at once (the
    router tries another) and its stats say why."""
    pair = make_pair(hf_checkpoint("llama"), step_timeout_s=0.5)
    first = WorkRequest("first", [3, 4, 5], GREEDY, seed=1, arrival_time=time.time())
    second = dataclasses.replace(first, request_id="second")
    pair.prefill.loop.inject_fault("stall", 2.0)
    pending = pair.prefill.prefill(first, pair.decode.reserve(first).result(5))
    wait_for(lambda: pair.prefill.loop.failure, 10, "the stuck verdict")
    refused = pair.prefill.prefill(second, pair.decode.reserve(second).result(5))
    assert refused.done() and isinstance(refused.exception(), EngineStalledError)
    assert "past the step bound of 0.5 s" in pair.prefill.snapshot().error
    wait_for(pending.done, 10, "the stuck step's end")
    for request_id in ("first", "second"):
        pair.decode.abort(request_id).result(5)
    wait_for(lambda: pair.decode.stats().result(5).used_blocks == 0, 10, "the decode blocks")


def test_a_commit_that_raises_fails_its_request_and_frees_its_blocks(hf_checkpoint, make_pair,
                                                                     monkeypatch):
    pair = make_pair(hf_checkpoint("llama"))

    def broken(seq):
        raise RuntimeError("injected commit failure")

    # token 0 is appended, then joining the batch fails: the engine must undo both
    monkeypatch.setattr(pair.decode.engine.scheduler, "add_running", broken)
    req = WorkRequest("c", [3, 4, 5, 6, 7], GREEDY, seed=1, arrival_time=time.time())
    pair.prefill.prefill(req, pair.decode.reserve(req).result(5)).result(10)
    deltas = drain_until(pair.decode, bool)
    assert deltas[0].finish_reason == "abort" and "commit failed" in deltas[0].error
    assert pair.used_blocks() == (0, 0)
