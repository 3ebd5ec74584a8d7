"""LoRA adapters at the front doors, over real loopback HTTP and gRPC against the FakeBackend
and a fake admin backend: a request's ``model`` resolved to the adapter it names (and that
adapter on the PreparedRequest), 404 / NOT_FOUND for another name, ``/v1/models`` in vLLM's
shape, the load / unload endpoints and RPCs with their refusals, and the admin key on them;
chat names its adapter as completions do."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from pdserve.api import admin_pb2, admin_pb2_grpc, generation_pb2_grpc
from pdserve.api import generation_pb2 as pb
from pdserve.router.adapters import ServedAdapters
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.http_server import HttpServer
from pdserve.testing.fake_admin import FakeAdmin
from pdserve.testing.fake_backend import FakeBackend, FakePromptTools
from pdserve.worker_api.adapters import AdapterRef

API_KEY = "lora-api-key"
ADMIN_KEY = "lora-admin-key"
SQL = AdapterRef("sql", "/adapters/sql", "a" * 64)


@pytest.fixture
def served():
    return ServedAdapters([SQL])


async def _doors(backend, served, admin_key=ADMIN_KEY, api_key=API_KEY, enabled=True):
    admin = FakeAdmin([], {}, served, enabled)
    grpc_server = GenerationServer(backend, health_poll_interval_s=0.02, admin=admin,
                                   api_key=api_key, admin_api_key=admin_key, adapters=served)
    grpc_port = await grpc_server.start("127.0.0.1", 0)
    http = HttpServer(backend, model_root="/models/fake", api_key=api_key, adapters=served,
                      admin=admin, admin_api_key=admin_key, tools=FakePromptTools(backend))
    await http.start("127.0.0.1", 0)
    return grpc_server, grpc_port, http


def _auth(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def test_http_model_names_the_adapter(served):
    async def main():
        backend = FakeBackend()
        grpc_server, _port, http = await _doors(backend, served)
        base = backend.model_info().model_name
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}",
                                         headers=_auth(API_KEY), timeout=30) as client:
                for model, adapter in ((base, None), ("sql", SQL), ("/models/fake", None)):
                    reply = await client.post("/v1/completions", json={
                        "model": model, "prompt": [5, 6, 7], "max_tokens": 3})
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["model"] == (adapter.name if adapter else base)
                    assert backend.started[-1].adapter == adapter
                reply = await client.post("/v1/completions", json={
                    "model": "sql", "prompt": [5, 6], "max_tokens": 2, "stream": True})
                assert '"model":"sql"' in reply.text
                reply = await client.post("/v1/chat/completions", json={
                    "model": "sql", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2})
                assert reply.status_code == 200 and reply.json()["model"] == "sql", reply.text
                assert backend.started[-1].adapter == SQL
                reply = await client.post("/v1/completions", json={
                    "model": "nope", "prompt": [5], "max_tokens": 2})
                error = reply.json()["error"]
                assert reply.status_code == 404
                assert (error["param"], error["code"]) == ("model", "model_not_found")
                assert "'nope' does not exist" in error["message"] and "'sql'" in error["message"]
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] == [base, "sql"]
                assert models[0]["parent"] is None and models[0]["root"] == base
                assert (models[1]["parent"], models[1]["root"]) == (base, "/adapters/sql")
        finally:
            await http.stop(0)
            await grpc_server.stop(0)

    asyncio.run(main())


def test_grpc_model_field(served):
    async def main():
        backend = FakeBackend()
        grpc_server, port, http = await _doors(backend, served)
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for model, adapter in (("", None), (backend.model_info().model_name, None),
                                       ("sql", SQL)):
                    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), model=model)
                    request.sampling.max_tokens = 2
                    [r async for r in stub.Generate(request, metadata=metadata)]
                    assert backend.started[-1].adapter == adapter
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), model="x" * 300)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in stub.Generate(request, metadata=metadata)]
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert info.value.details().startswith("model: the model 'xxx")
                reply = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
                assert list(reply.lora_adapters) == ["sql"]
        finally:
            await http.stop(0)
            await grpc_server.stop(0)

    asyncio.run(main())


def test_http_load_and_unload_behind_the_admin_key(served):
    async def main():
        backend = FakeBackend()
        grpc_server, _port, http = await _doors(backend, served)
        url = f"http://127.0.0.1:{http.port}"
        body = {"lora_name": "chat", "lora_path": "/adapters/chat"}
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for key, status in ((None, 401), ("wrong", 401), (API_KEY, 403)):
                    reply = await client.post("/v1/load_lora_adapter", json=body,
                                              headers=_auth(key))
                    assert reply.status_code == status, reply.text
                    assert "error" in reply.json() and served.get("chat") is None
                admin = _auth(ADMIN_KEY)
                reply = await client.post("/v1/load_lora_adapter", json=body, headers=admin)
                assert reply.status_code == 200
                assert reply.text == "Success: LoRA adapter 'chat' added successfully."
                assert served.get("chat").path == "/adapters/chat"
                for bad, status, says in (
                        (body, 400, "already loaded"),
                        ({"lora_name": "x", "lora_path": "/tmp/x"}, 400, "not a folder"),
                        ({"lora_name": "", "lora_path": "/adapters/x"}, 400, "lora_name"),
                        ({"lora_path": "/adapters/x"}, 400, "lora_name")):
                    reply = await client.post("/v1/load_lora_adapter", json=bad, headers=admin)
                    assert reply.status_code == status and says in reply.text, reply.text
                    assert reply.json()["error"]["param"] == "lora_name"
                assert [a.name for a in served.all()] == ["chat", "sql"]
                reply = await client.post("/v1/unload_lora_adapter",
                                          json={"lora_name": "chat"}, headers=_auth(API_KEY))
                assert reply.status_code == 403 and served.get("chat") is not None
                reply = await client.post("/v1/unload_lora_adapter",
                                          json={"lora_name": "chat"}, headers=admin)
                assert reply.text == "Success: LoRA adapter 'chat' removed successfully."
                reply = await client.post("/v1/unload_lora_adapter",
                                          json={"lora_name": "chat"}, headers=admin)
                assert reply.status_code == 404
                assert reply.json()["error"]["code"] == "model_not_found"
                reply = await client.post("/v1/completions", headers=_auth(API_KEY), json={
                    "model": "chat", "prompt": [5], "max_tokens": 2})
                assert reply.status_code == 404
        finally:
            await http.stop(0)
            await grpc_server.stop(0)

    asyncio.run(main())


def test_without_an_admin_key_loopback_callers_load(served):
    async def main():
        grpc_server, _port, http = await _doors(FakeBackend(), served, admin_key=None,
                                                api_key=None, enabled=False)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}",
                                         timeout=30) as client:
                reply = await client.post("/v1/load_lora_adapter", json={
                    "lora_name": "chat", "lora_path": "/adapters/chat"})
                assert reply.status_code == 400 and "--enable-lora" in reply.text
        finally:
            await http.stop(0)
            await grpc_server.stop(0)

    asyncio.run(main())


def test_grpc_admin_lora_calls(served):
    async def main():
        grpc_server, port, http = await _doors(FakeBackend(), served)
        admin_md = (("authorization", f"Bearer {ADMIN_KEY}"),)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = admin_pb2_grpc.AdminStub(channel)
                load = admin_pb2.LoadLoraAdapterRequest(lora_name="chat",
                                                        lora_path="/adapters/chat")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.LoadLoraAdapter(load, metadata=(
                        ("authorization", f"Bearer {API_KEY}"),))
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                reply = await stub.LoadLoraAdapter(load, metadata=admin_md)
                assert (reply.name, reply.path) == ("chat", "/adapters/chat")
                listed = await stub.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest(),
                                                     metadata=admin_md)
                assert [a.name for a in listed.adapters] == ["chat", "sql"]
                for request, code in (
                        (load, grpc.StatusCode.INVALID_ARGUMENT),  # already loaded
                        (admin_pb2.LoadLoraAdapterRequest(lora_name="y" * 257, lora_path="/p"),
                         grpc.StatusCode.INVALID_ARGUMENT),
                        (admin_pb2.LoadLoraAdapterRequest(lora_name="z"),
                         grpc.StatusCode.INVALID_ARGUMENT)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.LoadLoraAdapter(request, metadata=admin_md)
                    assert info.value.code() == code
                unload = admin_pb2.UnloadLoraAdapterRequest(lora_name="chat")
                assert (await stub.UnloadLoraAdapter(unload, metadata=admin_md)).name == "chat"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.UnloadLoraAdapter(unload, metadata=admin_md)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await http.stop(0)
            await grpc_server.stop(0)

    asyncio.run(main())
