"""The real transport: one 2-rank torch.distributed process group per (P, D) pair.

No global world: D hosts a ``TCPStore`` (``TransferEndpoint``), a P sender joins it lazily on
its first frame (an HMAC-authenticated join when the cluster has a join secret; the pieces are
in ``kv_transfer.rendezvous``), both build a gloo (CPU) or NCCL (CUDA) group on the pair's
store prefix, and frames flow P -> D only, header then payload. Every op is bounded by
``peer_timeout_s``; a broken pair is torn down on both sides and rebuilt on the next use.
docs/kv-transfer-rendezvous.md walks the join step by step, with what each side checks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import torch.distributed as dist

from pdserve.kv_transfer.base import ChannelConfig, FrameKind, KVReceiver, TransferError
from pdserve.kv_transfer.channel import LRUConnector, ThreadedSender
from pdserve.kv_transfer.framing import HEADER_WORDS, decode_header
from pdserve.kv_transfer.receiver import PeerDispatcher
from pdserve.kv_transfer.rendezvous import (
    BACKEND_KEY,
    SESSION_KEY,
    JoinQueue,
    PairJoin,
    answer_join,
    join_policy,
    master_store,
    new_pair_group,
    new_session,
    pair_store,
    parse_address,
    prove_pair,
    request_pair,
    resolve_backend,
    store_client,
    wire_device,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.02  # the listener's wait between looks at the join queue
_JOIN_BATCH = 256  # join messages popped between two looks at the stop flag
_BAD_JOIN_LOG_S = 10.0  # dropped joins are logged as one warning at most this often
_KEEP_SCRATCH_BYTES = 64 << 20  # a drained payload's buffer beyond this is not kept


class TorchDistSender(ThreadedSender):
    """P side of one pair (rank 1); the group is built on the sender thread at first use."""

    def __init__(self, address: str, peer_id: str, host: str, device: torch.device,
                 config: ChannelConfig, join_token: str = "") -> None:
        super().__init__(address, config, name=f"kv-send-{peer_id}->{address}")
        self.peer_id = peer_id
        self._host = host
        self._policy = join_policy(join_token)
        self._backend = resolve_backend(config.backend, device)
        self._wire = wire_device(self._backend, device)
        self._pg: dist.ProcessGroup | None = None

    def _connect(self) -> None:
        try:
            store = store_client(self.address, self.config.connect_timeout_s)
        except Exception as exc:
            raise TransferError(f"cannot reach decode endpoint {self.address}: {exc}") from exc
        self._follow_backend(store)
        try:
            join = request_pair(store, self._policy, self.peer_id,
                                self.config.connect_timeout_s)
        except TransferError as exc:
            raise TransferError(f"decode endpoint {self.address}: {exc}") from exc
        try:
            self._pg = new_pair_group(pair_store(store, join), 1, self._backend, self._host,
                                      self.config.peer_timeout_s)
            prove_pair(self._pg, join, 1, self._wire)
        except Exception as exc:
            self._pg = None
            raise TransferError(f"pair {join.idx} with {self.address} failed to form: "
                                f"{exc}") from exc
        logger.info("%s: pair %d with %s up (%s)", self.peer_id, join.idx, self.address,
                    self._backend)

    def _follow_backend(self, store) -> None:
        """Take the endpoint's backend where it differs: a GPU prefill worker sends to a CPU
        decode pool over gloo, each payload staged through host memory (``_send_frame``).
        The other way (a CPU pool's KV into a GPU pool over NCCL) is refused, saying so."""
        theirs = store.get(BACKEND_KEY).decode() if store.check([BACKEND_KEY]) else None
        if theirs is None or theirs == self._backend:
            return
        if theirs != "gloo":
            raise TransferError(f"decode endpoint {self.address} receives over {theirs} (GPU "
                                f"KV) and this sender's KV is on the CPU: run the prefill pool "
                                f"on GPUs too, or the decode pool on CPUs")
        logger.info("%s: %s receives over gloo: staging KV through host memory", self.peer_id,
                    self.address)
        self._backend, self._wire = "gloo", torch.device("cpu")

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
        self.config = config or ChannelConfig()
        super().__init__(max_channels, close_timeout_s=self.config.heartbeat_s * 2)
        self.peer_id = peer_id
        self.host = host
        self.device = torch.device(device)
        self._join_token = join_token  # the cluster's join secret; never sent

    def _make_sender(self, address: str) -> TorchDistSender:
        parse_address(address)
        return TorchDistSender(address, self.peer_id, self.host, self.device, self.config,
                               self._join_token)


class TransferEndpoint(KVReceiver):
    """D side: hosts the rendezvous store, accepts pairs, runs one receive loop per peer.

    ``join_token``: the cluster's join secret; when set, only joins authenticated by it pair
    (the empty string: anyone who reaches the store pairs).
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
        self._store = master_store(host, port, self.config.connect_timeout_s)
        self._address = f"{host}:{self._store.port}"
        session = new_session()
        self._store.set(SESSION_KEY, session)
        self._store.set(BACKEND_KEY, self._backend)  # a sender on another device follows it
        self._joins = JoinQueue(self._store, join_policy(join_token), session)
        self._lock = threading.Lock()
        self._peers: dict[int, tuple[str, threading.Thread]] = {}
        self.num_failed_handshakes = 0  # accepted pairs whose peer did not prove the secret
        self._num_bad_joins_logged = 0
        self._bad_joins_logged_at = 0.0
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, daemon=True,
                                          name=f"kv-listen-{self._address}")
        self._listener.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def num_bad_joins(self) -> int:
        """Join messages dropped: malformed, unauthenticated or a replayed pair index."""
        return self._joins.num_bad_joins

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
                self._drain_joins()
            except Exception:  # a store error must never stop the listener
                if not self._stop.is_set():
                    logger.exception("endpoint %s: listener error", self._address)

    def _drain_joins(self) -> None:
        """Pops the join queue until it runs empty, a batch at a time, answering valid joins
        in queue order: a join waits behind the messages ahead of it only."""
        is_empty = False
        while not is_empty and not self._stop.is_set():
            joins, is_empty = self._joins.pop_batch(_JOIN_BATCH)
            for join in joins:
                self._accept(join)
            self._log_bad_joins()

    def _log_bad_joins(self) -> None:
        num_new = self._joins.num_bad_joins - self._num_bad_joins_logged
        now = time.monotonic()
        if num_new and now - self._bad_joins_logged_at >= _BAD_JOIN_LOG_S:
            logger.warning("endpoint %s: dropped %d join messages (malformed, unauthenticated "
                           "or replayed)", self._address, num_new)
            self._num_bad_joins_logged += num_new
            self._bad_joins_logged_at = now

    def _accept(self, join: PairJoin) -> None:
        with self._lock:
            accepted = len(self._peers) < self.max_peers
            if accepted:
                thread = threading.Thread(target=self._peer_main, args=(join,), daemon=True,
                                          name=f"kv-recv-{join.peer_id}-{join.idx}")
                self._peers[join.idx] = (join.peer_id, thread)
        answer_join(self._store, join, accepted)
        if accepted:
            thread.start()
            logger.info("endpoint %s: accepted %s as pair %d", self._address, join.peer_id,
                        join.idx)
        else:
            logger.warning("endpoint %s: refused %s (max_peers=%d)", self._address,
                           join.peer_id, self.max_peers)

    def _peer_main(self, join: PairJoin) -> None:
        dispatcher = PeerDispatcher(join.peer_id, self.sink, self._wire)
        pg = self._form_pair(join)
        try:
            if pg is not None:
                self._receive(pg, dispatcher)
        finally:
            pg = None
            with self._lock:
                self._peers.pop(join.idx, None)

    def _form_pair(self, join: PairJoin) -> dist.ProcessGroup | None:
        """The pair's group, its peer proven; None (logged) when it does not form."""
        try:
            store = store_client(self._address, self.config.connect_timeout_s)
            pg = new_pair_group(pair_store(store, join), 0, self._backend, self.host,
                                self.config.peer_timeout_s)
        except Exception as exc:
            logger.warning("endpoint %s: pair %d with %s failed to form: %s", self._address,
                           join.idx, join.peer_id, exc)
            return None
        try:
            prove_pair(pg, join, 0, self._wire)
        except Exception as exc:
            with self._lock:
                self.num_failed_handshakes += 1
            logger.warning("endpoint %s: pair %d claiming to be %s ended at the handshake: %s",
                           self._address, join.idx, join.peer_id, exc)
            return None
        return pg

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

