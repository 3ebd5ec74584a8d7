"""In-process prefill + decode workers over the in-process transport (no Ray, no Redis)."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.parts import EngineParts
from pdserve.engine.protocol import WorkRequest
from pdserve.kv_transfer import FaultPlan, InProcConnector, InProcEndpoint, InProcHub
from pdserve.prefill_worker.worker import PrefillWorker


def engine_config(model_dir, **overrides) -> EngineConfig:
    base = dict(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                max_num_batched_tokens=64)
    return EngineConfig(**{**base, **overrides})


class Pair:
    """One prefill and one decode worker wired through an in-process hub."""

    def __init__(self, model_dir, fault_plan: FaultPlan | None = None, lease_s: float = 30.0,
                 prefill_kwargs: dict | None = None, decode_blocks: int = 128, **cfg):
        self.hub = InProcHub()
        name = uuid.uuid4().hex[:8]
        dcfg = DecodeWorker.config_for(engine_config(model_dir, num_kv_blocks=decode_blocks,
                                                     **cfg))
        self.decode = DecodeWorker(f"d-{name}", EngineParts.build(dcfg),
                                   lambda sink: InProcEndpoint(self.hub, f"d-{name}", sink),
                                   lease_s=lease_s)
        self.prefill = PrefillWorker(
            f"p-{name}", EngineParts.build(PrefillWorker.config_for(engine_config(model_dir,
                                                                                 **cfg))),
            InProcConnector(self.hub, f"p-{name}", fault_plan=fault_plan),
            **(prefill_kwargs or {}))

    def generate(self, request_id: str, prompt: list[int], params, timeout: float = 60.0):
        """Run one request through reserve -> prefill -> decode; returns (tokens, reason)."""
        request = WorkRequest(request_id, list(prompt), params, seed=1234, arrival_time=time.time())
        reservation = self.decode.reserve(request).result(timeout)
        first = self.prefill.prefill(request, reservation).result(timeout).first
        tokens, reason = list(first.new_token_ids), first.finish_reason
        if reason is not None:
            self.decode.abort(request_id).result(timeout)
            return tokens, reason
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
