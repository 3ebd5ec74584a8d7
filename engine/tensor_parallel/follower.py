"""A follower rank of a tensor parallel engine, in the process rank 0 started
(:class:`Followers.start`; its entry point, ``follower_main.py``, checks the group's key first).

1. Read the engine config from rank 0's store; load this rank's shard of the model.
2. Wait for rank 0's memory ledger; allocate this rank's KV pool (its K/V heads, as many blocks
   as rank 0's); answer "ready" (or the error, which rank 0 raises).
3. Join the group; run every forward rank 0 broadcasts until it says stop.

A worker whose ranks do more than the forward (move their heads of the KV) names a
:class:`RankRole`: the follower builds it before answering ready, hands it each forward's
extras and runs the calls rank 0 makes on it.
"""

from __future__ import annotations

import importlib
import logging
import pickle

import torch

from pdserve.engine import compute_threads
from pdserve.engine.adapters import AdapterSlots
from pdserve.engine.capacity.memory import allocate_kv_caches, kv_layer_dtypes
from pdserve.engine.kv_cache.offload import TIER_CALLS, PoolTiers
from pdserve.engine.resolved_model import ResolvedModel
from pdserve.engine.tensor_parallel.group import (
    OP_CALL,
    START_TIMEOUT_S,
    FollowerSpec,
    RankContext,
    SignedStore,
    Signer,
    TensorGroup,
    connect_store,
    rank_device,
    watch_parent,
)
from pdserve.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)


def serve(address: str, rank: int, size: int, signer: Signer) -> None:
    store = SignedStore(connect_store(address, START_TIMEOUT_S), signer)
    spec: FollowerSpec = pickle.loads(store.get("spec"))
    compute_threads.claim(spec.num_threads)  # this thread computes; the rank's others on one
    try:
        resolved = ResolvedModel.of(spec.config)
        device = rank_device(resolved.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicator uses the current device
        shard = TensorShard(rank, size)
        model = resolved.load_model(spec.config, shard, device)
        adapters = AdapterSlots.for_config(spec.config, model, resolved.model_config, shard)
        ledger = pickle.loads(store.get("ledger"))
        layer_dtypes = kv_layer_dtypes(model.config.num_hidden_layers, resolved.dtype,
                                       spec.config)
        caches = allocate_kv_caches(model.config, ledger, layer_dtypes, device)
        tiers = PoolTiers.for_config(spec.config, caches, rank, size)
        role = None if spec.role is None else _load(spec.role.path)(
            RankContext(model, caches, rank, size, device, spec.config, resolved.model_config,
                        store), *spec.role.args)
    except Exception as exc:
        store.set(f"ready/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{rank}", "")
    group = TensorGroup(store, rank, size, device, spec.step_timeout_s, signer)
    model.join_tensor_group(group.all_reduce)
    logger.info("tensor parallel rank %d/%d ready on %s", rank, size, device)
    try:
        while (message := group.recv(resolved.backend, adapters is not None)) is not None:
            if message.op == OP_CALL:
                method, args = message.payload
                target = (adapters if method == AdapterSlots.load_slot.__name__
                          else tiers if method in TIER_CALLS else role)
                group.count_failures(not _call(target, method, args))
                continue
            input_ids, positions, meta, rows = message.batch
            extras = message.payload
            after_layer = None if extras is None else role.before_forward(extras)
            model(input_ids, positions, caches, meta, after_layer=after_layer, rows=rows)
            if extras is not None:
                role.after_forward(extras)
    finally:
        if role is not None:
            role.close()
        if tiers is not None:
            tiers.close()
    logger.info("tensor parallel rank %d stopped", rank)


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _call(role, method: str, args: tuple) -> bool:
    """Run one of rank 0's calls on the role; False (logged) when it raised."""
    try:
        getattr(role, method)(*args)
        return True
    except Exception:
        logger.exception("tensor parallel call %s failed", method)
        return False


def run_follower(address: str, rank: int, size: int, key: bytes) -> None:
    """Serve as rank ``rank`` of ``size`` in the group whose store is at ``address``, signing
    with the group's ``key``, until rank 0 stops the group or dies."""
    watch_parent()
    serve(address, rank, size, Signer(key))
