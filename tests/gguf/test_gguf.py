"""GGUF loading: config, weights (F32, F16, Q8_0, Q4_0), tokenizer, errors, the serving path.

Greedy tokens are compared with transformers' own GGUF loading where it reads the file right,
and with the original safetensors model where it does not: transformers ignores a qwen3 file's
``attention.key_length`` (head_dim != hidden / heads), a llama file's ``attention.sliding_window``
and the ``rope_freqs`` tensor of Llama 3.1 scaling; llama.cpp, and we, read all three.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.models import load_model
from pdserve.models.checkpoint import open_checkpoint

PROMPTS = [list(range(3, 40)), [7, 300, 11, 42, 99, 5, 5, 17, 250, 480, 1]]
MAX_TOKENS = 8


def _ours(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=48, block_size=4, **kwargs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _transformers(model) -> list[list[int]]:
    """Greedy continuation by transformers' forward (no eos handling: ignore_eos above)."""
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-tied", "qwen3-qknorm",
                                  "mistral-window", "llama3-rope"])
def test_config_and_f32_weights_equal_the_safetensors_checkpoint(name, gguf_file, hf_checkpoint):
    path = gguf_file(name, name=f"tiny {name}")
    ref_dir = hf_checkpoint(name)
    ours, ref = open_checkpoint(path).model_config, open_checkpoint(ref_dir).model_config
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias",
                  "o_proj_bias", "qk_norm", "sliding_window", "bos_token_id"):
        assert getattr(ours, field) == getattr(ref, field), field
    # every tensor equal to the original, so the q/k row permutation was undone exactly
    a, b = load_model(path).state_dict(), load_model(ref_dir).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("name", "qtype"), [("llama-gqa", "F32"), ("llama-gqa", "F16"),
                                             ("llama-gqa", "Q8_0"), ("qwen2-bias-tied", "Q8_0"),
                                             ("llama-mha-odd", "Q4_0")])
def test_greedy_equals_transformers_gguf_loading(name, qtype, gguf_file, hf_gguf_model):
    path = gguf_file(name, qtype)
    assert _ours(path) == _transformers(hf_gguf_model(path))


@pytest.mark.parametrize("name", ["qwen3-qknorm", "mistral-window", "llama3-rope"])
def test_greedy_equals_the_original_where_transformers_misreads_the_file(name, gguf_file,
                                                                          hf_checkpoint,
                                                                          hf_model):
    path = gguf_file(name, name=f"tiny {name}")
    assert _ours(path) == _transformers(hf_model(hf_checkpoint(name)))


def test_quantized_weights_are_the_dequantized_values(gguf_file):
    import gguf

    path = gguf_file("llama-gqa", "Q8_0")
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
    model = load_model(path)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expected)
    assert "Q8_0" in model.weights_source


TEXTS = ["Hello world", " leading space", "The quick brown fox jumps over the lazy dog.",
         "  two  spaces\n\nnew lines\ttabs", "naïve café 日本語 🙂 emoji", "<s>special</s> inside",
         "def f(x):\n    return x**2  # code", "1234567 3.14159 2024-05-17 it's we'll",
         " ", "UPPER lower MiXeD", "</s>", "a" * 40]


@pytest.mark.parametrize(("kind", "pre"), [("gpt2", "default"), ("gpt2", "llama-bpe"),
                                           ("gpt2", "qwen2"), ("llama", "default")])
def test_tokenizer_matches_transformers(kind, pre, gguf_file):
    from transformers import AutoTokenizer

    path = gguf_file("llama-gqa", tokenizer=kind, pre=pre, chat_template="{{ messages }}")
    ours = open_checkpoint(path.parent).tokenizer()  # the folder holding the one .gguf
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False), text
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    assert ours.chat_template == ref.chat_template == "{{ messages }}"


def test_folder_and_file_serve_alike_and_ledger_names_the_types(gguf_file, tmp_path):
    from pdserve.engine.capacity.budget_check import check_engine_fits

    path = gguf_file("llama-gqa", "Q8_0")
    llm = LLM(str(path.parent), num_kv_blocks=16, block_size=4)
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
    weights = dict(llm.memory_ledger.rows())["weights"]
    assert "GGUF Q8_0" in weights and "dequantized to float32" in weights
    # the CLI's preflight plans a GGUF like a checkpoint folder, and as the worker does
    budget = 64 << 20
    planned = check_engine_fits(EngineConfig(model=str(path), memory_budget_bytes=budget))
    worker = LLM(str(path), memory_budget_bytes=budget).memory_ledger.num_kv_blocks
    assert planned == worker


def test_errors_name_what_is_unsupported(gguf_file, tmp_path):
    import gguf
    import numpy as np

    with pytest.raises(FileNotFoundError, match="does not exist"):
        _ = open_checkpoint(tmp_path / "missing.gguf").model_config
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_file("llama-gqa"), two / name)
    with pytest.raises(ValueError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_model(two)

    def write(name: str, arch: str, tensors: dict) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        writer.add_block_count(1)
        for key, array in tensors.items():
            writer.add_tensor(key, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / name)

    with pytest.raises(ValueError, match=r"unsupported GGUF architecture.*'gpt2'"):
        _ = open_checkpoint(write("gpt2.gguf", "gpt2", {})).model_config
    ints = write("ints.gguf", "llama", {"token_embd.weight": np.zeros((8, 4), np.int32)})
    with pytest.raises(ValueError, match="has type I32, which the gguf package cannot"):
        from pdserve.models.gguf import GGUFCheckpoint

        GGUFCheckpoint(ints).inventory()
