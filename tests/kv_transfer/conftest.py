"""Shared fixtures for kv_transfer tests: small pools, a recording sink, a thread-leak check."""

from __future__ import annotations

import datetime
import threading
import time
import types

import pytest
import torch
from torch.distributed import TCPStore

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer import ChannelConfig, ReservedBlocksSink, TransferKey, pack_layers

NUM_LAYERS = 4
NUM_BLOCKS = 16
BLOCK_SHAPE = (4, 2, 8)  # block_size, kv_heads, head_dim

FAST = ChannelConfig(peer_timeout_s=3.0, connect_timeout_s=5.0, heartbeat_s=0.2)


def make_pool(seed: int, num_layers: int = NUM_LAYERS, num_blocks: int = NUM_BLOCKS,
              dtype: torch.dtype = torch.float32) -> list[KVCacheLayer]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, *BLOCK_SHAPE)
    return [KVCacheLayer(torch.randn(shape, generator=gen).to(dtype)) for _ in range(num_layers)]


def snapshot(pool: list[KVCacheLayer]) -> list[torch.Tensor]:
    return [c.kv.clone() for c in pool]


def blocks_equal(src: list[KVCacheLayer], src_ids, dst: list[KVCacheLayer], dst_ids) -> bool:
    src_ids = torch.as_tensor(src_ids)
    dst_ids = torch.as_tensor(dst_ids)
    return all(torch.equal(s.kv[:, src_ids], d.kv[:, dst_ids])
               for s, d in zip(src, dst, strict=True))


def untouched(pool: list[KVCacheLayer], before: list[torch.Tensor], ids) -> bool:
    ids = torch.as_tensor(ids)
    return all(torch.equal(c.kv[:, ids], b[:, ids]) for c, b in zip(pool, before, strict=True))


def send_request(sender, key: TransferKey, pool, block_ids, first_token: int = 7,
                 layers_per_frame: int = 1, commit: bool = True, num_stand_ins: int = 0
                 ) -> list:
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    futures = []
    for start in range(0, len(pool), layers_per_frame):
        end = min(start + layers_per_frame, len(pool))
        futures.append(sender.send_layers(key, start, end, pack_layers(pool, ids, start, end)))
    if commit:
        futures.append(sender.send_commit(key, first_token, num_stand_ins=num_stand_ins))
    return futures


class RecordingSink(ReservedBlocksSink):
    """ReservedBlocksSink that records outcomes and flags writes after a key ended."""

    live: list[RecordingSink] = []  # closed by no_thread_leak at the end of each test

    def __init__(self, caches, **kwargs):
        super().__init__(caches, on_complete=self._complete, on_failure=self._failure,
                         on_peer_lost=self._lost, **kwargs)
        RecordingSink.live.append(self)
        self.cond = threading.Condition()
        self.completed: dict[TransferKey, int] = {}
        self.stand_ins: dict[TransferKey, int] = {}  # each completed key's COMMIT's stand-ins
        self.failed: dict[TransferKey, Exception] = {}
        self.lost: list[tuple[str, Exception]] = []
        self.ended: set[TransferKey] = set()
        self.late_layers: list[TransferKey] = []  # on_layers after the key ended (must stay [])

    def on_layers(self, key, layer_start, layer_end, buffer, heads=None):
        with self.cond:
            if key in self.ended:
                self.late_layers.append(key)
        super().on_layers(key, layer_start, layer_end, buffer, heads)

    def on_abort(self, key):
        with self.cond:
            self.ended.add(key)
        super().on_abort(key)

    def _complete(self, key, token, num_stand_ins):
        with self.cond:
            self.completed[key] = token
            self.stand_ins[key] = num_stand_ins
            self.ended.add(key)
            self.cond.notify_all()

    def _failure(self, key, error):
        with self.cond:
            self.failed[key] = error
            self.ended.add(key)
            self.cond.notify_all()

    def _lost(self, peer_id, error):
        with self.cond:
            self.lost.append((peer_id, error))
            self.cond.notify_all()

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)


def transfer_works(endpoint, sink, connector, key, dst_ids=(1, 2)) -> bool:
    """One request's blocks sent through ``connector`` to ``endpoint`` arrive intact."""
    src = make_pool(3)
    sink.expect(key, list(dst_ids))
    send_request(connector.sender(endpoint.address), key, src, [5, 6][:len(dst_ids)])
    done = sink.wait(lambda s: key in s.completed, 10)
    return done and blocks_equal(src, [5, 6][:len(dst_ids)], sink.caches, list(dst_ids))


def store_client(address: str, timeout_s: float = 5.0) -> TCPStore:
    """A plain client of the rendezvous store at ``address`` (what a stranger can open)."""
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-") and t.is_alive()]


@pytest.fixture
def no_thread_leak():
    """Fails the test if a kv-* thread it started is still running shortly after it ends."""
    before = set(kv_threads())
    yield
    while RecordingSink.live:  # the test's sinks end with it (their unpack thread too)
        RecordingSink.live.pop().close()
    assert wait_until(lambda: not (set(kv_threads()) - before), timeout=5.0), kv_threads()


@pytest.fixture
def kv():
    """The helpers above, for test modules (they cannot import conftest)."""
    return types.SimpleNamespace(
        FAST=FAST, NUM_LAYERS=NUM_LAYERS, NUM_BLOCKS=NUM_BLOCKS, make_pool=make_pool,
        snapshot=snapshot, blocks_equal=blocks_equal, untouched=untouched,
        send_request=send_request, RecordingSink=RecordingSink, wait_until=wait_until,
        kv_threads=kv_threads, transfer_works=transfer_works, store_client=store_client)
