"""What the follower ranks of a tensor parallel prefill worker do besides the forward: each
ships its own K/V heads of the prompts a step completes, straight to the decode ranks that hold
them (docs/tensor-parallel.md).

Rank 0 hands each step's shipments to its followers with the batch (the forward's extras): the
layer frames, and per prompt the reservation's key, the decode worker's rank endpoints and the
blocks. As each frame of layers is written, every rank packs the heads it is to send
(``models.tensor_parallel.head_routes``) and queues them on its channel to each decode rank;
after the forward it closes its share of each key on those channels. Rank 0 sends the COMMIT
(token 0) to the decode worker's rank 0, marked sharded: the decode side starts the request once
every head of every layer is in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.tensor_parallel.group import RankContext
from pdserve.kv_transfer import KVSender, TorchDistConnector, TransferKey, pack_layers
from pdserve.models.config import ModelConfig
from pdserve.models.tensor_parallel import TensorShard, head_routes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shipment:
    """One prompt's KV, as every rank of the prefill group ships its share of it."""

    transfer_id: int  # the reservation's key
    epoch: int
    addresses: tuple[str, ...]  # the decode worker's rank endpoints, in rank order
    block_ids: tuple[int, ...]  # the prompt's blocks (the same ids on every rank)

    @property
    def key(self) -> TransferKey:
        return TransferKey(self.transfer_id, self.epoch)


@dataclass(frozen=True)
class StepShipments:
    """A step's extras for the followers: its layer frames and its shipments."""

    frames: tuple[tuple[int, int], ...]  # [start, end) layer ranges, in order
    shipments: tuple[Shipment, ...]


class Routes:
    """Where one rank's heads of a prompt go: ``[(sender, heads)]`` with the heads in the
    model's numbering (None: the whole pool, when neither side is split)."""

    def __init__(self, model_config: ModelConfig, shard: TensorShard, connector,
                 addresses: tuple[str, ...]):
        self.first_head = shard.first_kv_head(model_config)
        self.sharded = shard.size > 1 or len(addresses) > 1
        if not self.sharded:
            self.sends: list[tuple[KVSender, tuple[int, int] | None]] = [
                (connector.sender(addresses[0]), None)]
        else:
            self.sends = [(connector.sender(addresses[rank]), heads)
                          for rank, heads in head_routes(model_config, shard, len(addresses))]

    def ship(self, key: TransferKey, caches, block_ids: torch.Tensor, start: int,
             end: int) -> tuple[list, int]:
        """Pack and queue layers ``[start, end)`` on every route; the frames' futures and the
        bytes queued."""
        frames, nbytes = [], 0
        for sender, heads in self.sends:
            local = None if heads is None else (heads[0] - self.first_head,
                                                heads[1] - self.first_head)
            payload = pack_layers(caches, block_ids, start, end, heads=local)
            nbytes += payload.numel() * payload.element_size()
            frames.append(sender.send_layers(key, start, end, payload,
                                             num_blocks=block_ids.numel(), heads=heads))
        return frames, nbytes

    def end_shares(self, key: TransferKey, skip: int = 0) -> list:
        """Close this rank's share of ``key`` on its routes after the first ``skip`` (rank 0
        skips the decode rank 0 channel, where its COMMIT goes); the frames' futures."""
        return [sender.send_share(key) for sender, _heads in self.sends[skip:]]


class PrefillRank:
    """A follower rank's shipping half (see the module docstring)."""

    def __init__(self, context: RankContext, worker_id: str, host: str, join_token: str = ""):
        self.context = context
        self.shard = TensorShard(context.rank, context.size)
        self.connector = TorchDistConnector(f"{worker_id}.rank{context.rank}", host,
                                            context.device, join_token=join_token)
        self._plans: list = []  # the current step's (key, block ids, routes)

    def before_forward(self, step: StepShipments):
        ends = {end - 1: (start, end) for start, end in step.frames}
        plans = [(s.key, torch.tensor(s.block_ids, dtype=torch.int64, device=self.context.device),
                  Routes(self.context.model_config, self.shard, self.connector, s.addresses))
                 for s in step.shipments]

        def after_layer(layer: int) -> None:
            if layer in ends:
                for key, block_ids, routes in plans:
                    routes.ship(key, self.context.caches, block_ids, *ends[layer])

        self._plans = plans
        return after_layer

    def after_forward(self, step: StepShipments) -> None:
        for key, _ids, routes in self._plans:
            routes.end_shares(key)
        self._plans = []

    def close(self) -> None:
        self.connector.close()
