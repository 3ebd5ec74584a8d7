"""The real transport: one 2-rank torch.distributed process group per (P, D) pair.

No global world (the rendezvous pieces: ``kv_transfer.rendezvous``). D hosts a ``TCPStore``
(``TransferEndpoint``); its ``address`` goes into the registry. A P sender joins lazily, on
its first frame:

1. P opens a store client to D's address, takes a pair index ``idx = add("next", 1)`` and
   pushes ``"idx peer_id token"`` on the join queue (``token``: the cluster's join token).
2. D's listener pops the join, answers ``accept/idx`` with ``1`` (or ``0`` when it already
   holds ``max_peers`` pairs, or the token is wrong) and starts the peer's receive loop thread.
   A join that does not parse (hostile or broken) is logged and dropped; the listener goes on.
3. Both build the group on ``PrefixStore("pair/idx/")`` over their own store client, D as
   rank 0, P as rank 1: ``ProcessGroupGloo`` for CPU pools, ``ProcessGroupNCCL`` for CUDA
   pools (``ChannelConfig.backend`` overrides; gloo with CUDA tensors stages through host memory).
4. Frames flow P -> D only: ``send([header])`` then ``send([payload])``; the loop receives the
   header, then the payload into the sink's buffer (or scratch), see ``receiver.py``.

Liveness: every op is bounded by ``peer_timeout_s`` (the group's timeout); idle senders send
HEARTBEAT every ``heartbeat_s``, so a silent or dead peer breaks the pair within the timeout;
a dead process's sockets close at once. A broken pair is torn down on both sides: P's pending
futures fail with TransferError and its connector builds a new pair on the next use; D fails
the pair's open keys and calls ``sink.on_peer_lost``. A gloo recv cannot be interrupted, so
``TransferEndpoint.close`` ends each loop at its peer's next frame (a heartbeat at the latest).

Exposure: the store listens only on ``host`` (a socket bound here and handed to the store,
never every interface); it is unauthenticated, so the join token is what keeps strangers'
pairs out, and every frame is bounded by what the sink can ever accept (a whole pool:
``sink.max_payload_bytes``), so a header announcing more ends the pair before anything is
allocated; the sink then checks each frame against its reservation.

Alignment matters more than usual here: gloo aborts the whole process when a message's size
differs from the posted receive, so the loop posts a payload receive only for a header that
passed validation, always with the header's exact size, and ends the pair on any bad header.
On NCCL, set ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` in worker processes so a timed-out pair is
torn down rather than the process (untested here: no GPU on the development machines).
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import logging
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from pdserve.kv_transfer.base import ChannelConfig, FrameKind, KVReceiver, TransferError
from pdserve.kv_transfer.channel import LRUConnector, ThreadedSender
from pdserve.kv_transfer.framing import HEADER_WORDS, decode_header
from pdserve.kv_transfer.receiver import PeerDispatcher
from pdserve.kv_transfer.rendezvous import (
    ACCEPT_KEY,
    JOIN_KEY,
    NEXT_KEY,
    PAIR_KEY,
    master_store,
    new_pair_group,
    parse_address,
    parse_join,
    resolve_backend,
    store_client,
    wire_device,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.02  # the listener's wait between looks at the join queue
_KEEP_SCRATCH_BYTES = 64 << 20  # a drained payload's buffer beyond this is not kept


class TorchDistSender(ThreadedSender):
    """P side of one pair (rank 1); the group is built on the sender thread at first use."""

    def __init__(self, address: str, peer_id: str, host: str, device: torch.device,
                 config: ChannelConfig, join_token: str = "") -> None:
        super().__init__(address, config, name=f"kv-send-{peer_id}->{address}")
        self.peer_id = peer_id
        self._host = host
        self._join_token = join_token
        self._backend = resolve_backend(config.backend, device)
        self._wire = wire_device(self._backend, device)
        self._pg: dist.ProcessGroup | None = None

    def _connect(self) -> None:
        timeout = self.config.connect_timeout_s
        try:
            store = store_client(self.address, timeout)
            idx = store.add(NEXT_KEY, 1)
            join = f"{idx} {self.peer_id}"
            store.queue_push(JOIN_KEY, f"{join} {self._join_token}" if self._join_token else join)
            store.wait([f"{ACCEPT_KEY}{idx}"], datetime.timedelta(seconds=timeout))
            accepted = store.get(f"{ACCEPT_KEY}{idx}") == b"1"
            store.delete_key(f"{ACCEPT_KEY}{idx}")
        except Exception as exc:
            raise TransferError(f"cannot reach decode endpoint {self.address}: {exc}") from exc
        if not accepted:
            raise TransferError(f"decode endpoint {self.address} refused the pair (at max_peers, "
                                "or a wrong join token)")
        try:
            self._pg = new_pair_group(PrefixStore(f"{PAIR_KEY}{idx}/", store), 1, self._backend,
                                      self._host, self.config.peer_timeout_s)
        except Exception as exc:
            raise TransferError(f"pair {idx} with {self.address} failed to form: {exc}") from exc
        logger.info("%s: pair %d with %s up (%s)", self.peer_id, idx, self.address,
                    self._backend)

    def _send_frame(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        pg = self._pg
        header_work = pg.send([header.to(self._wire)], 0, 0)
        if payload is not None:
            if payload.device != self._wire:
                payload = payload.to(self._wire)  # gloo with a CUDA pool: stage through host
            pg.send([payload], 0, 0).wait()
        header_work.wait()

    def _disconnect(self) -> None:
        self._pg = None  # the group's destructor closes its sockets; D sees the peer go


class TorchDistConnector(LRUConnector):
    """P side: senders to many decode endpoints, created lazily, at most ``max_channels``."""

    def __init__(self, peer_id: str, host: str = "127.0.0.1", device: str | torch.device = "cpu",
                 config: ChannelConfig | None = None, max_channels: int = 16,
                 join_token: str = "") -> None:
        if not peer_id or any(c.isspace() for c in peer_id):
            raise ValueError(f"peer_id must be non-empty without spaces, got {peer_id!r}")
        if any(c.isspace() for c in join_token):
            raise ValueError("join_token must not contain spaces")
        self.config = config or ChannelConfig()
        super().__init__(max_channels, close_timeout_s=self.config.heartbeat_s * 2)
        self.peer_id = peer_id
        self.host = host
        self.device = torch.device(device)
        self._join_token = join_token  # the endpoints' token (the cluster's secret)

    def _make_sender(self, address: str) -> TorchDistSender:
        parse_address(address)
        return TorchDistSender(address, self.peer_id, self.host, self.device, self.config,
                               self._join_token)


class TransferEndpoint(KVReceiver):
    """D side: hosts the rendezvous store, accepts pairs, runs one receive loop per peer.

    ``join_token``: when set, only joins carrying it are accepted (compared in constant time).
    Frames may announce at most ``config.max_payload_bytes``, cut to ``sink.max_payload_bytes``
    when the sink has it (the most any reservation could take)."""

    def __init__(self, sink, host: str = "127.0.0.1", port: int = 0,
                 device: str | torch.device = "cpu", config: ChannelConfig | None = None,
                 max_peers: int = 64, join_token: str = "") -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        if not host:
            raise ValueError("host must be the address to listen on (never all interfaces "
                             "by default)")
        self.sink = sink
        self.config = config or ChannelConfig()
        self.host = host
        self.device = torch.device(device)
        self.max_peers = max_peers
        self._backend = resolve_backend(self.config.backend, self.device)
        self._wire = wire_device(self._backend, self.device)
        self.max_payload_bytes = min(self.config.max_payload_bytes,
                                     getattr(sink, "max_payload_bytes", None) or 1 << 62)
        self._join_token = join_token.encode()
        self._store = master_store(host, port, self.config.connect_timeout_s)
        self._address = f"{host}:{self._store.port}"
        self._lock = threading.Lock()
        self._peers: dict[int, tuple[str, threading.Thread]] = {}
        self._seen_idx: set[int] = set()  # pair indices already answered (never reused)
        self.num_bad_joins = 0  # joins dropped as malformed, refused for their token or index
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, daemon=True,
                                          name=f"kv-listen-{self._address}")
        self._listener.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def num_peers(self) -> int:
        with self._lock:
            return len(self._peers)

    @property
    def peer_ids(self) -> list[str]:
        with self._lock:
            return [peer_id for peer_id, _ in self._peers.values()]

    def close(self, timeout: float | None = None) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        deadline = time.monotonic() + (self.config.heartbeat_s * 2 if timeout is None
                                       else timeout)
        self._listener.join(max(0.0, deadline - time.monotonic()))
        if not self._listener.is_alive():
            self._store = None  # stops the rendezvous server
        with self._lock:
            threads = [t for _, t in self._peers.values()]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        lingering = [t.name for t in threads if t.is_alive()]
        if lingering:
            logger.warning("endpoint %s: loops %s still waiting on their peers", self._address,
                           lingering)

    def _listen(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                if self._store.queue_len(JOIN_KEY) == 0:
                    continue
                message = self._store.queue_pop(JOIN_KEY, block=False)
            except dist.QueueEmptyError:
                continue
            except Exception:
                if not self._stop.is_set():
                    logger.exception("endpoint %s: listener error", self._address)
                continue
            try:
                self._on_join(message)
            except Exception:  # one bad join must never stop the listener
                self.num_bad_joins += 1
                logger.exception("endpoint %s: join %r failed", self._address, message[:64])

    def _on_join(self, message: bytes) -> None:
        try:
            idx, peer_id, token = parse_join(message)
        except (ValueError, UnicodeDecodeError) as exc:
            self.num_bad_joins += 1
            logger.warning("endpoint %s: dropped a malformed join (%s)", self._address, exc)
            return
        if idx in self._seen_idx or idx > self._store.add(NEXT_KEY, 0):
            self.num_bad_joins += 1
            logger.warning("endpoint %s: dropped a join from %r with pair index %d (reused or "
                           "never handed out)", self._address, peer_id, idx)
            return
        self._seen_idx.add(idx)
        if self._join_token and not hmac.compare_digest(token.encode(), self._join_token):
            self.num_bad_joins += 1
            logger.warning("endpoint %s: refused %r: wrong join token", self._address, peer_id)
            self._store.set(f"{ACCEPT_KEY}{idx}", b"0")
            return
        self._accept(idx, peer_id)

    def _accept(self, idx: int, peer_id: str) -> None:
        with self._lock:
            accepted = len(self._peers) < self.max_peers
            if accepted:
                thread = threading.Thread(target=self._peer_main, args=(idx, peer_id),
                                          daemon=True, name=f"kv-recv-{peer_id}-{idx}")
                self._peers[idx] = (peer_id, thread)
        self._store.set(f"{ACCEPT_KEY}{idx}", b"1" if accepted else b"0")
        if accepted:
            thread.start()
            logger.info("endpoint %s: accepted %s as pair %d", self._address, peer_id, idx)
        else:
            logger.warning("endpoint %s: refused %s (max_peers=%d)", self._address, peer_id,
                           self.max_peers)

    def _peer_main(self, idx: int, peer_id: str) -> None:
        dispatcher = PeerDispatcher(peer_id, self.sink, self._wire)
        try:
            store = store_client(self._address, self.config.connect_timeout_s)
            pg = new_pair_group(PrefixStore(f"{PAIR_KEY}{idx}/", store), 0, self._backend,
                                self.host, self.config.peer_timeout_s)
        except Exception as exc:
            logger.warning("endpoint %s: pair %d with %s failed to form: %s", self._address, idx,
                           peer_id, exc)
            with self._lock:
                self._peers.pop(idx, None)
            return
        try:
            self._receive(pg, dispatcher)
        finally:
            pg = None
            with self._lock:
                self._peers.pop(idx, None)

    def _receive(self, pg: dist.ProcessGroup, dispatcher: PeerDispatcher) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        header_buf = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self._wire)
        staging = _Staging(self._wire)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                header_work = pg.recv([header_buf], 1, 0)
                while True:
                    header_work.wait()
                    header = decode_header(header_buf, self.max_payload_bytes)
                    target = dispatcher.begin(header)
                    payload_work = finish = None
                    if header.payload_nbytes:
                        payload_work, finish = self._post_payload(
                            pg, dispatcher, header.payload_nbytes, target, staging)
                    last = header.kind == FrameKind.CLOSE or self._stop.is_set()
                    if not last:  # pre-post the next header: the sender never waits for it
                        header_work = pg.recv([header_buf], 1, 0)
                    if payload_work is not None:
                        payload_work.wait()
                        finish()
                        if target is None:
                            dispatcher.release_scratch(_KEEP_SCRATCH_BYTES)
                    if header.kind == FrameKind.COMMIT and stream is not None:
                        stream.synchronize()  # every layer of the key is in place on commit
                    dispatcher.end(header, target)
                    if last:
                        if header.kind != FrameKind.CLOSE:
                            dispatcher.fail_open(TransferError("decode endpoint closed"))
                        return
        except Exception as exc:
            error = exc if isinstance(exc, TransferError) else TransferError(
                f"pair with {dispatcher.peer_id} broke: {exc}")
            logger.info("endpoint %s: %s", self._address, error)
            dispatcher.lost(error)

    def _post_payload(self, pg, dispatcher: PeerDispatcher, nbytes: int,
                      target: torch.Tensor | None, staging: _Staging):
        """Post the payload recv; returns (work, finish) where finish() runs after wait()."""
        dest = target if target is not None else dispatcher.scratch(nbytes)
        if dest.device == self._wire:
            return pg.recv([dest], 1, 0), lambda: None
        wire_buf = staging.get(nbytes)  # gloo into a CUDA sink buffer: through host memory
        return pg.recv([wire_buf], 1, 0), lambda: dest.copy_(wire_buf)


class _Staging:
    """A grow-only host buffer for gloo transfers into device memory."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._buf[:nbytes]

