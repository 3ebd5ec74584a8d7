"""pdserve.v1.Admin over real loopback gRPC, against the in-memory FakeAdmin backend, served
on the same port as Generation."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.api import admin_pb2, admin_pb2_grpc
from pdserve.router.admin_server import MAX_NAME_CHARS, MAX_TRACE_IDS, MAX_TRACE_LIMIT, WorkerInfo
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.metrics import RouterMetrics
from pdserve.testing.fake_admin import FakeAdmin
from pdserve.testing.fake_backend import FakeBackend

WORKERS = [
    WorkerInfo("prefill-0", "prefill", "ready", "127.0.0.1", 101, 1, 2, 3, 64, 0.25),
    WorkerInfo("decode-0", "decode", "ready", "127.0.0.1", 102, 4, 0, 10, 128, 0.5),
    WorkerInfo("decode-2", "decode", "starting", restarts=1),
    WorkerInfo("decode-1", "decode", "dead", "127.0.0.1", 103, error="actor died"),
]


@contextlib.asynccontextmanager
async def serving(admin=None, metrics=None):
    admin = admin if admin is not None else FakeAdmin(WORKERS, {"prefill": 1, "decode": 2})
    server = GenerationServer(FakeBackend(), health_poll_interval_s=0.02, admin=admin,
                              metrics=metrics)
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield admin_pb2_grpc.AdminStub(channel), admin, channel
    finally:
        await channel.close()
        await server.stop(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_list_workers_and_pools():
    async def main():
        async with serving() as (stub, _admin, _channel):
            workers = (await stub.ListWorkers(admin_pb2.ListWorkersRequest())).workers
            pools = (await stub.GetPools(admin_pb2.GetPoolsRequest())).pools
            return workers, pools

    workers, pools = run(main())
    by_id = {w.worker_id: w for w in workers}
    assert set(by_id) == {"prefill-0", "decode-0", "decode-1", "decode-2"}
    d0 = by_id["decode-0"]
    assert (d0.role, d0.pid, d0.node, d0.running, d0.kv_used_blocks, d0.kv_total_blocks) == \
        ("decode", 102, "127.0.0.1", 4, 10, 128)
    assert d0.state == admin_pb2.WORKER_STATE_READY and d0.heartbeat_age_s == 0.5
    assert by_id["decode-2"].state == admin_pb2.WORKER_STATE_STARTING
    assert not by_id["decode-2"].HasField("heartbeat_age_s")
    assert by_id["decode-1"].state == admin_pb2.WORKER_STATE_DEAD
    assert by_id["decode-1"].error == "actor died"
    decode = next(p for p in pools if p.role == "decode")
    assert (decode.target, decode.actual, decode.ready, decode.starting) == (2, 2, 1, 1)


def test_drain_lowers_the_target_once_and_names_unknown_or_dead_workers():
    async def main():
        async with serving() as (stub, admin, _channel):
            first = await stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id="decode-0"))
            again = await stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id="decode-0"))
            errors = []
            for worker_id in ("decode-9", "decode-1", ""):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id=worker_id))
                errors.append((err.value.code(), err.value.details()))
            return first, again, errors, admin

    first, again, errors, admin = run(main())
    assert first.state == again.state == admin_pb2.WORKER_STATE_DRAINING
    assert admin.targets["decode"] == 1 and admin.drained == ["decode-0"]
    assert errors[0] == (grpc.StatusCode.NOT_FOUND, "unknown worker 'decode-9'")
    assert errors[1][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert errors[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in errors[2][1]


def test_set_pool_target_validates_role_and_size():
    async def main():
        async with serving() as (stub, _admin, _channel):
            pool = await stub.SetPoolTarget(admin_pb2.SetPoolTargetRequest(role="decode",
                                                                          size=5))
            codes = []
            for role, size in (("decoder", 1), ("decode", -1)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SetPoolTarget(admin_pb2.SetPoolTargetRequest(role=role,
                                                                            size=size))
                codes.append((err.value.code(), err.value.details()))
            return pool, codes

    pool, codes = run(main())
    assert pool.role == "decode" and pool.target == 5
    assert codes[0][0] == codes[1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in codes[0][1] and "size" in codes[1][1]


class TracingAdmin(FakeAdmin):
    """FakeAdmin that keeps no traces but records what it was asked."""

    def __init__(self):
        super().__init__(WORKERS, {"decode": 1})
        self.asked: list = []

    async def traces(self, request_ids, limit):
        self.asked.append((len(request_ids), limit))
        return []

    async def drain_worker(self, worker_id):
        self.asked.append(worker_id)
        return await super().drain_worker(worker_id)


def test_admin_inputs_are_bounded_before_the_backend():
    long = "d" * (MAX_NAME_CHARS + 1)
    calls = [("worker_id", "DrainWorker", admin_pb2.DrainWorkerRequest(worker_id=long * 1000)),
             ("role", "SetPoolTarget", admin_pb2.SetPoolTargetRequest(role=long, size=1)),
             ("limit", "GetTraces", admin_pb2.GetTracesRequest(limit=MAX_TRACE_LIMIT + 1)),
             ("request_ids", "GetTraces",
              admin_pb2.GetTracesRequest(request_ids=["r"] * (MAX_TRACE_IDS + 1)))]

    async def main():
        admin = TracingAdmin()
        async with serving(admin) as (stub, _admin, _channel):
            errors = []
            for _field, method, request in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await getattr(stub, method)(request)
                errors.append(err.value)
            await stub.GetTraces(admin_pb2.GetTracesRequest(limit=MAX_TRACE_LIMIT))
            return errors, admin.asked

    errors, asked = run(main())
    for (field, _method, _request), error in zip(calls, errors, strict=True):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.details())
        assert error.details().startswith(field) and len(error.details()) < 200
    assert asked == [(0, MAX_TRACE_LIMIT)]  # nothing out of bounds reached the backend


def test_a_backend_bug_is_internal_without_its_message():
    class Broken(FakeAdmin):
        async def get_pools(self):
            raise RuntimeError("secret detail")

    async def main():
        async with serving(Broken([], {})) as (stub, _admin, _channel):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetPools(admin_pb2.GetPoolsRequest())
            return err.value

    err = run(main())
    assert err.code() == grpc.StatusCode.INTERNAL and "secret" not in err.details()


def test_reflection_lists_admin_beside_generation():
    async def main():
        async with serving() as (_stub, _admin, channel):
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in stub.ServerReflectionInfo(iter([request]))]
            return {s.name for s in replies[0].list_services_response.service}

    assert {"pdserve.v1.Generation", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= run(main())


def test_failed_generate_calls_are_counted_by_code():
    from pdserve.api import generation_pb2 as pb
    from pdserve.api import generation_pb2_grpc

    metrics = RouterMetrics()

    async def main():
        async with serving(metrics=metrics) as (_stub, _admin, channel):
            gen = generation_pb2_grpc.GenerationStub(channel)
            bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _chunk in gen.Generate(bad):
                        pass

    run(main())
    value = metrics.registry.get_sample_value("pdserve_requests_failed_total",
                                              {"code": "INVALID_ARGUMENT"})
    assert value == 2
