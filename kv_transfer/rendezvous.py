"""The rendezvous of the pair process groups (``kv_transfer.torch_dist``): the store keys a
pair's join goes through, the store server bound to one host, the join policies, D's side of
the join queue, the 2-rank group itself (gloo or NCCL) and the handshake that ends its making.

The policy is chosen once, from the cluster's join secret (``join_policy``):

- ``SecretJoin`` (a secret is configured). P's join is ``b"idx peer_id nonce mac"``: a fresh
  random nonce and ``mac = HMAC-SHA256(secret, session | "idx peer_id nonce")``, where
  ``session`` is the endpoint's random id (``SESSION_KEY``), so a join is good for one endpoint
  only. The secret itself never leaves the process. Everything else a pair uses is derived the
  same way from the join, so another client of the store can neither predict nor forge it: the
  key D answers on, both answers (accepted / refused), the pair's group prefix, the MAC on every
  value of the group's rendezvous (``SignedStore``) and the two proofs P and D exchange over the
  new group before any frame (``prove_pair``).
- ``OpenJoin`` (no secret: the empty string). The join is ``b"idx peer_id"``, answered ``b"1"`` /
  ``b"0"`` on ``accept/idx``, the group meets under ``pair/idx/``, nothing is signed and there
  is no handshake: anyone who reaches the store can pair, answer for D or sit in a pair's group.
  Only for a store nothing else can reach (tests, one host).

What a client of the store can still do: read every key and value (``list_keys``), so it
learns a pair's group prefix and gloo addresses once they are written, and race a pair's gloo
TCP connection (gloo's own TCP is not authenticated). The handshake then ends that pair before
a frame moves, but a stranger's wrongly sized first message would abort the process inside
gloo. It can also pop, delete or flood the join queue, delaying pairs (P gives up after its join
timeout) but never pairing itself. Keep the store's and gloo's ports reachable by the cluster
only.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from pdserve.kv_transfer.base import TransferError
from pdserve.net import listening_socket

logger = logging.getLogger(__name__)

NEXT_KEY = "pdserve/kv/next"  # pair index counter
JOIN_KEY = "pdserve/kv/join"  # queue of join messages (a policy's format)
SESSION_KEY = "pdserve/kv/session"  # the endpoint's random session id, part of every MAC
BACKEND_KEY = "pdserve/kv/backend"  # the backend the endpoint receives over (gloo | nccl)
ACCEPT_KEY = "pdserve/kv/accept/"  # + idx (open) or a derived name (secret) -> D's answer
PAIR_KEY = "pdserve/kv/pair/"  # + idx (open) or a derived name (secret) + "/": group prefix
MAX_JOIN_BYTES = 512  # a longer join message is hostile or broken: dropped unread
_MAX_PEER_ID_CHARS = 128
_SESSION_BYTES = 16  # random bytes of a session id (hex in the store)
_NONCE_BYTES = 16  # random bytes of a join's nonce (hex in the message)
_PROOF_BYTES = 32  # an HMAC-SHA256 digest: the handshake's proofs and SignedStore's tags


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``nccl`` for CUDA devices, ``gloo`` otherwise."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return backend


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where the tensors handed to the process group live."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, int(port)


def master_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """The rendezvous server, listening on ``host`` only (TCPStore alone binds ``::``)."""
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on
    return TCPStore(host, bound, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=fd)


def store_client(address: str, timeout_s: float) -> TCPStore:
    host, port = parse_address(address)
    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def new_session() -> bytes:
    """A fresh endpoint session id (what ``SESSION_KEY`` holds)."""
    return secrets.token_hex(_SESSION_BYTES).encode()


@dataclass(frozen=True)
class PairJoin:
    """One pair's join, as both sides derive it (P from what it sends, D from what it pops)."""

    idx: int  # the pair index P took from NEXT_KEY
    peer_id: str  # P's worker id
    message: bytes  # what P pushes on JOIN_KEY
    accept_key: str  # the store key D answers on
    accepted: bytes  # D's answer when it takes the pair
    refused: bytes  # D's answer when it already holds max_peers pairs
    pair_prefix: str  # the group's rendezvous prefix in the store
    store_key: bytes | None = field(repr=False)  # signs the group's rendezvous values;
    # None: unsigned (open); never in the repr, nor are the proofs
    decode_proof: bytes | None = field(repr=False)  # D's first message on the group; None: no
    # handshake (open)
    prefill_proof: bytes | None = field(repr=False)  # P's answer to it


def _parse_join(body: bytes, num_fields: int) -> tuple[int, str, list[str]]:
    """``b"idx peer_id ..."`` with exactly ``num_fields`` fields -> (idx, peer_id, the rest)."""
    parts = body.decode("utf-8").split(" ")
    if len(parts) != num_fields:
        raise ValueError(f"join message has {len(parts)} fields, not {num_fields}")
    idx_text, peer_id = parts[0], parts[1]
    if not idx_text.isdigit() or int(idx_text) < 1:
        raise ValueError(f"pair index {idx_text[:20]!r} is not a positive integer")
    if not peer_id or len(peer_id) > _MAX_PEER_ID_CHARS or not peer_id.isprintable():
        raise ValueError("peer id is empty, too long or not printable")
    return int(idx_text), peer_id, parts[2:]


class OpenJoin:
    """No join secret: ``b"idx peer_id"``, which proves nothing (see the module docstring)."""

    def make(self, session: bytes, idx: int, peer_id: str) -> PairJoin:
        return self._pair(idx, peer_id, f"{idx} {peer_id}".encode())

    def verify(self, session: bytes, message: bytes) -> PairJoin:
        """The join ``message`` stands for; ValueError (or UnicodeDecodeError) when malformed."""
        idx, peer_id, _ = _parse_join(message, 2)
        return self._pair(idx, peer_id, message)

    @staticmethod
    def _pair(idx: int, peer_id: str, message: bytes) -> PairJoin:
        return PairJoin(idx, peer_id, message, accept_key=f"{ACCEPT_KEY}{idx}", accepted=b"1",
                        refused=b"0", pair_prefix=f"{PAIR_KEY}{idx}/", store_key=None,
                        decode_proof=None, prefill_proof=None)


class SecretJoin:
    """Joins authenticated by the cluster's join secret, which never leaves the process."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("secret must be non-empty (no secret: OpenJoin)")
        self._secret = secret

    def make(self, session: bytes, idx: int, peer_id: str) -> PairJoin:
        body = f"{idx} {peer_id} {secrets.token_hex(_NONCE_BYTES)}".encode()
        mac = self._mac(b"join", session, body).hex().encode()
        return self._pair(session, body, idx, peer_id, body + b" " + mac)

    def verify(self, session: bytes, message: bytes) -> PairJoin:
        """The join ``message`` stands for: its MAC is checked first (in constant time), its
        fields only then; ValueError (or UnicodeDecodeError) when it is not a join."""
        body, _, mac = message.rpartition(b" ")
        if not hmac.compare_digest(mac, self._mac(b"join", session, body).hex().encode()):
            raise ValueError("join MAC does not verify (a wrong secret, or forged)")
        idx, peer_id, (nonce,) = _parse_join(body, 3)
        if len(nonce) != 2 * _NONCE_BYTES:
            raise ValueError(f"join nonce of {len(nonce)} characters")
        return self._pair(session, body, idx, peer_id, message)

    def _mac(self, purpose: bytes, session: bytes, body: bytes) -> bytes:
        text = b"\0".join((b"pdserve-kv", purpose, session, body))
        return hmac.new(self._secret, text, hashlib.sha256).digest()

    def _pair(self, session: bytes, body: bytes, idx: int, peer_id: str,
              message: bytes) -> PairJoin:
        def derive(purpose: bytes) -> bytes:
            return self._mac(purpose, session, body)

        return PairJoin(idx, peer_id, message,
                        accept_key=ACCEPT_KEY + derive(b"accept-key").hex(),
                        accepted=derive(b"accepted").hex().encode(),
                        refused=derive(b"refused").hex().encode(),
                        pair_prefix=PAIR_KEY + derive(b"pair-prefix").hex() + "/",
                        store_key=derive(b"pair-store"), decode_proof=derive(b"decode-proof"),
                        prefill_proof=derive(b"prefill-proof"))


def join_policy(secret: str) -> OpenJoin | SecretJoin:
    """``SecretJoin`` for a configured secret, ``OpenJoin`` for the empty string."""
    return SecretJoin(secret.encode()) if secret else OpenJoin()


def request_pair(store: dist.Store, policy: OpenJoin | SecretJoin, peer_id: str,
                 timeout_s: float) -> PairJoin:
    """P: join the endpoint behind ``store`` and wait for its answer, at most ``timeout_s``.

    Returns the accepted join; TransferError when refused, unanswered within the timeout (a
    wrong secret, or a join queue flooded beyond what D discards in that time) or answered with
    something that does not verify."""
    deadline = time.monotonic() + timeout_s
    try:
        session = store.get(SESSION_KEY)  # set before the endpoint's address is published
        if len(session) != 2 * _SESSION_BYTES:
            raise TransferError(f"endpoint session id of {len(session)} bytes")
        join = policy.make(session, store.add(NEXT_KEY, 1), peer_id)
        store.queue_push(JOIN_KEY, join.message)
        left_s = max(deadline - time.monotonic(), 0.001)
        store.wait([join.accept_key], datetime.timedelta(seconds=left_s))
        answer = store.get(join.accept_key)
        store.delete_key(join.accept_key)
    except dist.DistStoreError as exc:
        raise TransferError(f"no answer to the join within the join timeout ({timeout_s} s): "
                            "a wrong join secret, or the endpoint is down or its join queue "
                            f"flooded ({exc})") from exc
    except dist.DistError as exc:
        raise TransferError(f"join failed: {exc}") from exc
    if hmac.compare_digest(answer, join.refused):
        raise TransferError(f"the endpoint refused pair {join.idx} (at max_peers)")
    if not hmac.compare_digest(answer, join.accepted):
        raise TransferError(f"the answer to pair {join.idx} does not verify")
    return join


def answer_join(store: dist.Store, join: PairJoin, accepted: bool) -> None:
    """D: answer ``join`` (P is waiting in ``request_pair``)."""
    store.set(join.accept_key, join.accepted if accepted else join.refused)


class JoinQueue:
    """D's side of the join queue: pops messages in batches and returns the valid joins in
    queue order; whatever is not one is dropped cheaply and counted, checked in order of cost:
    its size before it is decoded, its MAC (``SecretJoin``) before its fields are parsed, its
    pair index (replayed, or never handed out) last."""

    def __init__(self, store: dist.Store, policy: OpenJoin | SecretJoin, session: bytes) -> None:
        self._store = store
        self._policy = policy
        self._session = session
        self._seen_idx: set[int] = set()  # pair indices already admitted (never twice)
        self.num_bad_joins = 0  # messages dropped, since construction

    def pop_batch(self, max_messages: int) -> tuple[list[PairJoin], bool]:
        """Pops up to ``max_messages`` messages -> (the valid joins among them, in order;
        whether the queue ran empty)."""
        joins = []
        for _ in range(max_messages):
            try:
                message = self._store.queue_pop(JOIN_KEY, block=False)
            except dist.QueueEmptyError:
                return joins, True
            join = self._admit(message)
            if join is None:
                self.num_bad_joins += 1
            else:
                joins.append(join)
        return joins, False

    def _admit(self, message: bytes) -> PairJoin | None:
        if len(message) > MAX_JOIN_BYTES:
            logger.debug("dropped a join of %d bytes", len(message))
            return None
        try:
            join = self._policy.verify(self._session, message)
        except (ValueError, UnicodeDecodeError) as exc:
            logger.debug("dropped a join: %s", exc)
            return None
        if join.idx in self._seen_idx or join.idx > self._store.add(NEXT_KEY, 0):
            logger.debug("dropped a join from %r: pair index %d reused or never handed out",
                         join.peer_id, join.idx)
            return None
        self._seen_idx.add(join.idx)
        return join


class SignedStore(dist.Store):
    """A pair's group rendezvous whose values carry an HMAC of (key, value) under the pair's
    key: other clients of the store can read them but not replace or move them; ``get`` of a
    value the pair did not write raises TransferError (the group then fails to form)."""

    def __init__(self, inner: dist.Store, key: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._key = key

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        value = bytes(value)
        self._inner.set(key, value + self._tag(key, value))

    def get(self, key: str) -> bytes:
        signed = self._inner.get(key)
        value, tag = signed[:-_PROOF_BYTES], signed[-_PROOF_BYTES:]
        if len(signed) < _PROOF_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise TransferError(f"pair rendezvous value {key!r} is not the pair's (forged)")
        return value

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self._inner.set_timeout(timeout)


def pair_store(store: dist.Store, join: PairJoin) -> dist.Store:
    """The store the pair's group meets on: its prefix, signed when the join is."""
    prefixed = PrefixStore(join.pair_prefix, store)
    return prefixed if join.store_key is None else SignedStore(prefixed, join.store_key)


def new_pair_group(store: dist.Store, rank: int, backend: str, host: str,
                   timeout_s: float) -> dist.ProcessGroup:
    """A 2-rank process group on ``store`` (already prefixed for this pair)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._threads = 1
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise TransferError("backend 'nccl' needs a CUDA build of torch")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def prove_pair(pg: dist.ProcessGroup, join: PairJoin, rank: int, device: torch.device) -> None:
    """The handshake on a new group, before any frame: D (rank 0) sends its proof, P (rank 1)
    checks it and only then answers with its own, which D checks. Each side so knows the other
    holds the secret; a stranger who got into the group learns nothing that pairs it. Raises
    TransferError on a wrong proof; does nothing for an open join."""
    if join.decode_proof is None or join.prefill_proof is None:
        return
    if rank == 0:
        _send_proof(pg, join.decode_proof, 1, device)
        _check_proof(pg, join.prefill_proof, 1, device, "the prefill peer")
    else:
        _check_proof(pg, join.decode_proof, 0, device, "the decode endpoint")
        _send_proof(pg, join.prefill_proof, 0, device)


def _send_proof(pg: dist.ProcessGroup, proof: bytes, peer: int, device: torch.device) -> None:
    pg.send([torch.frombuffer(bytearray(proof), dtype=torch.uint8).to(device)], peer, 0).wait()


def _check_proof(pg: dist.ProcessGroup, proof: bytes, peer: int, device: torch.device,
                 who: str) -> None:
    received = torch.empty(len(proof), dtype=torch.uint8, device=device)
    pg.recv([received], peer, 0).wait()
    if not hmac.compare_digest(received.cpu().numpy().tobytes(), proof):
        raise TransferError(f"{who} did not prove the join secret")
