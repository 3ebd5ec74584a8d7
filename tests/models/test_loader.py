"""load_model: error messages, sharded checkpoints, both RoPE config styles, dtypes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.kernels import KVCacheLayer
from pdserve.models import load_model
from pdserve.models.attention import AttentionMetadata

PROMPT = [1, 17, 42, 300, 5, 5, 9, 250, 77, 3, 8]


def run_prefill(model, prompt=PROMPT) -> torch.Tensor:
    """Logits (len, vocab) of one prompt through a small contiguous paged pool."""
    cfg = model.config
    n = len(prompt)
    caches = [KVCacheLayer(torch.zeros(cfg.kv_cache_shape(4, 4), dtype=model.dtype))
              for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(4, dtype=torch.int32)[None], max_query_len=n,
        max_context_len=n, backend="torch")
    return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))


@pytest.fixture
def llama_copy(hf_checkpoint, tmp_path):
    """A writable copy of the llama-gqa checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("llama-gqa"), dst)
    return dst


def _edit_weights(path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_model(llama_copy)


def test_shape_mismatch_names_tensor_and_file(llama_copy):
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_weights(llama_copy, lambda t: t.__setitem__(name, t[name][:-1].contiguous()))
    with pytest.raises(ValueError, match=rf"{name}.*model\.safetensors.*shape"):
        load_model(llama_copy)


def test_unexpected_and_missing_tensor(llama_copy):
    _edit_weights(llama_copy, lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_model(llama_copy)
    _edit_weights(llama_copy, lambda t: (t.pop("model.extra.weight"),
                                         t.pop("model.layers.0.mlp.up_proj.weight")))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model(llama_copy)


def test_unsupported_architecture(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2.*GPT2LMHeadModel.*llama, mistral, qwen2, qwen3"):
        load_model(llama_copy)


def test_unsupported_dtype(hf_checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        load_model(hf_checkpoint("llama-gqa"), dtype=torch.int8)


def test_sharded_equals_unsharded(hf_checkpoint):
    single = hf_checkpoint("qwen3-qknorm")
    sharded = hf_checkpoint("qwen3-qknorm", max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(run_prefill(load_model(single)), run_prefill(load_model(sharded)))


def test_sharded_missing_shard(hf_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("qwen3-qknorm", max_shard_size="100KB"), dst)
    victim = sorted(dst.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(dst)


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-bias-tied"])
def test_old_and_new_rope_config_styles_give_identical_logits(hf_checkpoint, name):
    new, old = hf_checkpoint(name), hf_checkpoint(name, rope_style="old")
    old_cfg = json.loads((old / "config.json").read_text())
    assert "rope_parameters" not in old_cfg and "rope_theta" in old_cfg
    assert torch.equal(run_prefill(load_model(new)), run_prefill(load_model(old)))


def test_tied_embeddings(hf_checkpoint, llama_copy):
    tied = load_model(hf_checkpoint("qwen2-bias-tied"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    # An untied checkpoint that lacks lm_head.weight falls back to tying (with a warning).
    _edit_weights(llama_copy, lambda t: t.pop("lm_head.weight"))
    model = load_model(llama_copy)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs(hf_checkpoint, dtype):
    path = hf_checkpoint("llama-gqa")
    ref = run_prefill(load_model(path))
    model = load_model(path, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    logits = run_prefill(model)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    similarity = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    assert similarity.min() > 0.99
