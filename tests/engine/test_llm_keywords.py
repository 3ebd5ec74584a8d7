"""``LLM(...)`` takes every EngineConfig field as a keyword, and names a wrong one."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.worker_api.sampling_params import SamplingParams

# A valid value other than the default for every EngineConfig field but model.
NON_DEFAULTS = dict(dtype="float32", device="cpu", block_size=8, kv_cache_dtype="int8",
                    kv_int8_keep_edge_layers=True, kv_int8_scales="kivi", num_kv_blocks=40,
                    memory_budget_bytes=256 << 20, memory_safety_margin=0.1, max_num_seqs=4,
                    max_num_batched_tokens=64, max_model_len=64, enable_prefix_caching=False,
                    enable_chunked_prefill=False, attention_backend="torch", seed=7,
                    scheduling_policy="priority", prefix_cache_salt="salt", enforce_eager=True,
                    cpu_packed_gemm=False, admission_hold_s=0.5, prefill_batch_tokens=32,
                    step_timeout_s=120.0,
                    enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})
# Fields that do not combine with NON_DEFAULTS (tensor parallel refuses int8 KV, KV tiers need
# the prefix cache): each group set on its own.
ALONE = [dict(tensor_parallel_size=2),
         dict(kv_offload_cpu_gib=0.001, kv_offload_disk_gib=0.001, kv_offload_int8=True,
              kv_offload_dir=os.path.join(tempfile.gettempdir(), "pdserve-keywords-kv"))]


def test_every_engine_config_field_is_an_llm_keyword(tiny_dir):
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    alone = {name: value for group in ALONE for name, value in group.items()}
    assert set(NON_DEFAULTS) | set(alone) == names, "give the new EngineConfig field a value here"
    defaults = EngineConfig(model=str(tiny_dir))
    for name, value in {**NON_DEFAULTS, **alone}.items():
        assert getattr(defaults, name) != value, name
    llm = LLM(tiny_dir, **NON_DEFAULTS)
    assert llm.engine.parts.config == EngineConfig(model=str(tiny_dir), **NON_DEFAULTS)
    assert llm.memory_ledger.num_kv_blocks == 40 and llm.memory_ledger.block_size == 8
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 3
    for group in ALONE:
        with LLM(tiny_dir, **group) as llm_alone:
            for name, value in group.items():
                assert getattr(llm_alone.engine.parts.config, name) == value


def test_wrong_keyword_is_a_value_error_naming_it_and_the_valid_ones(tiny_dir):
    with pytest.raises(ValueError) as exc:
        LLM(tiny_dir, block_sise=8, gpu_memory_utilization=0.9)
    message = str(exc.value)
    assert "block_sise" in message and "gpu_memory_utilization" in message
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":
            assert f.name in message, f.name


def test_bad_keyword_value_is_a_value_error_naming_the_field(tiny_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_dir, block_size=0)
