"""Head-sliced transfers, how tensor parallel groups move KV rank to rank: every sender ships
the K/V heads it holds that a receiver holds, over its own channel; a receiver completes a key
once every head of every layer is in (and, on the rank the COMMIT goes to, the COMMIT). Over
the in-process transport, which runs the real dispatcher and sink."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer import InProcConnector, InProcEndpoint, InProcHub, TransferKey
from pdserve.kv_transfer.framing import pack_layers

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 12, 4, 8
SRC_IDS, DST_IDS = [3, 1, 4], [10, 2, 7]
KEY = TransferKey(1, 1)


def pool(seed: int, heads: int) -> list[KVCacheLayer]:
    gen = torch.Generator().manual_seed(seed)
    return [KVCacheLayer(torch.randn(2, BLOCKS, BLOCK_SIZE, heads, HEAD_DIM, generator=gen))
            for _ in range(LAYERS)]


def heads_of(caches, ids, first: int, end: int) -> list[torch.Tensor]:
    return [c.kv[:, torch.tensor(ids), :, first:end] for c in caches]


def ship(sender, caches, heads, pool_first: int, commit=None, share=False, layers=LAYERS,
         num_stand_ins: int = 0):
    """Send layers of ``heads`` (model numbering) from a pool whose head 0 is ``pool_first``."""
    ids = torch.tensor(SRC_IDS)
    local = (heads[0] - pool_first, heads[1] - pool_first)
    futures = [sender.send_layers(KEY, layer, layer + 1,
                                  pack_layers(caches, ids, layer, layer + 1, heads=local),
                                  heads=heads)
               for layer in range(layers)]
    if commit is not None:
        futures.append(sender.send_commit(KEY, commit, sharded=True,
                                          num_stand_ins=num_stand_ins))
    if share:
        futures.append(sender.send_share(KEY))
    for f in futures:
        f.result(timeout=5)


@pytest.fixture
def hub():
    return InProcHub()


def _endpoint(hub, kv, name, caches, **sink_kwargs):
    sink = kv.RecordingSink(caches, **sink_kwargs)
    return InProcEndpoint(hub, name, sink), sink


def test_two_sender_ranks_to_one_receiver_complete_once_every_head_is_in(hub, kv,
                                                                         no_thread_leak):
    """P TP=2 -> D TP=1: rank 0's commit arrives before rank 1's heads and waits for them;
    the completion carries that commit's token and stand-in count."""
    whole = pool(1, heads=2)
    rank_pools = [[KVCacheLayer(c.kv[:, :, :, r:r + 1].clone()) for c in whole] for r in (0, 1)]
    dst = pool(2, heads=2)
    endpoint, sink = _endpoint(hub, kv, "decode-0", dst)
    sink.expect(KEY, DST_IDS)
    senders = [InProcConnector(hub, f"prefill-0.rank{r}").sender(endpoint.address)
               for r in (0, 1)]
    ship(senders[0], rank_pools[0], (0, 1), 0, commit=42, num_stand_ins=2)
    assert not sink.wait(lambda s: KEY in s.ended, 0.3)  # rank 1's heads are not in yet
    ship(senders[1], rank_pools[1], (1, 2), 1, share=True)
    assert sink.wait(lambda s: KEY in s.ended, 5)
    assert (sink.completed, sink.stand_ins) == ({KEY: 42}, {KEY: 2})
    assert all(torch.equal(a, b) for a, b in zip(heads_of(whole, SRC_IDS, 0, 2),
                                                 heads_of(dst, DST_IDS, 0, 2), strict=True))
    for s in senders:
        s.close()
    endpoint.close()


def test_one_sender_to_two_receiver_ranks_each_gets_exactly_its_heads(hub, kv, no_thread_leak):
    """P TP=1 -> D TP=2: rank 1's pool (heads 1..1) completes on its heads alone."""
    src = pool(3, heads=2)
    dst = [pool(4, heads=1), pool(5, heads=1)]
    untouched = [kv.snapshot(d) for d in dst]
    endpoints, sinks = zip(*(_endpoint(hub, kv, f"decode-0.rank{r}", dst[r], first_head=r,
                                       complete_on_heads=r > 0) for r in (0, 1)), strict=True)
    for sink in sinks:
        sink.expect(KEY, DST_IDS)
    connector = InProcConnector(hub, "prefill-0")
    ship(connector.sender(endpoints[1].address), src, (1, 2), 0, share=True)
    ship(connector.sender(endpoints[0].address), src, (0, 1), 0, commit=7)
    for r in (0, 1):
        assert sinks[r].wait(lambda s: KEY in s.completed, 5)
        assert torch.equal(torch.stack(heads_of(src, SRC_IDS, r, r + 1)),
                           torch.stack(heads_of(dst[r], DST_IDS, 0, 1)))
        assert kv.untouched(dst[r], untouched[r], [i for i in range(BLOCKS)
                                                   if i not in DST_IDS])
    assert sinks[0].completed == {KEY: 7} and sinks[1].completed == {KEY: None}
    connector.close()
    for endpoint in endpoints:
        endpoint.close()


def test_heads_the_receiver_does_not_hold_fail_the_key(hub, kv, no_thread_leak):
    dst = pool(6, heads=1)
    endpoint, sink = _endpoint(hub, kv, "decode-0.rank1", dst, first_head=1)
    sink.expect(KEY, DST_IDS)
    sender = InProcConnector(hub, "prefill-0").sender(endpoint.address)
    ship(sender, pool(7, heads=2), (0, 1), 0, layers=1)
    assert sink.wait(lambda s: KEY in s.failed, 5)
    assert "not all in this pool" in str(sink.failed[KEY])
    sender.close()
    endpoint.close()


def test_an_unsharded_commit_with_heads_missing_fails_at_once(hub, kv, no_thread_leak):
    """Without the sharded flag no other share is coming: missing heads are an error."""
    dst = pool(8, heads=2)
    endpoint, sink = _endpoint(hub, kv, "decode-0", dst)
    sink.expect(KEY, DST_IDS)
    sender = InProcConnector(hub, "prefill-0").sender(endpoint.address)
    ship(sender, pool(9, heads=2), (0, 1), 0)
    sender.send_commit(KEY, 3).result(timeout=5)
    assert sink.wait(lambda s: KEY in s.failed, 5)
    assert "committed with layers [0, 1, 2] missing" in str(sink.failed[KEY])
    sender.close()
    endpoint.close()


def test_head_ranges_and_commit_kinds_survive_the_wire():
    from pdserve.kv_transfer.base import FrameKind
    from pdserve.kv_transfer.framing import FrameHeader, decode_header, encode_header

    for header in (
            FrameHeader(FrameKind.LAYERS, 1, KEY, 0, 2, arg=3, payload_nbytes=3 * 2 * 64,
                        heads=(5, 7)),
            FrameHeader(FrameKind.LAYERS, 2, KEY, 0, 2, arg=3, payload_nbytes=3 * 2 * 64),
            FrameHeader(FrameKind.COMMIT, 3, KEY, arg=9, count=4, sharded=True),
            FrameHeader(FrameKind.COMMIT, 4, KEY, count=4, share=True)):
        assert decode_header(encode_header(header)) == header
