"""RayHandle hands a worker's refusals and request faults to the router as the worker raised
them, whatever Ray wrapped them in; it polls and submits through the worker's channel, or
through Ray where the channel cannot be reached, and a channel that closes fails the call as a
dead worker (no Ray started: the actor is faked; the channel is real)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from ray.exceptions import RayTaskError

from pdserve import SamplingParams
from pdserve.cluster.actors import RayHandle
from pdserve.worker_api import (
    DuplicateRequestId,
    NeverFits,
    NoRoomNow,
    RequestDelta,
    RequestFaultError,
    StepDeltas,
    WorkRequest,
)
from pdserve.workers.worker_channel import ChannelLost, ChannelServer


class RaisingActor:
    """An actor whose every method fails with ``error`` wrapped as Ray wraps a task's."""

    def __init__(self, error: Exception):
        self.error = error

    def __getattr__(self, method: str):
        error = self.error

        class Method:
            @staticmethod
            def remote(*args):
                async def fail():
                    raise RayTaskError(method, "traceback", error).as_instanceof_cause()
                return fail()
        return Method


@pytest.mark.parametrize("error", [NoRoomNow("decode-0: 3 free KV blocks, request r needs 9"),
                                   NeverFits("prompt (9000 tokens) exceeds the context length"),
                                   RequestFaultError("r: logits are not finite")])
def test_worker_errors_reach_the_router_unwrapped(error):
    handle = RayHandle(RaisingActor(error), "decode-0", "decode")
    with pytest.raises(type(error)) as raised:
        asyncio.run(handle.renew("r"))
    assert type(raised.value) is type(error) and str(raised.value) == str(error)


def test_other_errors_stay_ray_errors():
    handle = RayHandle(RaisingActor(RuntimeError("engine loop died")), "decode-0", "decode")
    with pytest.raises(RayTaskError):
        asyncio.run(handle.stats())


class PollingActor:
    """An actor whose ``worker_channel`` names ``address``, whose Ray ``poll`` answers one
    delta and whose Ray ``submit`` counts the request."""

    def __init__(self, address, authkey: bytes = b"k" * 32):
        self.channel = (address, authkey)
        self.ray_polls = 0
        self.ray_submits = 0

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                async def answer():
                    if method == "worker_channel":
                        return actor.channel
                    if method == "submit":
                        actor.ray_submits += 1
                        return None
                    assert method == "poll"
                    actor.ray_polls += 1
                    return StepDeltas([RequestDelta("r", [5], "x")])
                return answer()
        return Method


REQUEST = WorkRequest("r", [3, 4, 5], SamplingParams(max_tokens=4), seed=1, arrival_time=0.0)


def test_polls_and_submits_go_through_ray_where_the_channel_cannot_be_reached():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
    actor = PollingActor(address)
    handle = RayHandle(actor, "decode-0", "decode")

    async def calls():
        await handle.submit(REQUEST)
        return [list(await handle.poll(0.01)) for _ in range(2)]

    first, second = asyncio.run(calls())
    assert [d.request_id for d in first + second] == ["r", "r"]
    assert handle.polls is None and handle.submits is None
    assert (actor.ray_polls, actor.ray_submits) == (2, 1) and handle.dead_at is None


def test_submits_go_through_the_channel_and_its_refusals_arrive_as_raised():
    held: list[str] = []

    def submit(request, router):
        if request.request_id in held:
            raise DuplicateRequestId(f"{request.request_id}: held here already")
        held.append(request.request_id)

    server = ChannelServer({"submit": submit}, "127.0.0.1")
    actor = PollingActor(server.address, server.authkey)
    handle = RayHandle(actor, "decode-0", "decode")

    async def two_submits():
        submitted, polled = await asyncio.gather(  # both wait for the one opening
            handle.submit(REQUEST), handle.poll(0.01), return_exceptions=True)
        assert submitted is None and isinstance(polled, TypeError)  # (no poll served here)
        with pytest.raises(DuplicateRequestId):
            await handle.submit(REQUEST)

    try:
        asyncio.run(two_submits())
    finally:
        server.close()
    assert held == ["r"] and actor.ray_submits == 0 and handle.dead_at is None


def test_a_closed_channel_fails_the_call_and_marks_the_worker_dead():
    server = ChannelServer({"poll": lambda timeout, router: StepDeltas(),
                            "submit": lambda request, router: None}, "127.0.0.1")
    actor = PollingActor(server.address, server.authkey)
    handle = RayHandle(actor, "decode-0", "decode")

    async def calls():
        assert list(await handle.poll(0.01)) == []  # through the channel
        server.close()
        with pytest.raises(ChannelLost):
            await handle.submit(REQUEST)

    asyncio.run(calls())
    assert (actor.ray_polls, actor.ray_submits) == (0, 0) and handle.dead_at is not None
