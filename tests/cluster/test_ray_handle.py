"""RayHandle hands a worker's refusals and request faults to the router as the worker raised
them, whatever Ray wrapped them in (no Ray started: the actor is faked)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayTaskError

from pdserve.cluster.actors import RayHandle
from pdserve.worker_api import NeverFits, NoRoomNow, RequestFaultError


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
