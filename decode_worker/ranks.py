"""What the follower ranks of a tensor parallel decode worker do besides the forward: each
receives its own K/V heads of every reservation, straight from the prefill ranks that hold
them (docs/tensor-parallel.md).

1. Built in the follower before it answers ready: a sink over its pool that knows which of the
   model's K/V heads it holds and completes a key on its heads alone (the COMMIT goes to rank
   0), and a KV endpoint whose address it publishes as ``transfer-address``.
2. ``expect`` / ``forget``: rank 0 mirrors each reservation's start and end; each is a call
   every rank finishes before rank 0 goes on, so no frame can come before its reservation.
3. A key whose heads have all arrived is reported under ``kv/<transfer id>/<epoch>``: "" or the
   error. Rank 0 starts the request once its own heads, the COMMIT and every rank's report are
   in (``decode_worker.worker``).
"""

from __future__ import annotations

import logging

from pdserve.engine.tensor_parallel.group import RankContext
from pdserve.kv_transfer import ReservedBlocksSink, TransferEndpoint, TransferError, TransferKey
from pdserve.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)

TRANSFER_ADDRESS = "transfer-address"  # what each follower publishes: its KV endpoint


def report_name(key: TransferKey) -> str:
    return f"kv/{key.transfer_id}/{key.epoch}"


class DecodeRank:
    """A follower rank's receiving half (see the module docstring)."""

    def __init__(self, context: RankContext, host: str, join_token: str = ""):
        self.context = context
        first = TensorShard(context.rank, context.size).first_kv_head(context.model_config)
        self.sink = ReservedBlocksSink(context.caches, on_complete=self._complete,
                                       on_failure=self._failed, first_head=first,
                                       complete_on_heads=True)
        self.endpoint = TransferEndpoint(self.sink, host, 0, context.device,
                                         join_token=join_token)
        context.publish(TRANSFER_ADDRESS, self.endpoint.address)

    def expect(self, transfer_id: int, epoch: int, block_ids: list[int]) -> None:
        self.sink.expect(TransferKey(transfer_id, epoch), block_ids)

    def forget(self, transfer_id: int, epoch: int) -> None:
        self.sink.forget(TransferKey(transfer_id, epoch))

    def close(self) -> None:
        self.endpoint.close()
        self.sink.close()

    def _complete(self, key: TransferKey, _first_token_id: int | None,
                  _num_stand_ins: int) -> None:  # (the COMMIT, and its stand-ins, are rank 0's)
        self.context.report(report_name(key), "")

    def _failed(self, key: TransferKey, error: TransferError) -> None:
        logger.warning("rank %d: KV of %s failed: %s", self.context.rank, key, error)
        self.context.report(report_name(key), str(error) or type(error).__name__)
