"""Keys, roles and TLS on the gRPC front door (FakeBackend over real gRPC): Generation and
reflection need an inference key, health stays open; Admin needs the admin key and refuses
inference keys, and without an admin key answers loopback callers only; priority < 0 needs a
priority key (none of this gates a server without keys); TLS round trip; mutual TLS refuses a
client without a certificate or with one the server's CA did not sign."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import psutil
import pytest

from pdserve.api.admin_client import AdminClient
from pdserve.api.client import AsyncPdserveClient, ClientTLS, PdserveClient, PdserveError
from pdserve.router.auth import Access, ApiKey, TLSConfig, is_loopback_peer, keys_from_file
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.certificates import make_test_certificates
from pdserve.testing.fake_admin import FakeAdmin
from pdserve.testing.fake_backend import FakeBackend

KEY = "test-key-123"
ADMIN = "admin-key-456"
PRIORITY = "priority-key-789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


@contextlib.contextmanager
def serving(host: str = "127.0.0.1", backend: FakeBackend | None = None, **kwargs):
    """A GenerationServer on ``host`` on its own loop in a thread; yields its port."""
    import threading

    loop = asyncio.new_event_loop()
    ready: dict = {}
    server = GenerationServer(backend or FakeBackend(), health_poll_interval_s=0.02,
                              admin=FakeAdmin([], {"decode": 1}), **kwargs)

    def main():
        asyncio.set_event_loop(loop)
        ready["port"] = loop.run_until_complete(server.start(host, 0))
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


def _code(call) -> grpc.StatusCode:
    with pytest.raises(PdserveError) as err:
        call()
    return err.value.code


def test_admin_needs_the_admin_key_and_refuses_inference_keys():
    with serving(api_key=KEY, admin_api_key=ADMIN, priority_api_keys=(PRIORITY,)) as port:
        target = f"127.0.0.1:{port}"
        with AdminClient(target, timeout=5) as anonymous:  # loopback is no credential now
            assert _code(anonymous.get_pools) == grpc.StatusCode.UNAUTHENTICATED
        for inference_key in (KEY, PRIORITY):
            with AdminClient(target, timeout=5, api_key=inference_key) as admin:
                for call in (admin.get_pools, lambda a=admin: a.drain_worker("decode-0"),
                             lambda a=admin: a.set_pool_target("decode", 1_000_000)):
                    assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
        with AdminClient(target, timeout=5, api_key=ADMIN) as admin:
            assert admin.set_pool_target("decode", 2).target == 2
            assert {p.role for p in admin.get_pools()} == {"decode"}
        with PdserveClient(target, timeout=5, api_key=ADMIN) as client:  # no inference key
            assert _code(lambda: client.generate([1], max_tokens=1)) == \
                grpc.StatusCode.UNAUTHENTICATED


def _non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def test_admin_without_an_admin_key_answers_loopback_callers_only():
    assert is_loopback_peer("ipv4:127.0.0.1:5000") and is_loopback_peer("ipv6:[::1]:5000")
    assert is_loopback_peer("ipv6:%5B::1%5D:5000") and is_loopback_peer("unix:/tmp/s")
    assert is_loopback_peer("ipv6:[::ffff:127.0.0.1]:5000")
    for remote in ("ipv4:10.0.0.7:5000", "ipv6:[fd00::2]:5000", "ipv4:not-an-ip:1", ""):
        assert not is_loopback_peer(remote)
    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    with serving(host="0.0.0.0", api_key=KEY) as port:
        with AdminClient(f"127.0.0.1:{port}", timeout=5) as local:
            assert local.get_pools() is not None  # the operator on the router's machine
        for key in (None, KEY):
            with AdminClient(f"{host}:{port}", timeout=5, api_key=key) as remote:
                with pytest.raises(PdserveError) as err:
                    remote.set_pool_target("decode", 3)
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert "--admin-api-key-file" in err.value.details
        with PdserveClient(f"{host}:{port}", timeout=5, api_key=KEY) as client:
            assert client.generate([1], max_tokens=1).token_ids == [2]  # inference is remote


def test_priority_above_the_default_needs_a_priority_key():
    with serving(api_key=KEY, priority_api_keys=(PRIORITY,)) as port:
        target = f"127.0.0.1:{port}"
        with PdserveClient(target, timeout=5, api_key=KEY) as client:
            with pytest.raises(PdserveError) as err:
                client.generate([1], max_tokens=1, priority=-1)
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert err.value.details.startswith("priority:")
            assert client.generate([1], max_tokens=1, priority=3).token_ids == [2]
            assert client.generate([1], max_tokens=1, priority=0).token_ids == [2]
        with PdserveClient(target, timeout=5, api_key=PRIORITY) as client:
            assert client.generate([1], max_tokens=1, priority=-5).token_ids == [2]
    with serving() as port:  # no key at all: no tenants, nothing gated
        with PdserveClient(f"127.0.0.1:{port}", timeout=5) as client:
            assert client.generate([1], max_tokens=1, priority=-5).token_ids == [2]


def test_the_tenant_is_the_key_s_and_a_client_cannot_claim_another_key_s():
    backend = FakeBackend()
    with serving(backend=backend, api_key=KEY, priority_api_keys=(PRIORITY,)) as port:
        def tenant(key: str, claimed: str) -> str | None:
            with PdserveClient(f"127.0.0.1:{port}", timeout=5, api_key=key) as client:
                client.generate([1], max_tokens=1, tenant=claimed)
            return backend.tenants[-1]

        priority_tenant = tenant(PRIORITY, "")
        key_tenant = tenant(KEY, priority_tenant)  # claims the other key's share: ignored
        assert priority_tenant is not None and key_tenant not in (None, priority_tenant)
        assert tenant(KEY, "someone-else") == key_tenant
        assert tenant(KEY, "x" * 500) == key_tenant  # ignored, not even checked
        assert KEY not in key_tenant and PRIORITY not in priority_tenant  # never the key
    backend = FakeBackend()
    with serving(backend=backend) as port:  # no keys: the client names it, bounded
        with PdserveClient(f"127.0.0.1:{port}", timeout=5) as client:
            client.generate([1], max_tokens=1, tenant="team-a")
            client.generate([1], max_tokens=1)
            assert _code(lambda: client.generate([1], max_tokens=1, tenant="x" * 500)) \
                == grpc.StatusCode.INVALID_ARGUMENT
        assert backend.tenants == ["team-a", None]


def test_access_keys_are_separate_and_key_files_are_checked(tmp_path):
    with pytest.raises(ValueError, match="admin_api_key must differ"):
        Access((KEY,), admin_key=KEY)
    with pytest.raises(ValueError, match="admin_api_key must differ"):
        Access((KEY,), admin_key=PRIORITY, priority_keys=(PRIORITY,))
    access = Access((KEY,), ADMIN, (PRIORITY,))
    assert access.inference_caller(f"Bearer {KEY}").may_prioritize is False
    assert access.inference_caller(f"Bearer {PRIORITY}").may_prioritize is True
    assert access.inference_caller(f"Bearer {ADMIN}") is None
    assert access.metrics_allowed(f"Bearer {ADMIN}") and not access.metrics_allowed(KEY)
    assert Access().inference_caller(None).may_prioritize and Access().metrics_allowed(None)
    keys = tmp_path / "keys"
    keys.write_text(f"# priority clients\n{KEY}\n\n  {PRIORITY}  \n")
    assert keys_from_file(keys, "priority_api_key_file") == (KEY, PRIORITY)
    for text, match in (("", "holds no key"), ("a b\n", "line 1 .* holds whitespace")):
        keys.write_text(text)
        with pytest.raises(ValueError, match=match) as err:
            keys_from_file(keys, "priority_api_key_file")
        assert "a b" not in str(err.value)  # never the key itself
    with pytest.raises(ValueError, match="priority_api_key_file: cannot read"):
        keys_from_file(tmp_path / "missing", "priority_api_key_file")
