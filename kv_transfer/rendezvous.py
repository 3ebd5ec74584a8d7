"""The rendezvous of the pair process groups (``kv_transfer.torch_dist``): the store keys a
pair's join goes through, the store server bound to one host, the join message's checks and
the 2-rank group itself (gloo or NCCL)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from pdserve.kv_transfer.base import TransferError
from pdserve.net import listening_socket

NEXT_KEY = "pdserve/kv/next"  # pair index counter
JOIN_KEY = "pdserve/kv/join"  # queue of "idx peer_id"
ACCEPT_KEY = "pdserve/kv/accept/"  # + idx -> b"1" accepted / b"0" refused
PAIR_KEY = "pdserve/kv/pair/"  # + idx + "/" : the pair's process-group rendezvous prefix
_MAX_PEER_ID_CHARS = 128
_MAX_JOIN_BYTES = 512  # a longer join message is hostile or broken: dropped unread


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


def parse_join(message: bytes) -> tuple[int, str, str]:
    """``b"idx peer_id [token]"`` -> (idx, peer_id, token); ValueError when malformed."""
    if len(message) > _MAX_JOIN_BYTES:
        raise ValueError(f"join message of {len(message)} bytes")
    parts = message.decode("utf-8").split(" ")
    if len(parts) not in (2, 3):
        raise ValueError(f"join message has {len(parts)} fields")
    idx_text, peer_id = parts[0], parts[1]
    if not idx_text.isdigit() or int(idx_text) < 1:
        raise ValueError(f"pair index {idx_text[:20]!r} is not a positive integer")
    if not peer_id or len(peer_id) > _MAX_PEER_ID_CHARS or not peer_id.isprintable():
        raise ValueError("peer id is empty, too long or not printable")
    return int(idx_text), peer_id, parts[2] if len(parts) == 3 else ""


def store_client(address: str, timeout_s: float) -> TCPStore:
    host, port = parse_address(address)
    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


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
