"""Several routers on one decode worker, in one process: each request belongs to the router
that reserved it; a router that stops polling has its requests freed after
``orphan_timeout_s`` while another router keeps polling (the clock is per router), and many
aborted and refused requests leave nothing behind in the worker's mailboxes."""

from __future__ import annotations

import time

import pytest

from pdserve import SamplingParams
from pdserve.testing.waits import wait_for
from pdserve.worker_api import NeverFits, NoRoomNow, WorkRequest

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
MEDIUM = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def start(pair, request_id: str, params: SamplingParams, router: str) -> WorkRequest:
    request = WorkRequest(request_id, [3, 4, 5, 6], params, seed=1, arrival_time=time.time())
    reservation = pair.decode.reserve(request, router).result(5)
    pair.prefill.prefill(request, reservation).result(10)
    return request


def test_a_silent_routers_requests_are_freed_while_another_router_polls(hf_checkpoint,
                                                                        make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    pair.decode.orphan_timeout_s = 0.5
    reference, _ = pair.generate("ref", [3, 4, 5, 6], SHORT)
    start(pair, "dead-1", LONG, "router")  # "router" never polls again
    start(pair, "live-1", SHORT, "router-1")
    pair.decode.loop.inject_fault("stall", 0.8)  # dead-1 is still running when its clock ends
    live, ends = [], {}

    def poll_as_router_1():
        for d in pair.decode.poll(0.05, router="router-1"):
            live.extend(d.new_token_ids if d.request_id == "live-1" else [])
            ends.setdefault(d.request_id, []).append(d)
        done = any(d.finish_reason for d in ends.get("live-1", []))
        return done and "dead-1" in ends and pair.used_blocks() == (0, 0)

    wait_for(poll_as_router_1, 10, "live-1 finished, dead-1 freed and its end polled")
    assert [d.finish_reason for d in ends["live-1"]][-1] == "length"
    assert live == reference[1:]
    # dead-1's tokens never reached router-1; its end did, saying why (router-1 ignores the
    # end of a request it does not know; the silent router, polling first, would learn why)
    [freed] = ends["dead-1"]
    assert freed.finish_reason == "abort" and "router has not polled" in freed.error
    sizes = pair.decode.mailbox_sizes()
    assert (sizes.num_owned, sizes.num_boxed, sizes.num_routers) == (0, 0, 1)


def test_many_aborted_and_refused_requests_leave_the_mailboxes_empty(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"), decode_blocks=32)
    for i in range(40):
        router = f"router-{i % 2}"
        running = start(pair, f"run-{i}", MEDIUM, router)
        reserved = WorkRequest(f"res-{i}", [3, 4, 5], SHORT, seed=1, arrival_time=time.time())
        pair.decode.reserve(reserved, router).result(5)
        too_big = WorkRequest(f"big-{i}", [3] * 200, SHORT, seed=1, arrival_time=time.time())
        with pytest.raises((NeverFits, NoRoomNow)):
            pair.decode.reserve(too_big, router).result(5)
        pair.decode.abort(running.request_id).result(5)
        pair.decode.abort(reserved.request_id).result(5)
        for router_name in ("router-0", "router-1"):
            pair.decode.poll(0, router=router_name)
    for router_name in ("router-0", "router-1"):
        pair.decode.poll(0, router=router_name)
    sizes = pair.decode.mailbox_sizes()
    assert (sizes.num_owned, sizes.num_boxed, sizes.num_routers) == (0, 0, 2)
    assert pair.used_blocks() == (0, 0)
