"""A router without the pool manager answers Admin by asking the first router
(:class:`ForwardingAdmin`); here the first router is unreachable or answers with an error (the
e2e router tests forward to a real one)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from pdserve.cluster.admin import ForwardingAdmin
from pdserve.router.adapters import ServedAdapters
from pdserve.router.admin_server import (
    AdminUnavailableError,
    LoraDisabledError,
    UnknownAdapterError,
    UnknownWorkerError,
)
from pdserve.worker_api.adapters import AdapterRef


class _Ref:
    def __init__(self, outcome):
        self._future = Future()
        if isinstance(outcome, BaseException):
            self._future.set_exception(outcome)
        elif outcome is not None:
            self._future.set_result(outcome)

    def future(self) -> Future:
        return self._future


class _Handle:
    """Stands in for the first router's actor handle: answers each call with ``outcome``
    (a value, an exception, or None: never answers)."""

    def __init__(self, outcome):
        self.calls: list[tuple] = []
        handle = self

        class _Method:
            @staticmethod
            def remote(method, *args):
                handle.calls.append((method, *args))
                return _Ref(outcome)

        self.admin_call = _Method()


def test_an_unreachable_first_router_is_unavailable_and_looked_up_again():
    lookups = []

    def lookup():
        lookups.append(1)
        raise ValueError("Failed to look up actor with name 'router'")

    admin = ForwardingAdmin(lookup)
    for _ in range(2):
        with pytest.raises(AdminUnavailableError, match="did not answer.*try again"):
            asyncio.run(admin.get_pools())
    assert len(lookups) == 2  # a failed lookup is not cached


def test_a_first_router_that_does_not_answer_times_out_as_unavailable():
    handle = _Handle(None)
    admin = ForwardingAdmin(lambda: handle, timeout_s=0.2)
    with pytest.raises(AdminUnavailableError, match="TimeoutError"):
        asyncio.run(admin.list_workers())
    assert handle.calls == [("list_workers",)]


def test_the_first_routers_errors_come_back_as_raised():
    admin = ForwardingAdmin(lambda: _Handle(UnknownWorkerError("unknown worker 'x'")))
    with pytest.raises(UnknownWorkerError, match="unknown worker 'x'"):
        asyncio.run(admin.drain_worker("x"))
    handle = _Handle(["pool"])
    assert asyncio.run(ForwardingAdmin(lambda: handle).set_pool_target("decode", 3)) == ["pool"]
    assert handle.calls == [("set_pool_target", "decode", 3)]


def test_traces_are_the_routers_own():
    traces = [type("T", (), {"request_id": f"r{i}"})() for i in range(5)]
    admin = ForwardingAdmin(lambda: pytest.fail("traces must not be forwarded"),
                            traces=lambda: traces)
    assert [t.request_id for t in asyncio.run(admin.traces([], 2))] == ["r3", "r4"]
    assert [t.request_id for t in asyncio.run(admin.traces(["r1"], 10))] == ["r1"]


def test_over_grpc_an_unreachable_first_router_is_unavailable_naming_it():
    import grpc

    from pdserve.api import admin_pb2, admin_pb2_grpc
    from pdserve.router.grpc_server import GenerationServer
    from pdserve.testing.fake_backend import FakeBackend

    def lookup():
        raise ValueError("Failed to look up actor with name 'router'")

    async def main():
        server = GenerationServer(FakeBackend(), admin=ForwardingAdmin(lookup))
        port = await server.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await admin_pb2_grpc.AdminStub(channel).GetPools(admin_pb2.GetPoolsRequest())
                return err.value
        finally:
            await server.stop(0)

    error = asyncio.run(asyncio.wait_for(main(), 30))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "the router that runs the pools (the first, 'router') did not answer" \
        in error.details()


def test_adapter_loads_are_forwarded_and_served_here_at_once():
    sql = AdapterRef("sql", "/adapters/sql", "d" * 64)
    served = ServedAdapters()
    handle = _Handle(sql)
    admin = ForwardingAdmin(lambda: handle, served=served)
    assert asyncio.run(admin.load_lora_adapter("sql", "/adapters/sql")) == sql
    assert served.get("sql") == sql  # before this router's mirror reads Redis again
    assert asyncio.run(admin.unload_lora_adapter("sql")) == sql
    assert served.get("sql") is None
    assert handle.calls == [("load_lora_adapter", "sql", "/adapters/sql"),
                            ("unload_lora_adapter", "sql")]
    for refusal in (UnknownAdapterError("LoRA adapter 'x' is not loaded"),
                    LoraDisabledError("start it with --enable-lora"),
                    ValueError("LoRA adapter 'x': rank 32 above max_lora_rank")):
        refusing = ForwardingAdmin(lambda r=refusal: _Handle(r), served=served)
        with pytest.raises(type(refusal), match=str(refusal)[:20]):
            asyncio.run(refusing.load_lora_adapter("x", "/p"))
    assert len(served) == 0
