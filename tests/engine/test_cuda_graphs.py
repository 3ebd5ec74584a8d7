"""Decode CUDA graphs (engine/step/cuda_graphs.py): padded static buffers give the eager logits.

On every machine the graphs are built with ``eager_capture`` (the replay calls the forward on
the static buffers), which checks the buffer plumbing, the batch-size ladder and the padding
rows against the eager forward. Where CUDA is present, a real capture must give the same
greedy tokens as ``enforce_eager=True``.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.cuda_graphs import DecodeGraphs, eager_capture
from pdserve.worker_api.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[(5 * i + j) % 300 + 1 for j in range(3 + i % 7)] for i in range(n)]


def _generate(engine: LLMEngine, prompts) -> dict[str, list[int]]:
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            out[delta.request_id] += delta.new_token_ids
    return out


def test_graph_replays_equal_the_eager_engine_on_every_batch_size(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), num_kv_blocks=128, max_num_seqs=20,
                          max_model_len=64)
    eager = _generate(LLMEngine(EngineParts.build(config)), _prompts(11))
    parts = EngineParts.build(config)
    parts.capture_decode_graphs(capture=eager_capture)
    graphs = parts.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8, 16, 20] and graphs.scratch_block == 127
    assert parts.block_manager.num_blocks == 127  # the scratch block is never handed out
    replayed = []
    run = graphs.run
    graphs.run = lambda ids, pos, meta: replayed.append(len(ids)) or run(ids, pos, meta)
    engine = LLMEngine(parts)
    assert _generate(engine, _prompts(11)) == eager
    assert replayed and max(replayed) == 11  # padded to the 16-row graph
    assert parts.block_manager.num_used_blocks == 0
    parts.block_manager.check_invariants()


def test_padding_rows_touch_only_the_scratch_block(tiny_dir):
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), num_kv_blocks=32,
                                           max_num_seqs=8, max_model_len=64))
    parts.capture_decode_graphs(capture=eager_capture)
    engine = LLMEngine(parts)
    for i, prompt in enumerate(_prompts(3)):
        engine.add_request(f"p{i}", prompt, GREEDY)
    engine.step()  # the prompts (eager: not a pure decode step)
    before = [layer.kv.clone() for layer in parts.runner.kv_caches]
    engine.step()  # 3 decodes replayed on the 4-row graph: one padding row
    scratch = parts.runner.graphs.scratch_block
    used = {b for seq in engine.scheduler.running for b in seq.block_table}
    for old, layer in zip(before, parts.runner.kv_caches, strict=True):
        changed = (old != layer.kv).flatten(2).any(dim=2).any(dim=0)  # (num_blocks,) per block
        assert set(torch.nonzero(changed).flatten().tolist()) <= used | {scratch}
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)


def test_cpu_engines_never_capture(tiny_dir):
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), num_kv_blocks=16))
    assert parts.runner.graphs is None


def test_a_batch_wider_than_the_largest_graph_runs_eagerly(tiny_dir):
    parts = EngineParts.build(EngineConfig(model=str(tiny_dir), num_kv_blocks=64,
                                           max_num_seqs=8, max_model_len=64))
    graphs = DecodeGraphs(parts.runner.model, parts.runner.kv_caches, 16, parts.runner.device,
                          parts.runner.backend, 64, 4, scratch_block=63, capture=eager_capture)
    ids = torch.zeros(5, dtype=torch.int64)
    meta = type("Meta", (), {"is_decode_only": True, "max_context_len": 3,
                             "block_tables": torch.zeros(5, 1)})()
    assert not graphs.fits(ids, meta)
    assert graphs.fits(ids[:4], meta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_equal_eager_greedy(tiny_dir):
    pytest.importorskip("triton")
    base = dict(model=str(tiny_dir), device="cuda", num_kv_blocks=256, max_num_seqs=32,
                max_model_len=128)
    eager = _generate(LLMEngine(EngineParts.build(EngineConfig(**base, enforce_eager=True))),
                      _prompts(13))
    parts = EngineParts.build(EngineConfig(**base))
    assert parts.runner.graphs is not None
    assert _generate(LLMEngine(parts), _prompts(13)) == eager
