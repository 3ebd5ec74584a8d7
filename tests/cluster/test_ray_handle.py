"""RayHandle hands a worker's refusals and request faults to the router as the worker raised
them, whatever Ray wrapped them in; it polls through Ray where the worker's delta channel
cannot be reached, and a channel that closes fails the poll as a dead worker (no Ray
started: the actor is faked; the channel is real)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from ray.exceptions import RayTaskError

from pdserve.cluster.actors import RayHandle
from pdserve.worker_api import NeverFits, NoRoomNow, RequestDelta, RequestFaultError, StepDeltas
from pdserve.workers.delta_channel import ChannelLost, ChannelServer


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
    """An actor whose ``delta_channel`` names ``address`` and whose Ray ``poll`` answers one
    delta."""

    def __init__(self, address, authkey: bytes = b"k" * 32):
        self.channel = (address, authkey)
        self.ray_polls = 0

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                async def answer():
                    if method == "delta_channel":
                        return actor.channel
                    assert method == "poll"
                    actor.ray_polls += 1
                    return StepDeltas([RequestDelta("r", [5], "x")])
                return answer()
        return Method


def test_polls_go_through_ray_where_the_channel_cannot_be_reached():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
    actor = PollingActor(address)
    handle = RayHandle(actor, "decode-0", "decode")

    async def two_polls():
        return [list(await handle.poll(0.01)) for _ in range(2)]

    first, second = asyncio.run(two_polls())
    assert [d.request_id for d in first + second] == ["r", "r"]
    assert handle.channel is None and actor.ray_polls == 2 and handle.dead_at is None


def test_a_closed_channel_fails_the_poll_and_marks_the_worker_dead():
    server = ChannelServer(lambda timeout, router: StepDeltas(), "127.0.0.1")
    actor = PollingActor(server.address, server.authkey)
    handle = RayHandle(actor, "decode-0", "decode")

    async def polls():
        assert list(await handle.poll(0.01)) == []  # through the channel
        server.close()
        with pytest.raises(ChannelLost):
            await handle.poll(0.01)

    asyncio.run(polls())
    assert actor.ray_polls == 0 and handle.dead_at is not None
