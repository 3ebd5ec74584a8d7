"""In-process prefill + decode workers over the in-process transport (no Ray, no Redis)."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import FaultPlan
from pdserve.worker_api import WorkRequest
from pdserve.workers.build import InProcTransfer, build_worker


def engine_config(model_dir, **overrides) -> EngineConfig:
    base = dict(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                max_num_batched_tokens=64)
    return EngineConfig(**{**base, **overrides})


class Pair:
    """One prefill and one decode worker wired through an in-process hub."""

    def __init__(self, model_dir, fault_plan: FaultPlan | None = None, lease_s: float = 30.0,
                 prefill_kwargs: dict | None = None, decode_blocks: int = 128, **cfg):
        transfer = InProcTransfer(fault_plan=fault_plan)
        name = uuid.uuid4().hex[:8]
        self.decode = build_worker("decode", f"d-{name}", engine_config(
            model_dir, num_kv_blocks=decode_blocks, **cfg), transfer, lease_s=lease_s)
        self.prefill = build_worker("prefill", f"p-{name}", engine_config(model_dir, **cfg),
                                    transfer, prefill_kwargs=prefill_kwargs)

    def generate(self, request_id: str, prompt: list[int], params, timeout: float = 60.0):
        """Run one request through reserve -> prefill -> decode; returns (tokens, reason)."""
        request = WorkRequest(request_id, list(prompt), params, seed=1234, arrival_time=time.time())
        reservation = self.decode.reserve(request).result(timeout)
        result = self.prefill.prefill(request, reservation).result(timeout)
        self.last = (reservation, result)  # what the last request reserved and sent
        first = result.first
        if first.finish_reason is not None:
            self.decode.abort(request_id).result(timeout)
            return list(first.new_token_ids), first.finish_reason
        return self.follow(request_id, first, timeout)

    def follow(self, request_id: str, first, timeout: float = 60.0):
        """The decode worker's deltas of ``request_id`` after its ``first`` one, until it
        finishes or ``timeout`` passes; returns (tokens, reason)."""
        tokens, reason = list(first.new_token_ids), first.finish_reason
        deadline = time.monotonic() + timeout
        while reason is None and time.monotonic() < deadline:
            for delta in self.decode.poll(0.2):
                assert delta.request_id == request_id
                tokens += delta.new_token_ids
                reason = delta.finish_reason
        return tokens, reason

    def used_blocks(self) -> tuple[int, int]:
        p, d = self.prefill.stats().result(10), self.decode.stats().result(10)
        return p.used_blocks, d.used_blocks

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def make_pair():
    pairs = []

    def make(model_dir, **kwargs) -> Pair:
        pairs.append(Pair(model_dir, **kwargs))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()
