"""A worker's polls and submits over its worker channel (``workers.worker_channel``): a request
submitted through it runs on a real decode worker and its deltas reach the router as the
worker's own polls return them; the channel opens only to its key and serves only its calls;
what a call raises is raised in the router; a closed or silent worker end fails the call
instead of hanging it; a host serves the polls of several channels one at a time."""

from __future__ import annotations

import threading
import time
from multiprocessing import AuthenticationError

import pytest

from pdserve import SamplingParams
from pdserve.worker_api import DuplicateRequestId, StepDeltas, WorkRequest
from pdserve.workers.host import WorkerHost
from pdserve.workers.worker_channel import ChannelClient, ChannelLost, ChannelServer

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def streamed(client: ChannelClient, tokens: list[int]) -> tuple[list[int], str | None]:
    """Poll through ``client`` until request "r" finishes (30 s at most): ``tokens`` with
    every token streamed after them, and the finish reason."""
    reason, deadline = None, time.monotonic() + 30
    while reason is None and time.monotonic() < deadline:
        for delta in client.poll(0.2):
            assert delta.request_id == "r"
            tokens += delta.new_token_ids
            reason = delta.finish_reason
    return tokens, reason


def test_a_requests_deltas_come_through_the_channel_as_the_workers_poll_gives_them(
        hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    reference, _ = pair.generate("ref", [3, 4, 5, 6], PARAMS)
    host = WorkerHost(pair.decode)
    server = ChannelServer({"poll": host.poll_blocking}, "127.0.0.1")
    client = ChannelClient(server.address, server.authkey, router="router-a")
    try:
        request = WorkRequest("r", [3, 4, 5, 6], PARAMS, seed=1, arrival_time=time.time())
        reservation = pair.decode.reserve(request, "router-a").result(10)
        first = pair.prefill.prefill(request, reservation).result(10)
        assert streamed(client, list(first.first.new_token_ids)) == (reference, "length")
        assert pair.used_blocks() == (0, 0)
    finally:
        client.close()
        server.close()


def test_a_request_submitted_through_the_channel_streams_the_reference_tokens(
        hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    reference, _ = pair.generate("ref", [3, 4, 5, 6], PARAMS)
    host = WorkerHost(pair.decode)
    server = ChannelServer({"poll": host.poll_blocking, "submit": host.submit_blocking},
                           "127.0.0.1")
    polls = ChannelClient(server.address, server.authkey, router="router-a")
    submits = ChannelClient(server.address, server.authkey, router="router-a")
    try:
        request = WorkRequest("r", [3, 4, 5, 6], PARAMS, seed=1, arrival_time=time.time())
        submits.submit(request)  # the decode worker computes the prompt itself
        with pytest.raises(DuplicateRequestId):
            submits.submit(request)
        assert streamed(polls, []) == (reference, "length")
        assert pair.used_blocks() == (0, 0)
    finally:
        polls.close()
        submits.close()
        server.close()


def test_the_channel_serves_only_the_calls_it_was_built_with():
    server = ChannelServer({"poll": lambda timeout, router: StepDeltas()}, "127.0.0.1")
    client = ChannelClient(server.address, server.authkey)
    try:
        with pytest.raises(TypeError, match="no call 'submit'"):
            client.submit(WorkRequest("r", [3], PARAMS, seed=1, arrival_time=0.0))
        assert list(client.poll(0.01)) == []  # the connection still serves
    finally:
        client.close()
        server.close()


def test_the_channel_opens_only_to_its_key():
    server = ChannelServer({"poll": lambda timeout, router: StepDeltas()}, "127.0.0.1")
    try:
        with pytest.raises(AuthenticationError):
            ChannelClient(server.address, b"x" * 32)
        client = ChannelClient(server.address, server.authkey)  # the server still accepts
        assert list(client.poll(0.01)) == []
        client.close()
    finally:
        server.close()


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


@pytest.mark.parametrize("error, raised", [(TypeError("poll: a prefill worker"), TypeError),
                                           (Unpicklable("a lock inside"), RuntimeError)])
def test_what_a_poll_raises_is_raised_in_the_router(error, raised):
    def poll(timeout, router):
        raise error

    server = ChannelServer({"poll": poll}, "127.0.0.1")
    client = ChannelClient(server.address, server.authkey)
    try:
        with pytest.raises(raised, match=str(error)):
            client.poll(0.01)
        with pytest.raises(raised):  # the connection still serves
            client.poll(0.01)
    finally:
        client.close()
        server.close()


def test_a_closed_worker_end_fails_the_poll_instead_of_waiting_out_its_timeout():
    server = ChannelServer({"poll": lambda timeout, router: StepDeltas()}, "127.0.0.1")
    client = ChannelClient(server.address, server.authkey)
    client.poll(0.01)
    server.close()
    with pytest.raises(ChannelLost):
        client.poll(3600.0)  # (a poll that waited the hour would end the test run instead)
    client.close()


def test_a_silent_worker_end_fails_the_poll_after_the_grace():
    release = threading.Event()

    def stuck(timeout, router):
        release.wait(10)
        return StepDeltas()

    server = ChannelServer({"poll": stuck}, "127.0.0.1")
    client = ChannelClient(server.address, server.authkey, grace_s=0.2)
    try:
        with pytest.raises(ChannelLost, match="no answer"):
            client.poll(0.05)
    finally:
        release.set()
        client.close()
        server.close()


def test_a_host_serves_the_polls_of_several_channels_one_at_a_time(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    host = WorkerHost(pair.decode)
    inside, most = [0], [0]
    poll = pair.decode.poll

    def counting_poll(timeout, router=""):  # the worker's own poll, counted
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            return poll(timeout, router=router)
        finally:
            inside[0] -= 1

    pair.decode.poll = counting_poll
    server = ChannelServer({"poll": host.poll_blocking}, "127.0.0.1")
    clients = [ChannelClient(server.address, server.authkey, router=f"r{i}") for i in range(3)]
    try:
        threads = [threading.Thread(target=lambda c=c: [c.poll(0.05) for _ in range(5)])
                   for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert most[0] == 1
    finally:
        for client in clients:
            client.close()
        server.close()
