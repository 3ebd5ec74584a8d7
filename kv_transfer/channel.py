"""The transport-independent half of the P side: a sender thread per channel, an LRU of them.

A transport subclasses :class:`ThreadedSender` with three hooks run on the sender's thread:
``_connect()`` (lazily, before the first frame), ``_send_frame(header, payload)`` and
``_disconnect()``. The base class owns the queue, sequence numbers, checksums, heartbeats,
futures, the CUDA side stream and failure propagation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pdserve.kv_transfer.base import (
    ChannelConfig,
    FrameKind,
    KVConnector,
    KVSender,
    TransferError,
    TransferKey,
)
from pdserve.kv_transfer.framing import FrameHeader, as_bytes, encode_header, payload_checksum

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One queued frame."""

    kind: FrameKind  # frame kind
    key: TransferKey | None = None  # the transfer, None for HEARTBEAT / CLOSE
    layer_start: int = 0  # LAYERS: first layer
    layer_end: int = 0  # LAYERS: one past the last layer
    arg: int = 0  # LAYERS: num_blocks; COMMIT: first token id
    count: int = 0  # COMMIT: LAYERS frames sent for the key
    heads: tuple[int, int] | None = None  # LAYERS: K/V heads carried (None: all)
    share: bool = False  # COMMIT: the end of this channel's share of the key
    sharded: bool = False  # COMMIT: the transfer's; shares may be on other channels
    num_stand_ins: int = 0  # COMMIT: leading shipped blocks that hold no KV
    payload: torch.Tensor | None = None  # LAYERS: flat uint8 payload
    ready: object = None  # torch.cuda.Event recorded on the caller's stream, for CUDA payloads
    future: Future = field(default_factory=Future)  # resolved with payload bytes sent


def _fail_future(future: Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


class ThreadedSender(KVSender):
    """Queues frames and sends them in order on one daemon thread (started on first use)."""

    def __init__(self, address: str, config: ChannelConfig, name: str,
                 heartbeats: bool = True) -> None:
        self._address = address
        self.config = config
        self._name = name
        self._heartbeats = heartbeats
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._busy = False  # the thread is running a job
        self._open: dict[TransferKey, int] = {}  # key -> LAYERS frames queued, until commit/abort
        self._error: TransferError | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._connected = False
        self._seq = 0
        self._stream = None  # torch.cuda.Stream for CUDA payloads, created on first use
        self.bytes_sent = 0  # payload bytes that left
        self.last_used = time.monotonic()  # for the connector's LRU

    # -- hooks ------------------------------------------------------------------------------
    def _connect(self) -> None:
        raise NotImplementedError

    def _send_frame(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _disconnect(self) -> None:
        raise NotImplementedError

    # -- KVSender -------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._address

    @property
    def is_broken(self) -> bool:
        return self._error is not None or self._closing

    @property
    def is_idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy and not self._open

    def send_layers(self, key: TransferKey, layer_start: int, layer_end: int,
                    payload: torch.Tensor, num_blocks: int | None = None,
                    heads: tuple[int, int] | None = None) -> Future:
        """See :meth:`KVSender.send_layers`. ``payload`` is the 6-D packed tensor
        (num_layers, 2, num_blocks, block_size, kv_heads, head_dim), or flat bytes together
        with ``num_blocks``."""
        _check_key(key)
        if not isinstance(payload, torch.Tensor) or payload.numel() == 0:
            raise ValueError("payload must be a non-empty tensor")
        if not 0 <= layer_start < layer_end:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is empty or negative "
                             "(layer_start, layer_end)")
        if num_blocks is None:
            if payload.dim() != 6 or payload.shape[0] != layer_end - layer_start:
                raise ValueError("payload must be (num_layers, 2, num_blocks, block_size, "
                                 f"kv_heads, head_dim) or num_blocks given; got "
                                 f"{tuple(payload.shape)} for {layer_end - layer_start} layers")
            num_blocks = payload.shape[2]
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        job = _Job(FrameKind.LAYERS, key, layer_start, layer_end, arg=num_blocks,
                   payload=as_bytes(payload), heads=heads)
        if payload.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(payload.device))
        with self._cond:
            self._open[key] = self._open.get(key, 0) + 1
        return self._submit(job)

    def send_commit(self, key: TransferKey, first_token_id: int, sharded: bool = False,
                    num_stand_ins: int = 0) -> Future:
        _check_key(key)
        if first_token_id < 0:
            raise ValueError(f"first_token_id must be >= 0, got {first_token_id}")
        if isinstance(num_stand_ins, bool) or not isinstance(num_stand_ins, int) \
                or num_stand_ins < 0:
            raise ValueError(f"num_stand_ins must be an int >= 0, got {num_stand_ins!r}")
        with self._cond:
            count = self._open.pop(key, 0)
        return self._submit(_Job(FrameKind.COMMIT, key, arg=int(first_token_id), count=count,
                                 sharded=sharded, num_stand_ins=num_stand_ins))

    def send_share(self, key: TransferKey) -> Future:
        _check_key(key)
        with self._cond:
            count = self._open.pop(key, 0)
        return self._submit(_Job(FrameKind.COMMIT, key, count=count, share=True))

    def send_abort(self, key: TransferKey) -> Future:
        _check_key(key)
        with self._cond:
            self._open.pop(key, None)
        return self._submit(_Job(FrameKind.ABORT, key))

    def flush(self, timeout: float | None = None) -> None:
        with self._cond:
            done = self._cond.wait_for(
                lambda: (not self._jobs and not self._busy) or self._thread_gone(), timeout)
        if not done:
            raise TransferError(f"flush to {self._address} timed out after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        timeout = self.config.peer_timeout_s if timeout is None else timeout
        with self._cond:
            if self._closing:
                return
            self._closing = True
            thread = self._thread
            if thread is not None and self._error is None:
                self._jobs.append(_Job(FrameKind.CLOSE))
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("sender to %s still blocked after %.1f s; abandoning it",
                               self._address, timeout)
        self._fail_all(TransferError(f"sender to {self._address} closed"))

    # -- internals --------------------------------------------------------------------------
    def _thread_gone(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _submit(self, job: _Job) -> Future:
        with self._cond:
            if self._error is not None or self._closing:
                _fail_future(job.future, self._error or TransferError(
                    f"sender to {self._address} is closed"))
                return job.future
            self._jobs.append(job)
            self.last_used = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return job.future

    def _next_job(self) -> _Job | None:
        with self._cond:
            while not self._jobs:
                if self._closing or self._error is not None:
                    return None
                idle = self._heartbeats and self._connected
                if not self._cond.wait(self.config.heartbeat_s if idle else None) and idle:
                    if not self._jobs and not self._closing:
                        self._busy = True
                        return _Job(FrameKind.HEARTBEAT)
            self._busy = True
            return self._jobs.popleft()

    def _loop(self) -> None:
        try:
            while (job := self._next_job()) is not None:
                try:
                    nbytes = self._run(job)
                except Exception as exc:
                    error = exc if isinstance(exc, TransferError) else TransferError(
                        f"send to {self._address} failed: {exc}")
                    _fail_future(job.future, error)
                    self._fail_all(error)
                    return
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
                if not job.future.done():
                    job.future.set_result(nbytes)
        finally:
            if self._connected:
                self._connected = False
                try:
                    self._disconnect()
                except Exception:
                    logger.exception("disconnect from %s failed", self._address)
            with self._cond:
                self._cond.notify_all()

    def _run(self, job: _Job) -> int:
        if job.kind == FrameKind.CLOSE and not self._connected:
            return 0
        if not self._connected:
            self._connect()
            self._connected = True
        if job.payload is not None and job.payload.is_cuda:
            return self._run_cuda(job)
        self._transmit(job)
        return 0 if job.payload is None else job.payload.numel()

    def _run_cuda(self, job: _Job) -> int:
        if self._stream is None:
            self._stream = torch.cuda.Stream(job.payload.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(job.ready)  # the payload was produced on the caller's stream
            self._transmit(job)
            self._stream.synchronize()
        return job.payload.numel()

    def _transmit(self, job: _Job) -> None:
        payload = job.payload
        checksum = None
        if payload is not None and self.config.checksum:
            checksum = payload_checksum(payload)
        self._seq += 1
        header = FrameHeader(kind=job.kind, seq=self._seq, key=job.key,
                             layer_start=job.layer_start, layer_end=job.layer_end, arg=job.arg,
                             count=job.count,
                             payload_nbytes=0 if payload is None else payload.numel(),
                             payload_sum=checksum, heads=job.heads, share=job.share,
                             sharded=job.sharded, num_stand_ins=job.num_stand_ins)
        self._send_frame(encode_header(header), payload)
        if payload is not None:
            self.bytes_sent += payload.numel()

    def _fail_all(self, error: TransferError) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            pending = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for job in pending:
            _fail_future(job.future, error)


def _check_key(key: TransferKey) -> None:
    if not isinstance(key, TransferKey):
        raise ValueError(f"key must be a TransferKey, got {type(key).__name__}")


class LRUConnector(KVConnector):
    """At most ``max_channels`` senders; a new address evicts the least recently used idle one."""

    def __init__(self, max_channels: int, close_timeout_s: float) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self.max_channels = max_channels
        self._close_timeout_s = close_timeout_s
        self._lock = threading.Lock()
        self._senders: OrderedDict[str, ThreadedSender] = OrderedDict()
        self._closed = False

    def _make_sender(self, address: str) -> ThreadedSender:
        raise NotImplementedError

    def sender(self, address: str) -> ThreadedSender:
        to_close: list[ThreadedSender] = []
        try:
            with self._lock:
                if self._closed:
                    raise TransferError("connector is closed")
                for addr, s in list(self._senders.items()):
                    if s.is_broken:  # dead channels are torn down, replaced on demand
                        to_close.append(self._senders.pop(addr))
                current = self._senders.get(address)
                if current is not None:
                    self._senders.move_to_end(address)
                    return current
                while len(self._senders) >= self.max_channels:
                    victim = next((a for a, s in self._senders.items() if s.is_idle), None)
                    if victim is None:
                        raise TransferError(f"all {self.max_channels} channels are busy")
                    logger.info("closing idle channel to %s (LRU)", victim)
                    to_close.append(self._senders.pop(victim))
                sender = self._make_sender(address)
                self._senders[address] = sender
                return sender
        finally:
            for s in to_close:
                s.close(self._close_timeout_s)

    @property
    def num_channels(self) -> int:
        with self._lock:
            return sum(not s.is_broken for s in self._senders.values())

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closed = True
            senders = list(self._senders.values())
            self._senders.clear()
        for s in senders:
            s.close(self._close_timeout_s if timeout is None else timeout)
