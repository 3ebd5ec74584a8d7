"""No secret shows in the repr of a config or spec object that holds one (what a log line, a
traceback or Ray's actor listing prints): API keys, the Redis password, the TLS private key,
the prefix-cache salt, the KV join token and the rendezvous keys derived from it, the key of
what the cluster writes to Redis."""

from __future__ import annotations

import pytest

from pdserve.cluster.actors import WorkerSpec
from pdserve.cluster.options import ClusterOptions
from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.router_actor import RouterSpec
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer.rendezvous import PairJoin
from pdserve.router.auth import TLSConfig
from pdserve.testing.certificates import make_test_certificates
from pdserve.workers.build import TorchTransfer

SECRETS = {"api": "api-SECRET-1", "admin": "admin-SECRET-2", "priority": "prio-SECRET-3",
           "redis": "redis-SECRET-4", "salt": "salt-SECRET-5", "join": "join-SECRET-6",
           "record": "record-SECRET-7"}
REDIS_URL = f"redis://:{SECRETS['redis']}@127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TLSConfig:
    certs = make_test_certificates(tmp_path_factory.mktemp("certs"))
    return TLSConfig.from_files(certs["server_cert"], certs["server_key"], certs["ca"])


def _key_body(tls: TLSConfig) -> list[str]:
    """The base64 lines of the private key's PEM."""
    return [line for line in tls.private_key.decode().splitlines()
            if line and not line.startswith("-----")]


def _objects(tls: TLSConfig) -> dict[str, object]:
    engine = EngineConfig(model="/models/m", prefix_cache_salt=SECRETS["salt"])
    return {
        "TLSConfig": tls,
        "EngineConfig": engine,
        "RouterSpec": RouterSpec(model="/models/m", redis_url=REDIS_URL, cluster="c",
                                 api_key=SECRETS["api"], admin_api_key=SECRETS["admin"],
                                 priority_api_keys=(SECRETS["priority"],), tls=tls,
                                 prefix_cache_salt=SECRETS["salt"],
                                 record_key=SECRETS["record"]),
        "WorkerSpec": WorkerSpec(worker_id="w1", role="decode", config=engine,
                                 redis_url=REDIS_URL, cluster="c", join_token=SECRETS["join"],
                                 record_key=SECRETS["record"]),
        "RecordAuth": RecordAuth(SECRETS["record"]),
        "ClusterOptions": ClusterOptions(model="/models/m", api_key=SECRETS["api"],
                                         admin_api_key=SECRETS["admin"],
                                         priority_api_keys=(SECRETS["priority"],),
                                         redis_url=REDIS_URL, redis_password=SECRETS["redis"]),
        "TorchTransfer": TorchTransfer(join_token=SECRETS["join"]),
        "PairJoin": PairJoin(0, "p1", b"0 p1", accept_key="a/0", accepted=b"1", refused=b"0",
                             pair_prefix="pair/0/", store_key=SECRETS["join"].encode(),
                             decode_proof=SECRETS["salt"].encode(),
                             prefill_proof=SECRETS["api"].encode()),
    }


def test_no_secret_in_any_repr(tls):
    leaks = {}
    for name, obj in _objects(tls).items():
        text = repr(obj)
        found = [s for s in (*SECRETS.values(), *_key_body(tls)) if s in text]
        if found:
            leaks[name] = found
    assert not leaks
    assert "cert_chain" in repr(tls) and "private_key" not in repr(tls)  # the rest still shows


def test_the_secrets_are_still_there(tls):
    """Hidden from the repr, not dropped: what uses them still reads them."""
    objects = _objects(tls)
    assert objects["RouterSpec"].tls.private_key == tls.private_key
    assert objects["WorkerSpec"].config.prefix_cache_salt == SECRETS["salt"]
    assert objects["WorkerSpec"].record_key == objects["RouterSpec"].record_key
    assert objects["PairJoin"].store_key == SECRETS["join"].encode()
