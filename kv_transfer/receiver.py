"""The transport-independent half of a receive loop: one :class:`PeerDispatcher` per peer.

A transport's loop does, per frame::

    header = decode_header(recv(header_tensor))       # FramingError -> dispatcher.lost(...)
    buffer = dispatcher.begin(header)                 # sink buffer, or None to drop the frame
    if header.payload_nbytes:
        recv(buffer if buffer is not None else dispatcher.scratch(header.payload_nbytes))
    dispatcher.end(header, buffer, damage)            # damage: None, or why the payload is bad

The dispatcher decides what a frame may touch: duplicates (seq not increasing), keys already
committed / aborted / failed, and keys the sink does not know are drained and dropped; a
damaged payload (checksum, short read) fails its key; COMMIT is passed on only when every
LAYERS frame the sender counted arrived intact.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.base import (
    FrameKind,
    KVReceiveSink,
    TransferError,
    TransferKey,
)
from pdserve.kv_transfer.framing import FrameHeader, payload_checksum

logger = logging.getLogger(__name__)


@dataclass
class PeerStats:
    """Counters for one peer's receive loop."""

    frames: int = 0  # frames received (any kind, duplicates included)
    payload_bytes: int = 0  # payload bytes written into sink buffers
    dropped_frames: int = 0  # frames drained and dropped (stale, unknown, duplicate, damaged)
    seq_gaps: int = 0  # times the sequence number skipped ahead (frames lost on the way)


class PeerDispatcher:
    """Per-peer receive state: which keys are open, which are closed, what a frame may write.

    Single-threaded: only the peer's receive loop calls it."""

    def __init__(self, peer_id: str, sink: KVReceiveSink, scratch_device: torch.device,
                 max_closed_keys: int = 4096) -> None:
        self.peer_id = peer_id
        self.sink = sink
        self.stats = PeerStats()
        self._scratch_device = torch.device(scratch_device)
        self._scratch: torch.Tensor | None = None
        self._last_seq = 0
        self._accept_current = False  # the frame between begin() and end() is to be processed
        self._open: dict[TransferKey, int] = {}  # key -> LAYERS frames received intact
        self._closed: OrderedDict[TransferKey, None] = OrderedDict()  # finished keys, bounded
        self._max_closed = max_closed_keys
        self._finished = False

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A reusable uint8 buffer of ``nbytes`` to drain a dropped payload into."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self._scratch_device)
        return self._scratch[:nbytes]

    def release_scratch(self, keep_bytes: int) -> None:
        """Drop the scratch buffer when it grew beyond ``keep_bytes`` (a rare large drain)."""
        if self._scratch is not None and self._scratch.numel() > keep_bytes:
            self._scratch = None

    def begin(self, header: FrameHeader) -> torch.Tensor | None:
        """Decide about a frame; returns the sink's buffer for its payload or None (drop)."""
        self.stats.frames += 1
        if header.seq <= self._last_seq:
            logger.debug("peer %s: duplicate frame seq %d", self.peer_id, header.seq)
            return self._drop()
        if header.seq > self._last_seq + 1:
            self.stats.seq_gaps += 1
            logger.warning("peer %s: frames %d..%d lost", self.peer_id, self._last_seq + 1,
                           header.seq - 1)
        self._last_seq = header.seq
        self._accept_current = True
        if header.kind != FrameKind.LAYERS:
            return None
        key = header.key
        if key in self._closed:
            return self._drop()
        try:
            buffer = self.sink.payload_buffer(key, header.layer_start, header.layer_end,
                                              header.payload_nbytes, header.heads)
            if buffer is not None:
                _check_buffer(buffer, header.payload_nbytes)
        except Exception as exc:  # the sink refused the frame: the key cannot complete
            self._fail(key, TransferError(f"sink rejected layers of {key}: {exc}"))
            return self._drop()
        if buffer is None:
            logger.debug("peer %s: dropping layers for unknown or stale %s", self.peer_id, key)
            self._close_key(key)
            return self._drop()
        return buffer

    def end(self, header: FrameHeader, buffer: torch.Tensor | None,
            damage: str | None = None) -> None:
        """The payload (if any) is in ``buffer``; act on the frame."""
        if not self._accept_current:
            return
        self._accept_current = False
        kind, key = header.kind, header.key
        if kind == FrameKind.LAYERS:
            if buffer is not None:
                self._on_layers(header, buffer, damage)
        elif kind == FrameKind.COMMIT:
            self._on_commit(header)
        elif kind == FrameKind.ABORT:
            if key not in self._closed:
                self._open.pop(key, None)
                self._close_key(key)
                self._call(self.sink.on_abort, key)
        elif kind == FrameKind.CLOSE:
            self.fail_open(TransferError(f"peer {self.peer_id} closed the channel"))

    def fail_open(self, error: TransferError) -> None:
        """Fail every key still open on this channel (channel closed or lost)."""
        for key in list(self._open):
            self._fail(key, error)

    def lost(self, error: TransferError) -> None:
        """The channel broke: fail its open keys, then tell the sink. Called at most once."""
        if self._finished:
            return
        self._finished = True
        self.fail_open(error)
        self._call(self.sink.on_peer_lost, self.peer_id, error)

    @property
    def num_open_keys(self) -> int:
        return len(self._open)

    def _on_layers(self, header: FrameHeader, buffer: torch.Tensor, damage: str | None) -> None:
        key = header.key
        if damage is None and header.payload_sum is not None:
            if payload_checksum(buffer) != header.payload_sum:
                damage = "payload checksum mismatch"
        if damage is not None:
            self.stats.dropped_frames += 1
            self._fail(key, TransferError(f"layers [{header.layer_start}, {header.layer_end}) "
                                          f"of {key}: {damage}"))
            return
        try:
            self.sink.on_layers(key, header.layer_start, header.layer_end, buffer, header.heads)
        except Exception as exc:
            logger.exception("sink.on_layers failed for %s", key)
            self._fail(key, TransferError(f"sink failed to store layers of {key}: {exc}"))
            return
        self.stats.payload_bytes += header.payload_nbytes
        self._open[key] = self._open.get(key, 0) + 1

    def _on_commit(self, header: FrameHeader) -> None:
        key = header.key
        if key in self._closed:
            return
        received = self._open.pop(key, 0)
        self._close_key(key)
        if received != header.count:
            self._call(self.sink.on_failed, key, TransferError(
                f"{key}: {received} of {header.count} layer frames arrived before COMMIT"))
            return
        if not header.share:  # a share's frames are all in; the sink completes on its heads
            self._call(self.sink.on_commit, key, header.arg, header.sharded,
                       header.num_stand_ins)

    def _fail(self, key: TransferKey, error: TransferError) -> None:
        self._open.pop(key, None)
        if key in self._closed:
            return
        self._close_key(key)
        logger.info("peer %s: transfer %s failed: %s", self.peer_id, key, error)
        self._call(self.sink.on_failed, key, error)

    def _close_key(self, key: TransferKey) -> None:
        self._closed[key] = None
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)

    def _drop(self) -> None:
        self._accept_current = False
        self.stats.dropped_frames += 1
        return None

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # a sink bug must not kill the loop for every other request
            logger.exception("sink.%s%r raised", getattr(fn, "__name__", fn), args)


def _check_buffer(buffer: torch.Tensor, nbytes: int) -> None:
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() != nbytes:
        raise ValueError(f"payload_buffer must return a contiguous uint8 tensor of {nbytes} "
                         f"bytes, got {buffer.dtype} {tuple(buffer.shape)}")
