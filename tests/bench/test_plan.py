"""``pdserve plan`` against hand-computed values, and planner blocks against engine blocks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.bench.plan import GiB, Hardware, PlanRequest, accelerators, make_plan
from pdserve.cli.main import main

LLAMA2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
                 hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                 torch_dtype="float16")
LLAMA3_8B = dict(LLAMA2_7B, vocab_size=128256, intermediate_size=14336, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, torch_dtype="bfloat16")


def _config_dir(tmp_path: Path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))  # no weights: config.json alone
    return str(folder)


def test_the_seeds_7b_example(tmp_path):
    model = _config_dir(tmp_path, "llama2-7b", LLAMA2_7B)
    hw = Hardware("80 GiB", 80 * GiB, 2.0e12, 312e12, "test")
    plan = make_plan(PlanRequest(model, dtype="float16", activation_reserve_bytes=10 * GiB,
                                 avg_context=4096), hw)
    assert plan["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288
    assert plan["num_parameters"] == 6_738_415_616  # Llama-2-7B
    assert plan["weight_bytes"] == 2 * 6_738_415_616
    assert plan["weights_counted_from"] == "config parameter count"
    pool = 80 * GiB - 2 * 6_738_415_616 - 10 * GiB  # 57.45 GiB
    assert plan["num_kv_blocks"] == pool // (16 * 524_288)
    assert plan["max_batch_theoretical"] == 28 and plan["max_batch"] == 22
    # decode at batch 22 x 4096 tokens: memory-bound, (weights + KV) / bandwidth
    kv = 22 * 4096 * 524_288
    assert plan["decode_step_ms"] == pytest.approx((2 * 6_738_415_616 + kv) / 2.0e12 * 1e3)
    assert plan["binding"] == {"prefill": "compute", "decode": "bandwidth"}
    # prefill of 1000 tokens at MFU 0.5: linear layers + causal attention + one logits row
    linear = 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008)
    flops = 2 * linear * 1000 + 4 * 32 * 32 * 128 * (1000 * 1001 // 2) + 2 * 32000 * 4096
    assert plan["prefill_ms_per_1k_tokens"] == pytest.approx(flops / (312e12 * 0.5) * 1e3)


def test_gqa_int8_kv_and_worker_counts(tmp_path):
    model = _config_dir(tmp_path, "llama3-8b", LLAMA3_8B)
    h100 = accelerators()["H100"]
    assert h100.bandwidth_bytes_per_s == 3.35e12 and h100.peak_flops_per_s == 989e12
    plan = make_plan(PlanRequest(model, dtype="bfloat16", kv_cache_dtype="int8",
                                 kv_int8_keep_edge_layers=True,
                                 activation_reserve_bytes=8 * GiB, rate=4.0, isl=2048,
                                 osl=512), h100)
    # 30 int8 layers (K and V, 8 heads x 128, plus fp16 token scales for K and V per head)
    # and the first and last layers kept in bf16
    per_token = 30 * (2 * 8 * 128 + 2 * 8 * 2) + 2 * (2 * 8 * 128 * 2)
    assert plan["kv_bytes_per_token"] == per_token == 70_592
    everywhere = make_plan(PlanRequest(model, dtype="bfloat16", kv_cache_dtype="int8",
                                       kv_int8_keep_edge_layers=False), h100)
    assert everywhere["kv_bytes_per_token"] == 32 * (2 * 8 * 128 + 2 * 8 * 2)
    assert plan["num_parameters"] == 8_030_261_248  # Llama-3-8B
    assert plan["avg_context"] == 2048 + 256
    pool = plan["num_kv_blocks"] * 16 * per_token
    assert plan["num_kv_blocks"] == (h100.memory_bytes - 2 * 8_030_261_248 - 8 * GiB) \
        // (16 * per_token)
    theoretical = pool // (2304 * per_token)
    assert plan["max_batch_theoretical"] == theoretical
    assert plan["max_batch"] == math.floor(0.8 * theoretical)
    # workers: prefill at 80 % busy; decode by Little's law over max_batch per worker
    prefill_s = plan["prefill_s_per_request"]
    assert plan["num_prefill_workers"] == math.ceil(4.0 * prefill_s / 0.8)
    decoding = 4.0 * 512 * plan["decode_step_ms"] / 1e3
    assert plan["requests_decoding"] == pytest.approx(decoding)
    assert plan["num_decode_workers"] == max(1, math.ceil(decoding / plan["max_batch"]))
    assert plan["pd_ratio"] == f"{plan['num_prefill_workers']}:{plan['num_decode_workers']}"


def test_tensor_parallel_plans_one_rank(tmp_path, capsys):
    """Llama-3-8B at TP=2 on H100s: each rank holds half of every layer's linear weights and
    4 of the 8 K/V heads (embedding, head and norms whole), so more requests fit per rank."""
    model = _config_dir(tmp_path, "llama3-8b", LLAMA3_8B)
    h100 = accelerators()["H100"]
    req = dict(dtype="bfloat16", activation_reserve_bytes=8 * GiB, rate=4.0, isl=2048, osl=512)
    one = make_plan(PlanRequest(model, **req), h100)
    two = make_plan(PlanRequest(model, tensor_parallel_size=2, **req), h100)
    h, i, v, kv = 4096, 14336, 128256, 1024
    linear = h * h + 2 * kv * h + h * h + 3 * h * i
    assert two["weight_bytes"] == 2 * (2 * v * h + h + 32 * (linear // 2 + 2 * h))
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2 == 32 * 2 * 4 * 128 * 2
    assert two["num_parameters"] == one["num_parameters"]  # the model's, not the rank's
    assert two["max_batch"] > 2 * one["max_batch"]  # half the KV per token, more free memory
    assert two["num_devices"] == 2 * (two["num_prefill_workers"] + two["num_decode_workers"])
    assert main(["plan", "--model", model, "--device", "H100", "--dtype", "bfloat16",
                 "--tensor-parallel-size", "2"]) == 0
    assert "2 devices per worker" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", model, "--device", "H100", "--tensor-parallel-size", "3"])
    assert exc.value.code == 2
    assert "tensor_parallel_size (3) must divide the model's num_attention_heads (32)" \
        in capsys.readouterr().err


@pytest.mark.parametrize(("kv_cache_dtype", "tensor_parallel_size"),
                         [("auto", 1), ("int8", 1), ("auto", 2)])
def test_planner_blocks_equal_engine_blocks(tiny_dir, kv_cache_dtype, tensor_parallel_size):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.parts import EngineParts

    budget = 96 << 20
    engine = EngineParts.build(EngineConfig(model=str(tiny_dir), dtype="float32", block_size=8,
                                            kv_cache_dtype=kv_cache_dtype, device="cpu",
                                            memory_budget_bytes=budget,
                                            max_num_batched_tokens=256,
                                            tensor_parallel_size=tensor_parallel_size))
    engine.close()  # (the ledger is rank 0's plan; the ranks are not needed)
    hw = Hardware("this CPU", budget, 1e10, 1e11, "test", device="cpu")
    plan = make_plan(PlanRequest(str(tiny_dir), dtype="float32", block_size=8,
                                 kv_cache_dtype=kv_cache_dtype,
                                 memory_safety_margin=engine.config.memory_safety_margin,
                                 max_num_batched_tokens=256,
                                 tensor_parallel_size=tensor_parallel_size), hw)
    ledger = engine.ledger
    assert plan["weight_bytes"] == ledger.weight_bytes
    assert plan["activation_reserve_bytes"] == ledger.activation_bytes
    assert plan["kv_bytes_per_token"] == ledger.kv_bytes_per_token
    assert plan["num_kv_blocks"] == ledger.num_kv_blocks
    assert plan["kv_pool_bytes"] == ledger.kv_pool_bytes


def test_plan_json_keys_from_the_command_line(tmp_path, capsys):
    model = _config_dir(tmp_path, "llama2-7b", LLAMA2_7B)
    assert main(["plan", "--model", model, "--device", "A100-80GB", "--dtype", "float16",
                 "--activation-reserve-gib", "10", "--avg-context", "4096", "--rate", "2",
                 "--isl", "1024", "--osl", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("kv_bytes_per_token", "weight_bytes", "kv_pool_bytes", "max_batch_theoretical",
                "max_batch", "decode_step_ms", "prefill_ms_per_1k_tokens", "binding",
                "num_prefill_workers", "num_decode_workers", "pd_ratio"):
        assert key in plan
    assert plan["max_batch_theoretical"] == 28 and plan["max_batch"] == 22
    assert main(["plan", "--model", model, "--device", "H100", "--dtype", "float16"]) == 0
    text = capsys.readouterr().out
    assert "bandwidth-bound" in text and "compute-bound" in text and "KV bytes per token" in text


@pytest.mark.parametrize("argv, message", [
    (["--device", "TPUv9"], "device must be one of"),
    (["--hbm-gbps", "100"], "give all three"),
    (["--rate", "2"], "rate, isl and osl go together"),
    (["--device", "H100", "--measure"], "--measure profiles this machine"),
    # no hardware named: asked for, never measured unasked (that took minutes, in float16)
    ([], "argument --device: name the hardware to plan for (H200, H100"),
    (["--hbm-gib", "80", "--rate", "2", "--isl", "512", "--osl", "128"],
     "argument --rate: the worker counts need the device's speed"),
])
def test_plan_user_errors_exit_2(tmp_path, capsys, argv, message):
    model = _config_dir(tmp_path, "m", LLAMA2_7B)
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", model, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("hbm_gib, matches", [(80, "H100, A100-80GB"),
                                               (33, "no card in the catalogue")])
def test_plan_of_a_memory_alone_gives_the_memory_answer(tmp_path, capsys, hbm_gib, matches):
    """--hbm-gib without --device: what fits (weights, KV pool, batch) needs only the memory;
    the time estimates, which need the device's speed, say how to get them."""
    model = _config_dir(tmp_path, "llama2-7b", LLAMA2_7B)
    assert main(["plan", "--model", model, "--hbm-gib", str(hbm_gib), "--dtype", "float16",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hardware"]["memory_bytes"] == hbm_gib * GiB and matches in \
        plan["hardware"]["source"]
    assert plan["num_kv_blocks"] > 0 and plan["max_batch"] > 0
    assert plan["decode_step_ms"] is None and plan["prefill_ms_per_1k_tokens"] is None
    if hbm_gib == 80:  # the same memory answer as naming the card of that memory
        assert main(["plan", "--model", model, "--device", "A100-80GB", "--dtype", "float16",
                     "--json"]) == 0
        with_card = json.loads(capsys.readouterr().out)
        assert (with_card["num_kv_blocks"], with_card["max_batch"]) == (
            plan["num_kv_blocks"], plan["max_batch"])
    assert main(["plan", "--model", model, "--hbm-gib", str(hbm_gib), "--dtype",
                 "float16"]) == 0
    text = capsys.readouterr().out
    decode = next(line for line in text.splitlines() if line.startswith("decode step"))
    assert "needs the device's speed" in decode and "--device NAME" in decode
    assert "KV pool" in text


def test_plan_takes_the_one_card_of_the_given_memory(tmp_path, capsys):
    model = _config_dir(tmp_path, "llama2-7b", LLAMA2_7B)
    assert main(["plan", "--model", model, "--hbm-gib", "141", "--dtype", "float16",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hardware"]["name"] == "H200" and "141 GiB card" in plan["hardware"]["source"]


def test_plan_prints_no_time_nobody_can_act_on(tmp_path, capsys):
    """A device that computes at ~nothing (float16 on a CPU measured 0.0 TFLOPS) gets a line
    saying why and what to do, not a decode step of 1.74e+06 ms."""
    model = _config_dir(tmp_path, "llama2-7b", LLAMA2_7B)
    assert main(["plan", "--model", model, "--hbm-gib", "80", "--hbm-gbps", "50",
                 "--tflops", "0.000001", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    decode = next(line for line in out.splitlines() if line.startswith("decode step"))
    assert "not servable" in decode and "--device NAME" in decode and " ms at batch" not in decode


def test_plan_measure_holds_the_plan_against_this_machine(tiny_dir, capsys):
    assert main(["plan", "--model", str(tiny_dir), "--device", "cpu", "--hbm-gib", "0.25",
                 "--avg-context", "64", "--measure", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {r["what"].split(",")[0]: r for r in plan["measured"]["rows"]}
    assert rows["KV blocks for the budget"]["measured"] == plan["num_kv_blocks"] > 0
    assert rows["weights"]["measured"] == plan["weight_bytes"]
    assert plan["margin_bytes"] == int(0.25 * GiB * 0.05)  # --measure plans the engine's margin
    for name in ("decode forward", "decode step", "prefill forward"):
        assert rows[name]["measured"] > 0 and rows[name]["predicted"] > 0
