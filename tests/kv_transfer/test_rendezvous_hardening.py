"""The KV rendezvous against hostile peers: it listens on its host only, malformed joins and
wrong secrets leave it serving, and a frame announcing more than the pool ends only that pair
(nothing allocated); the next peer transfers exactly and no reservation is left behind."""

from __future__ import annotations

import psutil
import pytest
import torch

from pdserve.kv_transfer import (
    ChannelConfig,
    TorchDistConnector,
    TransferEndpoint,
    TransferError,
    TransferKey,
)
from pdserve.kv_transfer.base import FrameKind
from pdserve.kv_transfer.framing import FrameHeader, encode_header
from pdserve.kv_transfer.rendezvous import JOIN_KEY, OpenJoin, SecretJoin
from pdserve.kv_transfer.torch_dist import TorchDistSender

TOKEN = "cluster-secret"
SESSION = b"0" * 32
IMPATIENT = ChannelConfig(peer_timeout_s=3.0, connect_timeout_s=1.0, heartbeat_s=0.2)


def _listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}




def test_join_policies_refuse_what_is_not_a_join():
    open_join = OpenJoin().verify(SESSION, b"3 prefill-0")
    assert (open_join.idx, open_join.peer_id) == (3, "prefill-0")
    secret = SecretJoin(TOKEN.encode())
    made = secret.make(SESSION, 3, "prefill-0")
    assert secret.verify(SESSION, made.message) == made
    for bad in (b"", b"x prefill", b"-1 p", b"0 p", b"1", b"1 p t", b"\xff\xfe p",
                b"1 " + b"p" * 200, b"9" * 600):
        with pytest.raises((ValueError, UnicodeDecodeError)):
            OpenJoin().verify(SESSION, bad)
        with pytest.raises((ValueError, UnicodeDecodeError)):
            secret.verify(SESSION, bad)


def test_store_listens_on_its_host_only(kv, no_thread_leak):
    endpoint = TransferEndpoint(kv.RecordingSink(kv.make_pool(1)), "127.0.0.1",
                                config=kv.FAST)
    try:
        port = int(endpoint.address.rsplit(":", 1)[1])
        assert _listening_addresses(port) == {"127.0.0.1"}
    finally:
        endpoint.close()
    with pytest.raises(ValueError, match="host"):
        TransferEndpoint(kv.RecordingSink(kv.make_pool(1)), "", config=kv.FAST)


def test_malformed_joins_and_wrong_secrets_leave_it_serving(kv, no_thread_leak):
    sink = kv.RecordingSink(kv.make_pool(1))
    endpoint = TransferEndpoint(sink, config=kv.FAST, join_token=TOKEN)
    stranger = TorchDistConnector("stranger", config=IMPATIENT, join_token="guess")
    anonymous = TorchDistConnector("anonymous", config=IMPATIENT)
    friend = TorchDistConnector("prefill-0", config=kv.FAST, join_token=TOKEN)
    try:
        raw = kv.store_client(endpoint.address)
        for junk in ("garbage", "abc prefill-x", "1 2 3 4", "99999 ghost " + TOKEN,
                     "\u00e9" * 300, ""):
            raw.queue_push(JOIN_KEY, junk)
        assert kv.wait_until(lambda: endpoint.num_bad_joins >= 5, 5)
        for connector in (stranger, anonymous):  # dropped unanswered: P gives up at its timeout
            error = connector.sender(endpoint.address).send_abort(TransferKey(1, 1)).exception(10)
            assert isinstance(error, TransferError) and "no answer" in str(error)
        assert endpoint.num_bad_joins == 8
        assert kv.transfer_works(endpoint, sink, friend, TransferKey(9, 1))
        assert endpoint.peer_ids == ["prefill-0"]
        assert sink.num_expected == 0
    finally:
        for connector in (stranger, anonymous, friend):
            connector.close()
        endpoint.close()


def test_oversized_frame_ends_its_pair_and_the_next_peer_is_served(kv, no_thread_leak):
    dst = kv.make_pool(2)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=kv.FAST)
    assert endpoint.max_payload_bytes == sink.max_payload_bytes  # the pool, not 16 GiB
    victim = TransferKey(4, 1)
    sink.expect(victim, [0, 1])  # a reservation the hostile peer aims at
    hostile = TorchDistSender(endpoint.address, "hostile", "127.0.0.1", torch.device("cpu"),
                              kv.FAST)
    friend = TorchDistConnector("prefill-1", config=kv.FAST)
    try:
        hostile.send_layers(victim, 0, 1, torch.zeros(16, dtype=torch.uint8),
                            num_blocks=2).result(10)  # a small honest-looking first frame
        assert sink.wait(lambda s: victim in s.failed, 10)  # wrong size for its reservation
        huge = FrameHeader(FrameKind.LAYERS, seq=2, key=victim, layer_start=0, layer_end=1,
                           arg=2, payload_nbytes=16 << 30)  # 16 GiB announced, never sent
        hostile._send_frame(encode_header(huge), None)
        assert sink.wait(lambda s: any(peer == "hostile" for peer, _ in s.lost), 10)
        assert kv.wait_until(lambda: endpoint.num_peers == 0, 5)
        assert kv.transfer_works(endpoint, sink, friend, TransferKey(5, 1), (2, 3))
        assert sink.num_expected == 0  # nothing left reserved
    finally:
        hostile.close(1.0)
        friend.close()
        endpoint.close()
