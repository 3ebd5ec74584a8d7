"""Micro-benchmark helpers for ``bench/disagg.py``: raw channel, memcpy and full-stack GB/s,
and how fast a decode endpoint discards a flood of bogus joins.

They return figures and never assert; sizes are the caller's choice (keep them small on CI).
"""

from __future__ import annotations

import datetime
import statistics
import threading
import time
from dataclasses import dataclass

import torch
from torch.distributed import PrefixStore, TCPStore

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer.base import ChannelConfig, TransferKey
from pdserve.kv_transfer.framing import pack_layers
from pdserve.kv_transfer.rendezvous import (
    JOIN_KEY,
    JoinQueue,
    SecretJoin,
    master_store,
    new_pair_group,
    new_session,
    resolve_backend,
    store_client,
)
from pdserve.kv_transfer.sink import ReservedBlocksSink, mark_covered
from pdserve.kv_transfer.torch_dist import TorchDistConnector, TransferEndpoint


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memcpy(nbytes: int = 64 << 20, iters: int = 5, device: str = "cpu") -> float:
    """Median GB/s of a local copy of ``nbytes`` on ``device`` (the ceiling to compare with)."""
    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 1):
        _sync(dev)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


def measure_channel(nbytes: int = 64 << 20, iters: int = 5, device: str = "cpu",
                    peer_device: str | None = None, backend: str = "auto",
                    host: str = "127.0.0.1", timeout_s: float = 60.0) -> float:
    """Median GB/s of a raw ``send``/``recv`` of one ``nbytes`` tensor over a fresh 2-rank pair
    built like the transport builds it (both ranks in this process).

    ``device`` is the sender's, ``peer_device`` the receiver's (default: the same; NCCL needs
    two distinct GPUs). The first transfer (connection warm-up) is not counted."""
    src_dev = torch.device(device)
    dst_dev = torch.device(peer_device or device)
    backend = resolve_backend(backend, src_dev)
    if backend == "gloo":
        src_dev = dst_dev = torch.device("cpu")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    groups: dict[int, object] = {}

    def build(rank: int) -> None:
        client = TCPStore(host, store.port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
        groups[rank] = new_pair_group(PrefixStore("bench/", client), rank, backend, host,
                                      timeout_s)

    builder = threading.Thread(target=build, args=(0,))
    builder.start()
    build(1)
    builder.join()
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev).random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    times = []
    for _ in range(iters + 1):
        start = time.perf_counter()
        recv = groups[0].recv([dst], 1, 0)  # posted, completes asynchronously
        groups[1].send([src], 0, 0).wait()
        recv.wait()
        _sync(dst_dev)
        times.append(time.perf_counter() - start)
    groups.clear()
    return nbytes / statistics.median(times[1:]) / 1e9


def measure_transfer(num_layers: int = 8, num_blocks: int = 64, block_size: int = 16,
                     kv_heads: int = 4, head_dim: int = 64, iters: int = 3,
                     dtype: torch.dtype = torch.float16, checksum: bool = False,
                     include_pack: bool = True, scatter: bool = True) -> float:
    """Median GB/s moving one request's KV (every layer, one frame per layer) through the full
    stack: pack, sender thread, gloo pair, receive loop, unpack into a second pool. With
    ``include_pack=False`` the payloads are packed before the clock starts; with
    ``scatter=False`` the receiver drops payloads instead of writing blocks (transport only)."""
    shape = (2, num_blocks * 2, block_size, kv_heads, head_dim)
    src = [KVCacheLayer(torch.randn(shape).to(dtype)) for _ in range(num_layers)]
    dst = [KVCacheLayer(torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
    src_ids = torch.arange(num_blocks, dtype=torch.int64)
    dst_ids = torch.arange(num_blocks, 2 * num_blocks, dtype=torch.int64)
    done = threading.Event()
    sink = (ReservedBlocksSink(dst, on_complete=lambda key, token, stand_ins: done.set())
            if scatter else _NullSink(dst, on_complete=lambda key, token, stand_ins: done.set()))
    config = ChannelConfig(checksum=checksum)
    endpoint = TransferEndpoint(sink, config=config)
    connector = TorchDistConnector("bench-prefill", config=config)
    times = []
    try:
        for epoch in range(iters + 1):
            key = TransferKey(1, epoch)
            sink.expect(key, dst_ids)
            done.clear()
            packed = None if include_pack else [
                pack_layers(src, src_ids, layer, layer + 1) for layer in range(num_layers)]
            start = time.perf_counter()
            sender = connector.sender(endpoint.address)
            for layer in range(num_layers):
                payload = (pack_layers(src, src_ids, layer, layer + 1) if packed is None
                           else packed[layer])
                sender.send_layers(key, layer, layer + 1, payload)
            sender.send_commit(key, 0)
            if not done.wait(timeout=60):
                raise RuntimeError("transfer did not complete")
            times.append(time.perf_counter() - start)
    finally:
        connector.close()
        endpoint.close()
        sink.close()
    nbytes = sum(c.bytes_per_block for c in src) * num_blocks
    return nbytes / statistics.median(times[1:]) / 1e9


class _NullSink(ReservedBlocksSink):
    """Accepts every frame of an expected key and writes nothing (measures the transport)."""

    def on_layers(self, key, layer_start, layer_end, buffer, heads=None) -> None:
        with self._lock:
            entry = self._expected.get(key)
            if entry is not None:
                mark_covered(entry, layer_start, layer_end, self._pool_heads(heads))


@dataclass(frozen=True)
class JoinFloodRates:
    """One flood of bogus joins on a decode endpoint's join queue."""

    message_bytes: int  # size of each bogus message
    pushed_per_s: float  # messages one client pushed per second (pushes are not acknowledged)
    discarded_per_s: float  # messages D's JoinQueue popped and dropped per second


def measure_join_flood(num_joins: int = 20_000, message_bytes: int = 0,
                       host: str = "127.0.0.1", timeout_s: float = 120.0) -> JoinFloodRates:
    """Push ``num_joins`` bogus joins from one store client, then time the endpoint's
    ``JoinQueue`` (under a join secret) discarding the full queue in batches, as its listener
    does. The default messages are well-formed with a wrong MAC (the costliest to drop: an
    HMAC each); ``message_bytes`` > 0 pushes that many bytes each instead (dropped for their
    size, but each still crosses the store's socket)."""
    store = master_store(host, 0, timeout_s)
    client = store_client(f"{host}:{store.port}", timeout_s)
    if message_bytes:
        messages = [b"x" * message_bytes] * num_joins
    else:
        messages = [f"{i + 1} bogus-peer {i:032x} {0:064x}".encode() for i in range(num_joins)]
    start = time.perf_counter()
    for message in messages:
        client.queue_push(JOIN_KEY, message)
    while client.queue_len(JOIN_KEY) < num_joins:  # the store has taken every push
        time.sleep(0.001)
    pushed_s = time.perf_counter() - start
    queue = JoinQueue(store, SecretJoin(b"bench-secret"), new_session())
    start = time.perf_counter()
    is_empty = False
    while not is_empty:
        joins, is_empty = queue.pop_batch(256)
        if joins:
            raise RuntimeError("a bogus join was admitted")
    discarded_s = time.perf_counter() - start
    if queue.num_bad_joins != num_joins:
        raise RuntimeError(f"{queue.num_bad_joins} of {num_joins} joins discarded")
    return JoinFloodRates(len(messages[0]), num_joins / pushed_s, num_joins / discarded_s)
