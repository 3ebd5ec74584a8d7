"""KV transfer between a prefill worker P and a decode worker D: interfaces and protocol.

The protocol, in call order (one request, one (P, D) pair):

1. D ``reserve``\\ s blocks for the request (decode worker, not this package) and hands the
   router a reservation naming a ``TransferKey(transfer_id, epoch)``; the epoch fences reuse:
   a key is never valid again once its reservation is committed, aborted or expired.
2. D hosts a receiving endpoint (``TransferEndpoint`` / ``InProcEndpoint``) built with a
   :class:`KVReceiveSink`; its address is published in the registry.
3. P asks its connector for the sender of D's address: ``connector.sender(address)``. The channel
   (a 2-rank process group, or an in-process queue) is created lazily on the first frame; the
   connector keeps at most ``max_channels`` of them and closes idle ones least recently used.
4. For each layer range ``[layer_start, layer_end)`` P finishes computing, it packs the
   request's blocks (:func:`pdserve.kv_transfer.framing.pack_layers`) and calls
   ``sender.send_layers(key, layer_start, layer_end, payload)``. The send is queued on the
   sender's own thread (own CUDA stream on GPU), so layer ``l`` ships while ``l + 1`` computes.
   Each call returns a ``Future`` resolved when the frame has left.
5. On D, one receive loop per peer reads a fixed int64 header, asks the sink for a buffer
   (``payload_buffer``), receives the payload into it and calls ``on_layers``, which scatters
   it into the reserved blocks. Frames are keyed by (transfer_id, epoch), never FIFO by request.
   ``payload_buffer`` returning ``None`` (unknown, stale or aborted key) makes the loop drain
   the payload into scratch memory and drop it, so the stream stays aligned and no block that
   might have been reused is ever written.
6. P samples token 0, then ``sender.send_commit(key, first_token_id, num_stand_ins=n)``. The
   commit carries how many LAYERS frames were sent for the key; D calls ``on_commit`` only when
   that many arrived intact, otherwise ``on_failed``. After ``on_commit`` the blocks belong to
   the running request. ``n`` counts the leading blocks of the shipment that hold no KV: with a
   sliding window P may have freed blocks of the prompt before it ships (out of its window),
   and sends stand-ins for them so the shipment still maps one to one onto the reservation's
   blocks; D frees those and never hashes them into its prefix cache.
7. Any side may give up: P sends ``send_abort(key)`` (D calls ``on_abort``, idempotent);
   a corrupt or short frame fails its key (``on_failed``); a dead or silent peer fails every
   key still open on that channel (``on_failed``) and then ``on_peer_lost(peer_id, error)``.
   Pending futures on P fail with :class:`TransferError`. Keys that never produced a frame
   are freed by D's lease expiry, not by this package.
8. ``sender.flush(timeout)`` waits for queued frames; ``sender.close()`` / ``connector.close()``
   / ``endpoint.close()`` are idempotent and bounded in time.

Idle channels send HEARTBEAT frames so a silent peer is detected within ``peer_timeout_s``;
CLOSE ends a channel cleanly.
"""

from __future__ import annotations

import abc
import enum
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


class TransferError(RuntimeError):
    """A transfer (or the whole channel) failed: timeout, dead peer, bad frame, closed sender."""


class FramingError(TransferError):
    """A header failed validation (bad magic, version, kind, sizes or checksum)."""


class FrameKind(enum.IntEnum):
    """What a frame carries; the value travels in the header."""

    LAYERS = 1  # a layer range of one request's blocks; payload follows
    COMMIT = 2  # all layers sent; carries token 0, the frame count and the stand-in count
    ABORT = 3  # the sender gave up on this key
    HEARTBEAT = 4  # keep-alive on an idle channel; no key
    CLOSE = 5  # the sender closes the channel cleanly; no key


@dataclass(frozen=True, order=True)
class TransferKey:
    """Names one transfer attempt: the request's reservation on D and its fencing epoch."""

    transfer_id: int  # int64 id D assigned to the reservation
    epoch: int  # int64 fencing epoch; a stale epoch's frames are drained and dropped

    def __post_init__(self) -> None:
        for name in ("transfer_id", "epoch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
            if not 0 <= value < 2**63:
                raise ValueError(f"{name} must be in [0, 2**63), got {value}")


@dataclass(frozen=True)
class ChannelConfig:
    """Timeouts and limits shared by both ends of a channel."""

    peer_timeout_s: float = 20.0  # longest silence (or blocked op) before a peer counts as dead
    connect_timeout_s: float = 10.0  # rendezvous / process-group construction limit
    heartbeat_s: float = 1.0  # an idle sender sends HEARTBEAT this often; < peer_timeout_s
    checksum: bool = False  # sender adds a payload checksum (a full extra pass over the bytes)
    max_payload_bytes: int = 1 << 34  # frames announcing more are rejected as malformed
    backend: str = "auto"  # "auto" (nccl on CUDA, gloo on CPU), "gloo" or "nccl"

    def __post_init__(self) -> None:
        for name in ("peer_timeout_s", "connect_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_s >= self.peer_timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be < peer_timeout_s "
                             f"({self.peer_timeout_s})")
        if self.max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be > 0, got {self.max_payload_bytes}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")


class KVSender(abc.ABC):
    """P side: one channel to one decode endpoint. Methods are thread-safe and never block on
    the network; frames leave in call order on the sender's own thread."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The decode endpoint this sender talks to."""

    @abc.abstractmethod
    def send_layers(self, key: TransferKey, layer_start: int, layer_end: int,
                    payload: torch.Tensor, num_blocks: int | None = None,
                    heads: tuple[int, int] | None = None) -> Future:
        """Queue layers ``[layer_start, layer_end)`` of ``key``: ``payload`` is the contiguous
        (num_layers, 2, num_blocks, block_size, kv_heads, head_dim) tensor of
        ``framing.pack_layers`` (or flat bytes plus ``num_blocks``). The caller must not
        modify it until the future resolves (to the number of payload bytes sent).
        ``heads``: the K/V heads it carries, in the full model's numbering (None: all)."""

    @abc.abstractmethod
    def send_commit(self, key: TransferKey, first_token_id: int, sharded: bool = False,
                    num_stand_ins: int = 0) -> Future:
        """Queue COMMIT for ``key`` after its last layers; ``sharded``: other channels may
        still carry shares of its heads (the receiver then waits for every head);
        ``num_stand_ins``: how many leading blocks of the shipment hold no KV (stand-ins for
        blocks the sender freed, see step 6). ValueError when it is not an int >= 0."""

    @abc.abstractmethod
    def send_share(self, key: TransferKey) -> Future:
        """Queue the end of this channel's share of ``key`` (head-sliced layers of a transfer
        whose COMMIT travels on another channel)."""

    @abc.abstractmethod
    def send_abort(self, key: TransferKey) -> Future:
        """Queue ABORT for ``key``; D drops it and frees nothing it did not own."""

    @abc.abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every frame queued so far has been sent or failed.
        Raises TransferError on timeout."""

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Send CLOSE (best effort), stop the thread, tear the channel down. Idempotent;
        frames still queued fail with TransferError."""

    @property
    @abc.abstractmethod
    def is_broken(self) -> bool:
        """True once the channel failed or closed; further sends fail at once."""

    @property
    @abc.abstractmethod
    def is_idle(self) -> bool:
        """True when no frame is queued and no key is open (layers sent, no commit/abort)."""


@runtime_checkable
class KVReceiveSink(Protocol):
    """D side: what a receive loop calls. Calls for one peer come from that peer's loop
    thread, in frame order; calls for different peers may run concurrently."""

    def payload_buffer(self, key: TransferKey, layer_start: int, layer_end: int,
                       nbytes: int, heads: tuple[int, int] | None = None
                       ) -> torch.Tensor | None:
        """A contiguous uint8 tensor of ``nbytes`` to receive into, or None when ``key`` is
        unknown, stale or aborted (the payload is then drained into scratch and dropped).
        Raising ValueError fails the key (``on_failed``) and drains the payload."""

    def on_layers(self, key: TransferKey, layer_start: int, layer_end: int,
                  buffer: torch.Tensor, heads: tuple[int, int] | None = None) -> None:
        """``buffer`` (from ``payload_buffer``) is filled: scatter it into the reserved blocks
        (``heads``: the K/V heads it carries, full model numbering; None: all of the pool's)."""

    def on_commit(self, key: TransferKey, first_token_id: int, sharded: bool = False,
                  num_stand_ins: int = 0) -> None:
        """Every LAYERS frame of ``key`` sent on this channel arrived intact; the request may
        start decoding (``sharded``: once every head has arrived, from any channel). Its first
        ``num_stand_ins`` blocks hold no KV (stand-ins, see step 6)."""

    def on_abort(self, key: TransferKey) -> None:
        """The sender aborted ``key``. Must be idempotent and ignore unknown keys."""

    def on_failed(self, key: TransferKey, error: TransferError) -> None:
        """``key`` cannot complete (bad frame, missing frames, channel lost or closed)."""

    def on_peer_lost(self, peer_id: str, error: TransferError) -> None:
        """The channel to ``peer_id`` broke; its open keys were failed just before."""


class KVConnector(abc.ABC):
    """P side: hands out one lazily-connected :class:`KVSender` per decode address."""

    @abc.abstractmethod
    def sender(self, address: str) -> KVSender:
        """The live sender for ``address`` (created if needed; a broken one is replaced).
        Raises TransferError when ``max_channels`` busy channels exist already."""

    @property
    @abc.abstractmethod
    def num_channels(self) -> int:
        """Number of live senders."""

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Close every sender. Idempotent."""


class KVReceiver(abc.ABC):
    """D side: accepts peers and runs one receive loop per peer into one sink."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What senders connect to (publish it in the registry)."""

    @property
    @abc.abstractmethod
    def num_peers(self) -> int:
        """Number of peers with a running receive loop."""

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, end every loop (bounded), release resources. Idempotent."""
