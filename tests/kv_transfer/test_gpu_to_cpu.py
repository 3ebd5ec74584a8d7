"""KV from a GPU pool to a CPU pool: the sender, NCCL by default on CUDA, follows the CPU
endpoint's gloo and stages each payload through host memory. Needs a CUDA device (run by
bench/device_check.sh); the CPU half of the same path, the backend following, runs everywhere
(test_torch_dist.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import KVCacheLayer
from pdserve.kv_transfer import TorchDistConnector, TransferEndpoint, TransferKey

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_blocks_arrive_in_a_cpu_pool(kv, no_thread_leak):
    src = [KVCacheLayer(c.kv.cuda()) for c in kv.make_pool(40)]
    dst = kv.make_pool(41)
    sink = kv.RecordingSink(dst)
    endpoint = TransferEndpoint(sink, config=kv.FAST)
    connector = TorchDistConnector("prefill-gpu", device="cuda", config=kv.FAST)
    try:
        key, src_ids, dst_ids = TransferKey(5, 1), [3, 7, 1], [2, 9, 4]
        sink.expect(key, dst_ids)
        kv.send_request(connector.sender(endpoint.address), key, src,
                        torch.tensor(src_ids, device="cuda"), first_token=11)
        assert sink.wait(lambda s: key in s.completed, 30)
        on_host = [KVCacheLayer(c.kv.cpu()) for c in src]
        assert kv.blocks_equal(on_host, src_ids, dst, dst_ids)
    finally:
        connector.close()
        endpoint.close()
