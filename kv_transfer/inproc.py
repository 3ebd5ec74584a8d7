"""An in-process transport with the same interfaces, and fault injection, for tests.

``InProcHub`` stands in for the network: endpoints register under ``inproc://name``;
``InProcConnector`` hands out senders whose frames travel through a queue to the endpoint's
per-peer receive loop thread, which runs the same :class:`PeerDispatcher` as the real one.
A :class:`FaultPlan` picks, per frame sent through a connector, one :class:`FaultKind`:

- DROP: the frame vanishes.             - DELAY: it arrives ``delay_s`` late (order kept).
- TRUNCATE: half the payload arrives (a header-only frame arrives cut, which breaks the pair).
- CORRUPT: one payload byte flips (a header-only frame gets a damaged header: pair breaks).
- DUPLICATE: it arrives twice.          - PEER_DEATH: the sender dies before sending it.

Payload damage is only caught with ``ChannelConfig.checksum`` on (the default here). Frames
are copied when sent, as a wire would. Heartbeats are off: a dead in-process peer is signalled.
"""

from __future__ import annotations

import enum
import logging
import queue
import random
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from pdserve.kv_transfer.base import ChannelConfig, FrameKind, KVReceiver, TransferError
from pdserve.kv_transfer.channel import LRUConnector, ThreadedSender
from pdserve.kv_transfer.framing import decode_header
from pdserve.kv_transfer.receiver import PeerDispatcher

logger = logging.getLogger(__name__)

_SCHEME = "inproc://"
_POLL_S = 0.02


class FaultKind(enum.Enum):
    """What happens to one frame on the way."""

    NONE = "none"
    DROP = "drop"
    DELAY = "delay"
    TRUNCATE = "truncate"
    CORRUPT = "corrupt"
    DUPLICATE = "duplicate"
    PEER_DEATH = "peer_death"


class FaultPlan:
    """Chooses a fault per frame, in the order frames are sent through the plan.

    ``script``: a sequence (frame i gets ``script[i]``, NONE after its end) or a mapping
    {frame index: fault}. Or ``rates``: {fault: probability} drawn per frame from ``seed``.
    Thread-safe; ``history`` records (frame index, frame kind, fault) for each frame."""

    def __init__(self, script: Sequence[FaultKind] | Mapping[int, FaultKind] | None = None, *,
                 rates: Mapping[FaultKind, float] | None = None, seed: int = 0,
                 delay_s: float = 0.005) -> None:
        if script is not None and rates is not None:
            raise ValueError("give script or rates, not both (script, rates)")
        if rates is not None and (any(p < 0 for p in rates.values())
                                  or sum(rates.values()) > 1):
            raise ValueError(f"rates must be >= 0 and sum to <= 1, got {dict(rates)}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        if isinstance(script, Mapping):
            self._script = dict(script)
        else:
            self._script = dict(enumerate(script or ()))
        self._rates = dict(rates or {})
        self._rng = random.Random(seed)
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._index = 0
        self.history: list[tuple[int, FrameKind, FaultKind]] = []

    def next_fault(self, kind: FrameKind) -> FaultKind:
        with self._lock:
            index = self._index
            self._index += 1
            fault = self._script.get(index, FaultKind.NONE)
            if self._rates:
                u, acc = self._rng.random(), 0.0
                for candidate, p in self._rates.items():
                    acc += p
                    if u < acc:
                        fault = candidate
                        break
            self.history.append((index, kind, fault))
            return fault


class _Wire:
    """One in-process pair: a queue of (header, payload) items, or a _Hangup."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.queue: queue.Queue = queue.Queue()
        self.closed = threading.Event()  # the receiving side is gone


class _Hangup:
    """Queued when the sending side disappears."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class InProcHub:
    """The 'network' of one test: endpoints by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, InProcEndpoint] = {}

    def _register(self, endpoint: InProcEndpoint) -> None:
        with self._lock:
            if endpoint.address in self._endpoints:
                raise ValueError(f"address {endpoint.address!r} is taken (name)")
            self._endpoints[endpoint.address] = endpoint

    def _unregister(self, endpoint: InProcEndpoint) -> None:
        with self._lock:
            self._endpoints.pop(endpoint.address, None)

    def connect(self, address: str, peer_id: str) -> _Wire:
        with self._lock:
            endpoint = self._endpoints.get(address)
        if endpoint is None:
            raise TransferError(f"no endpoint at {address}")
        return endpoint._accept(peer_id)


class InProcEndpoint(KVReceiver):
    """D side: one receive loop thread per connected in-process peer."""

    def __init__(self, hub: InProcHub, name: str, sink, config: ChannelConfig | None = None,
                 max_peers: int = 64, device: str | torch.device = "cpu") -> None:
        self.hub = hub
        self.sink = sink
        self.config = config or ChannelConfig(checksum=True)
        self.max_peers = max_peers
        self.device = torch.device(device)
        self._address = f"{_SCHEME}{name}"
        self._lock = threading.Lock()
        self._loops: dict[int, threading.Thread] = {}
        self._next = 0
        self._stop = threading.Event()
        hub._register(self)

    @property
    def address(self) -> str:
        return self._address

    @property
    def num_peers(self) -> int:
        with self._lock:
            return len(self._loops)

    def close(self, timeout: float | None = None) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.hub._unregister(self)
        with self._lock:
            loops = list(self._loops.values())
        deadline = time.monotonic() + (5.0 if timeout is None else timeout)
        for t in loops:
            t.join(max(0.0, deadline - time.monotonic()))

    def _accept(self, peer_id: str) -> _Wire:
        wire = _Wire(peer_id)
        with self._lock:
            if self._stop.is_set():
                raise TransferError(f"endpoint {self._address} is closed")
            if len(self._loops) >= self.max_peers:
                raise TransferError(f"endpoint {self._address} refused: at max_peers")
            self._next += 1
            idx = self._next
            thread = threading.Thread(target=self._loop, args=(idx, wire), daemon=True,
                                      name=f"kv-inproc-recv-{peer_id}-{idx}")
            self._loops[idx] = thread
            thread.start()  # (under the lock: close() joins every thread it finds listed)
        return wire

    def _loop(self, idx: int, wire: _Wire) -> None:
        dispatcher = PeerDispatcher(wire.peer_id, self.sink, self.device)
        try:
            while True:
                try:
                    item = wire.queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._stop.is_set():
                        dispatcher.fail_open(TransferError("decode endpoint closed"))
                        return
                    continue
                if isinstance(item, _Hangup):
                    dispatcher.lost(TransferError(f"peer {wire.peer_id}: {item.reason}"))
                    return
                if self._handle(dispatcher, *item):
                    return
        except TransferError as exc:  # framing: a real stream could not realign either
            dispatcher.lost(exc)
        finally:
            wire.closed.set()
            with self._lock:
                self._loops.pop(idx, None)

    def _handle(self, dispatcher: PeerDispatcher, header_t: torch.Tensor,
                payload: torch.Tensor | None) -> bool:
        """Process one frame; True when the channel ends (CLOSE)."""
        header = decode_header(header_t, self.config.max_payload_bytes)
        target = dispatcher.begin(header)
        damage = None
        if header.payload_nbytes:
            dest = target if target is not None else dispatcher.scratch(header.payload_nbytes)
            got = 0 if payload is None else payload.numel()
            n = min(got, header.payload_nbytes)
            dest[:n].copy_(payload[:n])
            if got != header.payload_nbytes:
                damage = f"payload truncated: {got} of {header.payload_nbytes} bytes"
        dispatcher.end(header, target, damage)
        return header.kind == FrameKind.CLOSE


class InProcSender(ThreadedSender):
    """P side of an in-process pair; applies the connector's fault plan to each frame."""

    def __init__(self, hub: InProcHub, address: str, peer_id: str, config: ChannelConfig,
                 plan: FaultPlan | None) -> None:
        super().__init__(address, config, name=f"kv-inproc-send-{peer_id}->{address}",
                         heartbeats=False)
        self._hub = hub
        self.peer_id = peer_id
        self._plan = plan
        self._wire: _Wire | None = None

    def _connect(self) -> None:
        self._wire = self._hub.connect(self.address, self.peer_id)

    def _send_frame(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        wire = self._wire
        if wire.closed.is_set():
            raise TransferError(f"connection to {self.address} closed by peer")
        kind = FrameKind(int(header[2]))
        fault = self._plan.next_fault(kind) if self._plan else FaultKind.NONE
        header = header.clone()
        payload = None if payload is None else payload.detach().to("cpu", copy=True)
        if fault == FaultKind.PEER_DEATH:
            wire.queue.put(_Hangup("died (injected)"))
            self._wire = None
            raise TransferError(f"sender {self.peer_id} died (injected)")
        if fault == FaultKind.DROP:
            return
        if fault == FaultKind.DELAY:
            time.sleep(self._plan.delay_s)
        elif fault == FaultKind.TRUNCATE:
            if payload is not None:
                payload = payload[: payload.numel() // 2]
            else:
                header = header[: header.numel() - 1]
        elif fault == FaultKind.CORRUPT:
            if payload is not None:
                payload[payload.numel() // 2] ^= 0x5A
            else:
                header[6] ^= 1
        wire.queue.put((header, payload))
        if fault == FaultKind.DUPLICATE:
            wire.queue.put((header.clone(), None if payload is None else payload.clone()))

    def _disconnect(self) -> None:
        if self._wire is not None:
            self._wire.queue.put(_Hangup("connection closed"))
            self._wire = None


class InProcConnector(LRUConnector):
    """P side of the in-process transport."""

    def __init__(self, hub: InProcHub, peer_id: str, config: ChannelConfig | None = None,
                 fault_plan: FaultPlan | None = None, max_channels: int = 16) -> None:
        self.config = config or ChannelConfig(checksum=True)
        super().__init__(max_channels, close_timeout_s=5.0)
        self.hub = hub
        self.peer_id = peer_id
        self.fault_plan = fault_plan

    def _make_sender(self, address: str) -> InProcSender:
        if not address.startswith(_SCHEME):
            raise ValueError(f"address must start with {_SCHEME!r}, got {address!r}")
        return InProcSender(self.hub, address, self.peer_id, self.config, self.fault_plan)
