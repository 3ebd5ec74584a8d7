"""The step cost model, the utilisation meter, and what the engine records into them."""

from __future__ import annotations

import pytest

from pdserve.engine.capacity.roofline import StepCost, UtilizationMeter, attended_pairs
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.worker_stats import engine_stats
from pdserve.models import ModelConfig
from pdserve.models.checkpoint import open_checkpoint
from pdserve.worker_api.sampling_params import SamplingParams
from pdserve.worker_api.stats import BANDWIDTH, COMPUTE, IDLE, binding


def _tiny_cost(tiny_dir) -> tuple[ModelConfig, StepCost]:
    # hidden 128, 4 layers, 4 heads x 32, 2 KV heads, I 256
    mc = open_checkpoint(tiny_dir).model_config
    return mc, StepCost.for_model(mc, weight_bytes=1000, kv_bytes_per_token=10)


def test_step_cost_by_hand(tiny_dir):
    mc, cost = _tiny_cost(tiny_dir)
    per_layer = 128 * (128 + 2 * 64) + 128 * 128 + 3 * 128 * 256  # q,k,v + o + gate/up/down
    assert cost.linear_params == 4 * per_layer
    assert cost.attention_flops_per_pair == 4 * 4 * 4 * 32
    assert cost.lm_head_flops_per_row == 2 * 512 * 128
    # a 5-token prompt from scratch: 15 (query, key) pairs, one sampled row
    assert cost.prefill(5) == (2 * 4 * per_layer * 5 + 2048 * 15 + 2 * 512 * 128, 1000 + 50)
    # decode: 3 sequences at context 7 (the new token included)
    assert cost.decode(3, 7) == (2 * 4 * per_layer * 3 + 2048 * 21 + 3 * 2 * 512 * 128,
                                 1000 + 210)
    assert attended_pairs([0, 6], [5, 1]) == 15 + 7


def test_meter_rates_busy_fraction_and_window():
    cost = StepCost(linear_params=50, attention_flops_per_pair=0, lm_head_flops_per_row=0,
                    weight_bytes=400, kv_bytes_per_token=0)
    meter = UtilizationMeter(cost, device=None, dtype=None, window_s=5.0)
    meter.record(10, 0, 0, 0, seconds=0.5, now=100.0)  # 1000 FLOPs, 400 bytes in 0.5 s
    meter.record(10, 0, 0, 0, seconds=0.5, now=102.0)
    util = meter.snapshot(now=102.0, peaks=(4000.0, 8000.0))
    assert util.flops_per_s == pytest.approx(2000.0) and util.bytes_per_s == pytest.approx(800)
    assert util.compute == pytest.approx(0.5) and util.bandwidth == pytest.approx(0.1)
    assert util.busy_fraction == pytest.approx(1.0 / 2.5)  # 1 s of forward in 99.5 .. 102
    assert util.binding == COMPUTE
    idle = meter.snapshot(now=200.0, peaks=(4000.0, 8000.0))  # the window has passed
    assert idle.flops_per_s == 0 and idle.binding == IDLE and idle.peak_flops_per_s == 4000
    assert binding(0.01, 0.3) == BANDWIDTH and binding(0.0, 0.0) == IDLE


def test_engine_records_each_forward_and_reports_it(tiny_dir):
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), dtype="float32", block_size=4,
                                           num_kv_blocks=64))
    meter = parts.runner.meter
    assert meter.cost.weight_bytes == parts.ledger.weight_bytes
    assert meter.cost.kv_bytes_per_token == parts.ledger.kv_bytes_per_token
    engine = LLMEngine(parts)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt
    prefill = meter._steps[-1]
    assert prefill[1:3] == meter.cost.prefill(5)
    engine.step()  # one decode step at context 6
    assert meter._steps[-1][1:3] == meter.cost.decode(1, 6)
    stats = engine_stats("w", "colocated", engine)
    assert stats.flops_per_s > 0 and stats.bytes_per_s > 0
    assert stats.peak_flops_per_s > 0 and stats.peak_bytes_per_s > 0
    assert stats.utilization.binding in (COMPUTE, BANDWIDTH)


def test_first_token_says_where_its_ttft_went(tiny_dir):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_dir), dtype="float32",
                                                block_size=4, num_kv_blocks=64))
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.render(engine.step()) if d.new_token_ids]
    first, *rest = deltas
    assert first.queue_time_s is not None and first.queue_time_s >= 0
    assert first.prefill_time_s is not None and first.prefill_time_s > 0
    assert all(d.queue_time_s is None and d.prefill_time_s is None for d in rest)
