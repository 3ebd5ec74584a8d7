"""API key and TLS on the gRPC front door (FakeBackend over real loopback gRPC): Generation,
Admin and reflection need the key, health stays open; TLS round trip; mutual TLS refuses a
client without a certificate or with one the server's CA did not sign."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pdserve.api.admin_client import AdminClient
from pdserve.api.client import AsyncPdserveClient, ClientTLS, PdserveClient, PdserveError
from pdserve.router.auth import ApiKey, TLSConfig
from pdserve.router.fake_admin import FakeAdmin
from pdserve.router.fake_backend import FakeBackend
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing import make_test_certificates

KEY = "test-key-123"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


@contextlib.contextmanager
def serving(**kwargs):
    """A GenerationServer on its own loop in a thread; yields its port."""
    import threading

    loop = asyncio.new_event_loop()
    ready: dict = {}
    server = GenerationServer(FakeBackend(), health_poll_interval_s=0.02,
                              admin=FakeAdmin([], {"decode": 1}), **kwargs)

    def main():
        asyncio.set_event_loop(loop)
        ready["port"] = loop.run_until_complete(server.start("127.0.0.1", 0))
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    for _ in range(500):
        if "port" in ready:
            break
        thread.join(0.01)
    try:
        yield ready["port"]
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_api_key_compare():
    key = ApiKey(KEY)
    assert key.allows(f"Bearer {KEY}") and key.allows(f"bearer {KEY}".encode())
    for wrong in (None, "", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ", "Basic x"):
        assert not key.allows(wrong)
    with pytest.raises(ValueError):
        ApiKey("")


def test_grpc_needs_the_key_except_health():
    with serving(api_key=KEY) as port:
        target = f"127.0.0.1:{port}"
        with PdserveClient(target, timeout=5) as anonymous:
            assert anonymous.health() == "SERVING"  # open for probes
            for call in (lambda: anonymous.generate([1, 2], max_tokens=2),
                         lambda: anonymous.tokenize("AB"), anonymous.model_info):
                with pytest.raises(PdserveError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with PdserveClient(target, timeout=5, api_key="wrong") as wrong:
            with pytest.raises(PdserveError) as err:
                wrong.generate([1, 2], max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with AdminClient(target, timeout=5) as admin:
            with pytest.raises(PdserveError) as err:
                admin.get_pools()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with AdminClient(target, timeout=5, api_key=KEY) as admin:
            assert admin.get_pools() is not None
        with PdserveClient(target, timeout=5, api_key=KEY) as client:
            assert client.generate([1, 2], max_tokens=3).token_ids == [3, 4, 5]

        async def reflect_and_stream():
            from grpc_reflection.v1alpha import reflection_pb2_grpc

            async with grpc.aio.insecure_channel(target) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                # No request is sent: writing into a call the server already refused can end
                # in INTERNAL instead (a race in the client), whatever the server said.
                call = stub.ServerReflectionInfo(iter([]))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with AsyncPdserveClient(target, timeout=5, api_key=KEY) as client:
                return (await client.generate([4], max_tokens=2)).token_ids

        assert asyncio.run(reflect_and_stream()) == [5, 6]


def test_reflection_can_be_turned_off():
    with serving(reflection=False, max_concurrent_rpcs=4) as port:

        async def main():
            from grpc_reflection.v1alpha import reflection_pb2_grpc

            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                # No request is sent: writing into a call the server already refused can end
                # in INTERNAL instead (a race in the client), whatever the server said.
                call = stub.ServerReflectionInfo(iter([]))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

        asyncio.run(main())


def test_tls_round_trip_and_mutual_tls(certs):
    tls = TLSConfig.from_files(certs["server_cert"], certs["server_key"])
    with serving(tls=tls, api_key=KEY) as port:
        target = f"127.0.0.1:{port}"
        trusted = ClientTLS.from_files(ca=certs["ca"])
        with PdserveClient(target, timeout=5, api_key=KEY, tls=trusted) as client:
            assert client.generate([1], max_tokens=2).token_ids == [2, 3]
        with PdserveClient(target, timeout=3, api_key=KEY) as plaintext:
            with pytest.raises(PdserveError) as err:
                plaintext.generate([1], max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
    mutual = TLSConfig.from_files(certs["server_cert"], certs["server_key"], certs["ca"])
    with serving(tls=mutual) as port:
        target = f"127.0.0.1:{port}"
        good = ClientTLS.from_files(certs["ca"], certs["client_cert"], certs["client_key"])
        with PdserveClient(target, timeout=5, tls=good) as client:
            assert client.generate([1], max_tokens=1).token_ids == [2]
        for tls_client in (ClientTLS.from_files(certs["ca"]),
                           ClientTLS.from_files(certs["ca"], certs["stranger_cert"],
                                                certs["stranger_key"])):
            with PdserveClient(target, timeout=3, tls=tls_client) as client:
                with pytest.raises(PdserveError) as err:
                    client.generate([1], max_tokens=1)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_config_checks(certs, tmp_path):
    assert TLSConfig.from_files(None, None) is None
    with pytest.raises(ValueError, match="together"):
        TLSConfig.from_files(certs["server_cert"], None)
    with pytest.raises(ValueError, match="tls_client_ca needs"):
        TLSConfig.from_files(None, None, certs["ca"])
    with pytest.raises(ValueError, match="tls_key: cannot read"):
        TLSConfig.from_files(certs["server_cert"], tmp_path / "missing.key")
    with pytest.raises(ValueError, match="tls_key must be a PEM private key"):
        TLSConfig.from_files(certs["server_cert"], certs["server_cert"])
