"""A prefill-side process for test_torch_dist: `python prefill_child.py ADDRESS SEED`.

Builds the P pool from SEED, sends request (1, 1) in full (commit token 11) and request (2, 1)
without its last layer and commit, flushes, prints SENT and then waits to be killed."""

from __future__ import annotations

import sys
import time

import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer import ChannelConfig, TorchDistConnector, TransferKey, pack_layers

SRC_IDS = torch.tensor([2, 5, 9], dtype=torch.int64)


def main() -> None:
    address, seed = sys.argv[1], int(sys.argv[2])
    gen = torch.Generator().manual_seed(seed)
    pool = [KVCacheLayer(torch.randn((2, 16, 4, 2, 8), generator=gen)) for _ in range(4)]
    config = ChannelConfig(peer_timeout_s=3.0, connect_timeout_s=10.0, heartbeat_s=0.2)
    connector = TorchDistConnector("prefill-child", config=config)
    sender = connector.sender(address)
    full, partial = TransferKey(1, 1), TransferKey(2, 1)
    for layer in range(4):
        sender.send_layers(full, layer, layer + 1, pack_layers(pool, SRC_IDS, layer, layer + 1))
    sender.send_commit(full, 11)
    for layer in range(3):
        sender.send_layers(partial, layer, layer + 1,
                           pack_layers(pool, SRC_IDS, layer, layer + 1))
    sender.flush(10)
    print("SENT", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
