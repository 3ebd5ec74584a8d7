"""Tokenizer wrapper and the built-in tiny model."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from pdserve.models import load_model, tiny_model_dir
from pdserve.models.checkpoint import open_checkpoint
from pdserve.models.tiny import TINY_FILES, TINY_VERSION

TEXTS = ["Hello, world!", "", "  leading spaces and\ttabs\nnewlines", "ünïcödé 日本語 🙂",
         "def f(x):\n    return x * 2  # code", "12345 67.89"]


def test_round_trip_and_bos(tiny_dir):
    tok = open_checkpoint(tiny_dir).tokenizer()
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.vocab_size == 480
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1  # the tokenizer.json template adds <s>
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode([1, *tok.encode("hi", add_special_tokens=False), 2],
                      skip_special_tokens=False) == "<s>hi</s>"
    assert tok.decode([500, 511]) == ""  # model-only ids beyond the tokenizer vocab are dropped


def test_add_bos_token_in_tokenizer_config_wins(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "bos_token": "<s>", "eos_token": {"content": "<pad>"}}))
    tok = open_checkpoint(tmp_path).tokenizer()
    assert tok.encode("hi")[0] != 1
    assert tok.eos_token_ids == (2, 0)  # generation_config's eos plus tokenizer_config's
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    tok = open_checkpoint(tmp_path).tokenizer()
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        open_checkpoint(tmp_path).tokenizer()


def test_checkpoint_tokenizers_stay_inside_model_vocab(family_case):
    tok = open_checkpoint(family_case.path).tokenizer()
    vocab = json.loads((family_case.path / "config.json").read_text())["vocab_size"]
    assert tok.vocab_size <= vocab
    assert max(tok.encode(" ".join(TEXTS))) < vocab


def test_tiny_model_is_deterministic(tmp_path):
    a, b = tiny_model_dir(tmp_path / "a"), tiny_model_dir(tmp_path / "b")
    assert a.name == b.name == f"tiny-llama-{TINY_VERSION}"
    for name in TINY_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tiny_model_loads_and_runs_like_transformers(tiny_dir, hf_model):
    model = load_model(tiny_dir)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == ("llama", 128, 4, 4, 2, 512)
    assert cfg.max_position_embeddings == 2048 and cfg.eos_token_ids == (2,)
    ids = open_checkpoint(tiny_dir).tokenizer().encode("The quick brown fox")
    from pdserve.kernels import KVCacheLayer
    from pdserve.models.attention import AttentionMetadata

    n = len(ids)
    caches = [KVCacheLayer(torch.zeros(cfg.kv_cache_shape(8, 4))) for _ in range(4)]
    meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32),
                             torch.arange(8, dtype=torch.int32)[None], n, n, backend="torch")
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))
    with torch.no_grad():
        ref = hf_model(tiny_dir)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_tiny_model_env_var_and_concurrent_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    results, errors = [], []

    def first_use():
        try:
            results.append(tiny_model_dir())
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    expected = tmp_path / f"tiny-llama-{TINY_VERSION}"
    assert results == [expected] * 4
    assert all((expected / name).is_file() for name in TINY_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == [expected.name]  # no temp leftovers
