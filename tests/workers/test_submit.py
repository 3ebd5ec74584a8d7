"""A streaming worker takes a submit while its engine loop is inside a step: the request is
checked on the caller's thread and queued for the loop, so a router placing requests (one at
a time, each holding the placement turn until its submit returns) never waits for the step in
progress. A request that can never fit fails at once; an id the worker holds already is
refused at once, whichever way it came in (submit or reserve) and whichever router sent it."""

from __future__ import annotations

import time

import pytest

from pdserve import SamplingParams
from pdserve.engine.engine_loop import EngineStalledError
from pdserve.testing.waits import wait_for
from pdserve.worker_api import DuplicateRequestId, NeverFits, WorkRequest
from pdserve.workers.build import InProcTransfer, build_worker

from .conftest import engine_config

STALL_S = 2.0  # the first step sleeps this long before it computes (the submits take ms)
STEP_BOUND_S = 0.5  # --step-timeout-s of the bounded workers
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 14, 3, 27, 8, 11]


def request(request_id: str, prompt=PROMPT) -> WorkRequest:
    return WorkRequest(request_id, list(prompt), PARAMS, seed=3, arrival_time=time.time())


@pytest.fixture(params=["colocated", "decode"])
def worker(request, hf_checkpoint):
    """A colocated worker, or a decode worker prefilling a prompt itself (conditional
    disaggregation), both through ``StreamingWorker.submit``."""
    made = build_worker(request.param, f"{request.param}-submit",
                        engine_config(hf_checkpoint("llama"), num_kv_blocks=32),
                        InProcTransfer())
    yield made
    made.close()


def collect(worker, request_ids: set[str], timeout: float = 60.0) -> dict[str, list]:
    """Every delta of ``request_ids`` until each has its final one."""
    deltas: dict[str, list] = {rid: [] for rid in request_ids}
    pending, deadline = set(request_ids), time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for delta in worker.poll(0.2):
            deltas[delta.request_id].append(delta)
            if delta.finish_reason is not None:
                pending.discard(delta.request_id)
    assert not pending, f"never finished: {pending}"
    return deltas


def test_submits_are_taken_while_a_step_runs(worker):
    worker.loop.inject_fault("stall", STALL_S)
    worker.submit(request("first")).result(5)
    assert wait_for(lambda: worker.loop.busy_since is not None, 10)  # the stalled step began
    second = worker.submit(request("second"))
    too_long = worker.submit(request("too-long", list(range(3, 3 + 200))))
    twice = [worker.submit(request("twice")) for _ in range(2)]
    assert worker.loop.busy_since is not None  # all of that inside the first step
    assert second.done() and second.exception() is None
    assert too_long.done() and isinstance(too_long.exception(), NeverFits)
    assert all(f.done() for f in twice)
    assert twice[0].exception() is None
    assert isinstance(twice[1].exception(), DuplicateRequestId)  # loudly, not dropped
    deltas = collect(worker, {"first", "second", "twice"})
    tokens = {rid: [t for d in ds for t in d.new_token_ids] for rid, ds in deltas.items()}
    assert tokens["first"] == tokens["second"] == tokens["twice"]
    assert len(tokens["first"]) == PARAMS.max_tokens
    assert [d.finish_reason for d in deltas["twice"]].count("length") == 1  # ran once
    assert wait_for(lambda: worker.stats().result(5).used_blocks == 0, 10)


def test_a_submit_to_a_stopped_worker_fails_at_once(hf_checkpoint):
    stopped = build_worker("colocated", "stopped", engine_config(hf_checkpoint("llama")))
    stopped.loop.stop()
    try:
        future = stopped.submit(request("late"))
        assert future.done() and isinstance(future.exception(), RuntimeError)
        assert stopped.mailbox_sizes().num_owned == 0  # a refused request leaves no owner
    finally:
        stopped.close()


@pytest.mark.parametrize("order", [("reserve", "submit"), ("submit", "reserve"),
                                   ("reserve", "reserve")])
def test_an_id_held_on_a_decode_worker_is_refused_whichever_way_and_router(hf_checkpoint,
                                                                          order):
    """One id, twice, from two routers: the second is refused with DuplicateRequestId, the
    first router keeps the request (a reservation, or its deltas), and nothing leaks. Before,
    a submit claimed the id for its router before the duplicate was seen (stealing the first
    router's deltas) and a reserve after a submit made a second sequence under the id."""
    decode = build_worker("decode", "decode-dup", engine_config(hf_checkpoint("llama"),
                                                                num_kv_blocks=32),
                          InProcTransfer())
    try:
        def send(how: str, router: str):
            call = decode.reserve if how == "reserve" else decode.submit
            return call(request("same"), router=router)

        first = send(order[0], "router-a")
        first.result(10)
        second = send(order[1], "router-b")
        with pytest.raises(DuplicateRequestId):
            second.result(10)
        assert decode.mailbox_sizes().num_owned == 1
        if order[0] == "submit":  # router-a's deltas are router-a's, all of them
            tokens, reason, deadline = [], None, time.monotonic() + 60
            while reason is None and time.monotonic() < deadline:
                assert not decode.poll(0.0, router="router-b")
                for delta in decode.poll(0.2, router="router-a"):
                    tokens += delta.new_token_ids
                    reason = delta.finish_reason
            assert reason == "length" and len(tokens) == PARAMS.max_tokens
        else:
            decode.abort("same").result(10)
            assert [d.finish_reason for d in decode.poll(5, router="router-a")] == ["abort"]
        assert wait_for(lambda: decode.stats().result(5).used_blocks == 0, 10)
        assert decode.mailbox_sizes().num_owned == 0
    finally:
        decode.close()


@pytest.fixture(params=["colocated", "decode"])
def bounded_worker(request, hf_checkpoint):
    """A worker whose engine loop is stuck once a step runs past STEP_BOUND_S."""
    made = build_worker(request.param, f"{request.param}-bounded",
                        engine_config(hf_checkpoint("llama"), num_kv_blocks=32,
                                      step_timeout_s=STEP_BOUND_S), InProcTransfer())
    yield made
    made.close()


def test_a_submit_to_a_stuck_worker_fails_at_once_and_its_requests_end(bounded_worker):
    """A step past the worker's step bound (a hung collective, a stopped rank) makes it refuse
    a submit at once, and its stats carry why (the routers send it nothing new; its pool
    replaces it). When the step returns, the loop ends: the request it held ends with the
    reason, so its router moves it."""
    worker = bounded_worker
    worker.loop.inject_fault("stall", 4 * STEP_BOUND_S)
    worker.submit(request("first")).result(5)
    assert wait_for(lambda: worker.loop.failure, 10, "the stuck verdict").startswith("stuck:")
    refused = worker.submit(request("refused"))
    assert refused.done() and isinstance(refused.exception(), EngineStalledError)
    assert "past the step bound of 0.5 s" in str(refused.exception())
    assert "past the step bound" in worker.snapshot().error
    assert worker.mailbox_sizes().num_owned == 1  # the refused request left no owner entry
    deltas = collect(worker, {"first"})["first"]
    assert deltas[-1].error is not None and "EngineStalledError" in deltas[-1].error


def test_a_submit_queued_when_the_loop_dies_gets_a_final_delta(worker):
    """The loop dies (a part it needs is gone) between a step and the calls queued during it:
    a submit it accepted but never added still ends, with an error its router reads, as the
    request that was running does; nothing stays held."""
    worker.loop.inject_fault("stall", STALL_S)
    worker.submit(request("running")).result(5)
    assert wait_for(lambda: worker.loop.busy_since is not None, 10)  # the stalled step began
    worker.submit(request("queued")).result(5)  # accepted: queued for after the step
    worker.loop._watch = lambda: "a part the engine needs is gone (injected)"
    deltas = collect(worker, {"running", "queued"})
    assert "before the request was added" in deltas["queued"][-1].error
    assert deltas["running"][-1].error and "died" in deltas["running"][-1].error
    assert worker.engine.num_requests == 0
