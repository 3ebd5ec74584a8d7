"""Real gloo pairs on loopback: exact block transfer, keyed interleaving, fencing, many pairs,
lazy and bounded channels, heartbeats, refusal, and peer death (thread and a second process)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pdserve.kv_transfer import (
    ChannelConfig,
    TorchDistConnector,
    TransferEndpoint,
    TransferError,
    TransferKey,
    measure_channel,
    measure_memcpy,
    measure_transfer,
)

CHILD = Path(__file__).with_name("prefill_child.py")


@pytest.fixture
def pair(kv, no_thread_leak):
    """One D endpoint (recording sink over a random pool) and one P connector."""
    dst = kv.make_pool(20)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=kv.FAST)
    connector = TorchDistConnector("prefill-a", config=kv.FAST)
    yield kv.make_pool(10), dst, sink, endpoint, connector
    connector.close()
    endpoint.close()


def test_request_blocks_arrive_exactly(kv, pair):
    src, dst, sink, endpoint, connector = pair
    before = kv.snapshot(dst)
    src_ids, dst_ids = [3, 0, 7, 12], [1, 14, 6, 9]
    key = TransferKey(2**40 + 5, 7)
    sink.expect(key, dst_ids)
    sender = connector.sender(endpoint.address)
    futures = kv.send_request(sender, key, src, src_ids, first_token=31999, layers_per_frame=3)
    assert sink.wait(lambda s: key in s.completed, 10)
    assert sink.completed[key] == 31999
    assert kv.blocks_equal(src, src_ids, dst, dst_ids)
    assert kv.untouched(dst, before, [b for b in range(kv.NUM_BLOCKS) if b not in dst_ids])
    assert [f.result(5) for f in futures[:2]] == [3 * 4 * 512, 1 * 4 * 512]


def test_interleaved_requests_are_keyed_not_fifo(kv, pair):
    src, dst, sink, endpoint, connector = pair
    a, b = TransferKey(1, 1), TransferKey(2, 1)
    sink.expect(a, [0, 1])
    sink.expect(b, [2, 3])
    sender = connector.sender(endpoint.address)
    from pdserve.kv_transfer import pack_layers

    for layer in range(kv.NUM_LAYERS):
        for key, ids in ((b, [5, 6]), (a, [8, 9])):
            sender.send_layers(key, layer, layer + 1,
                               pack_layers(src, torch.tensor(ids), layer, layer + 1))
        if layer == kv.NUM_LAYERS - 1:
            sender.send_commit(a, 1)  # a finishes first although b started first
            sender.send_commit(b, 2)
    assert sink.wait(lambda s: len(s.completed) == 2, 10)
    assert sink.completed == {a: 1, b: 2}
    assert kv.blocks_equal(src, [8, 9], dst, [0, 1])
    assert kv.blocks_equal(src, [5, 6], dst, [2, 3])


def test_stale_epoch_is_drained_and_stream_stays_aligned(kv, pair):
    src, dst, sink, endpoint, connector = pair
    before = kv.snapshot(dst)
    live, stale = TransferKey(5, 2), TransferKey(5, 1)
    sink.expect(live, [4, 5, 6])
    sender = connector.sender(endpoint.address)
    kv.send_request(sender, stale, src, [0, 1, 2], first_token=1)  # fenced: dropped
    witness = TransferKey(6, 1)
    sink.expect(witness, [10])
    kv.send_request(sender, witness, src, [15])  # arrives after the stale frames
    assert sink.wait(lambda s: witness in s.completed, 10)
    assert kv.untouched(dst, before, [4, 5, 6])  # the live reservation was not written
    assert stale not in sink.completed
    kv.send_request(sender, live, src, [9, 10, 11], first_token=3)
    assert sink.wait(lambda s: live in s.completed, 10)
    assert kv.blocks_equal(src, [9, 10, 11], dst, [4, 5, 6])


def test_rejected_payload_fails_key_and_keeps_stream(kv, pair):
    src, dst, sink, endpoint, connector = pair
    bad, good = TransferKey(7, 1), TransferKey(8, 1)
    sink.expect(bad, [1, 2])  # two blocks reserved, three sent: the sink refuses the size
    sink.expect(good, [3])
    sender = connector.sender(endpoint.address)
    kv.send_request(sender, bad, src, [1, 2, 3])
    kv.send_request(sender, good, src, [4])
    assert sink.wait(lambda s: bad in s.failed and good in s.completed, 10)
    assert kv.blocks_equal(src, [4], dst, [3])
    assert not sink.late_layers


def test_many_pairs_on_one_endpoint(kv, no_thread_leak):
    dst = kv.make_pool(30, num_blocks=32)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=kv.FAST)
    connectors = [TorchDistConnector(f"prefill-{i}", config=kv.FAST) for i in range(3)]
    sources = [kv.make_pool(40 + i) for i in range(3)]
    keys = {}

    def prefill(i: int) -> None:
        sender = connectors[i].sender(endpoint.address)
        for r in range(2):
            key = TransferKey(100 * i + r, 1)
            kv.send_request(sender, key, sources[i], [r, r + 2], first_token=i)

    for i in range(3):
        for r in range(2):
            key = TransferKey(100 * i + r, 1)
            keys[key] = (i, [r, r + 2], [10 * i + 2 * r, 10 * i + 2 * r + 1])
            sink.expect(key, keys[key][2])
    threads = [threading.Thread(target=prefill, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sink.wait(lambda s: len(s.completed) == 6, 15)
    assert endpoint.num_peers == 3
    assert sorted(endpoint.peer_ids) == ["prefill-0", "prefill-1", "prefill-2"]
    for key, (i, src_ids, dst_ids) in keys.items():
        assert sink.completed[key] == i
        assert kv.blocks_equal(sources[i], src_ids, dst, dst_ids)
    connectors[1].close()  # pairs come and go
    assert kv.wait_until(lambda: endpoint.num_peers == 2, 5)
    for c in connectors:
        c.close()
    assert kv.wait_until(lambda: endpoint.num_peers == 0, 5)
    assert not sink.lost  # clean CLOSE, not a loss
    endpoint.close()


def test_channels_are_lazy_and_bounded(kv, no_thread_leak):
    sinks = [kv.RecordingSink(kv.make_pool(i)) for i in range(3)]
    endpoints = [TransferEndpoint(s, config=kv.FAST) for s in sinks]
    connector = TorchDistConnector("prefill-lru", config=kv.FAST, max_channels=2)
    try:
        first = connector.sender(endpoints[0].address)
        assert connector.sender(endpoints[0].address) is first
        assert not kv.wait_until(lambda: endpoints[0].num_peers > 0, 0.2)  # nothing yet
        first.send_abort(TransferKey(1, 1)).result(10)
        assert endpoints[0].num_peers == 1
        second = connector.sender(endpoints[1].address)
        second.send_layers(TransferKey(2, 1), 0, 1, torch.zeros(1, 2, 1, 4, 2, 8)).result(10)
        third = connector.sender(endpoints[2].address)  # evicts `first`, the idle one
        assert first.is_broken and not second.is_broken
        assert kv.wait_until(lambda: endpoints[0].num_peers == 0, 5)
        third.send_layers(TransferKey(3, 1), 0, 1, torch.zeros(1, 2, 1, 4, 2, 8)).result(10)
        with pytest.raises(TransferError, match="busy"):
            connector.sender(endpoints[0].address)
        assert connector.num_channels == 2
    finally:
        connector.close()
        for e in endpoints:
            e.close()


def test_idle_pair_survives_on_heartbeats(kv, no_thread_leak):
    config = ChannelConfig(peer_timeout_s=0.6, connect_timeout_s=5.0, heartbeat_s=0.1)
    dst = kv.make_pool(1)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=config)
    connector = TorchDistConnector("prefill-hb", config=config)
    src = kv.make_pool(2)
    try:
        sender = connector.sender(endpoint.address)
        sender.send_abort(TransferKey(1, 1)).result(5)
        assert not sink.wait(lambda s: s.lost, 1.5)  # idle for 2.5 x peer_timeout
        key = TransferKey(2, 1)
        sink.expect(key, [0])
        kv.send_request(sender, key, src, [1])
        assert sink.wait(lambda s: key in s.completed, 5)
    finally:
        connector.close()
        endpoint.close()


def test_endpoint_refuses_beyond_max_peers(kv, no_thread_leak):
    sink = kv.RecordingSink(kv.make_pool(1))
    endpoint = TransferEndpoint(sink, config=kv.FAST, max_peers=1)
    a = TorchDistConnector("a", config=kv.FAST)
    b = TorchDistConnector("b", config=kv.FAST)
    try:
        a.sender(endpoint.address).send_abort(TransferKey(1, 1)).result(10)
        error = b.sender(endpoint.address).send_abort(TransferKey(1, 1)).exception(10)
        assert isinstance(error, TransferError) and "refused" in str(error)
    finally:
        a.close()
        b.close()
        endpoint.close()


def test_decode_side_gone_fails_sender_without_hanging(kv, no_thread_leak):
    config = ChannelConfig(peer_timeout_s=3.0, connect_timeout_s=1.0, heartbeat_s=0.2)
    sink = kv.RecordingSink(kv.make_pool(1))
    endpoint = TransferEndpoint(sink, config=config)
    connector = TorchDistConnector("prefill-x", config=config)
    sender = connector.sender(endpoint.address)
    sender.send_abort(TransferKey(1, 1)).result(5)
    endpoint.close()  # ends the loop at the next heartbeat and drops the pair
    assert kv.wait_until(lambda: sender.is_broken, 2 * config.peer_timeout_s)
    error = sender.send_abort(TransferKey(2, 1)).exception(1)
    assert isinstance(error, TransferError)
    unreachable = connector.sender(endpoint.address)  # the endpoint's store is gone too
    assert unreachable is not sender
    assert isinstance(unreachable.send_abort(TransferKey(3, 1)).exception(10), TransferError)
    connector.close()


def test_killed_prefill_process(kv, no_thread_leak, tmp_path):
    dst = kv.make_pool(50)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=kv.FAST)
    full, partial = TransferKey(1, 1), TransferKey(2, 1)
    sink.expect(full, [0, 1, 2])
    sink.expect(partial, [3, 4, 5])
    child = subprocess.Popen([sys.executable, "-P", str(CHILD), endpoint.address, "77"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "SENT"
        assert sink.wait(lambda s: full in s.completed, 10)
        src = kv.make_pool(77)  # the child's pool, rebuilt from its seed
        assert sink.completed[full] == 11
        assert kv.blocks_equal(src, [2, 5, 9], dst, [0, 1, 2])
        assert endpoint.num_peers == 1
        child.kill()
        assert sink.wait(lambda s: s.lost and partial in s.failed, 2 * kv.FAST.peer_timeout_s)
        assert sink.lost[0][0] == "prefill-child"
        assert kv.wait_until(lambda: endpoint.num_peers == 0, 5)
    finally:
        child.kill()
        child.wait(10)
        endpoint.close()


def test_bench_helpers_report_rates(no_thread_leak):
    assert measure_channel(nbytes=1 << 16, iters=1) > 0
    assert measure_memcpy(nbytes=1 << 16, iters=1) > 0
    assert measure_transfer(num_layers=2, num_blocks=2, block_size=4, kv_heads=1, head_dim=8,
                            iters=1, include_pack=False) > 0


def test_a_sender_follows_a_gloo_endpoints_backend(kv, no_thread_leak):
    """A sender set for NCCL (as a GPU prefill worker's is) pairs with a CPU decode
    endpoint over gloo, its payloads staged through host memory, and the blocks arrive."""
    import dataclasses

    dst = kv.make_pool(30)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=kv.FAST)
    connector = TorchDistConnector("prefill-gpu",
                                   config=dataclasses.replace(kv.FAST, backend="nccl"))
    try:
        assert kv.transfer_works(endpoint, sink, connector, TransferKey(3, 1))
    finally:
        connector.close()
        endpoint.close()


def test_a_cpu_sender_refuses_an_nccl_endpoint_saying_why(kv, no_thread_leak):
    import dataclasses

    sink = kv.RecordingSink(kv.make_pool(32))
    endpoint = TransferEndpoint(sink, config=dataclasses.replace(kv.FAST, backend="nccl"))
    connector = TorchDistConnector("prefill-cpu", config=kv.FAST)
    try:
        sender = connector.sender(endpoint.address)
        payload = kv.make_pool(33)[0].kv[None, :, :1].contiguous()  # one block of one layer
        future = sender.send_layers(TransferKey(4, 1), 0, 1, payload)
        error = future.exception(10)
        assert isinstance(error, TransferError)
        assert "receives over nccl" in str(error) and "prefill pool on GPUs" in str(error)
    finally:
        connector.close()
        endpoint.close()
