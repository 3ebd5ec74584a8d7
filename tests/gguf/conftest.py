"""GGUF files written in the test with the ``gguf`` package's writer, from the tiny random
Hugging Face checkpoints of ``hf_checkpoint`` (tests/conftest.py).

``gguf_file(name_or_family, qtype="F32", tokenizer="gpt2", **overrides)`` returns the path of
a ``model.gguf`` alone in its own folder (what ``from_pretrained(dir, gguf_file=...)`` and our
folder detection take), written the way llama.cpp's ``convert_hf_to_gguf.py`` writes these
families: llama-architecture q/k rows permuted for interleaved RoPE (Mistral is the llama
architecture named "mistral", with ``attention.sliding_window``), Qwen unpermuted, Llama 3.1
rope scaling as a ``rope_freqs`` tensor, no ``output.weight`` when embeddings are tied, 2-D
weights quantized to ``qtype`` where their rows split into whole blocks (else F16, as
llama.cpp falls back), norms and biases F32.

Tokenizers: ``"gpt2"`` is the tiny model's byte-level BPE (tokens in id order, its merges,
control type for the specials, padded with ``[PADn]`` to the model's vocab); ``"llama"`` is a
sentencepiece-style vocabulary (``<unk> <s> </s>``, the 256 ``<0xNN>`` byte tokens, then BPE
pieces trained here with a ``▁`` metaspace) with scores and no merges, as Llama 2 files hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. A request arrives at the router and waits.
Numbers 0 1 2 3 42 128 2048 3.14159, dates 2024-05-17, code: for i in range(n): x += i
Hello, world! How are you today? Memory, time, blocks, tokens, layers and heads.
"""


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert permute: rotate-half rows -> interleaved pairs per head."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight|bias
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def byte_level_vocab(tokenizer_json: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, token types, merges) of a byte-level BPE tokenizer.json."""
    data = json.loads(tokenizer_json.read_text())
    vocab = dict(data["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(specials)
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [3 if t in specials else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) of a small Llama-2-style vocabulary trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False, special_tokens=[])
    tok.train_from_iterator(TOKENIZER_TEXT.splitlines(), trainer)
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    return tokens, types, scores


def _pad(tokens, types, scores, size):
    while len(tokens) < size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # UNUSED
        if scores is not None:
            scores.append(-1e9)


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", tokenizer: str = "gpt2",
               name: str | None = None, chat_template: str | None = None,
               pre: str = "default") -> Path:
    """Convert the HF checkpoint ``hf_dir`` into ``out`` (a .gguf path); see the module doc."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    family = cfg["model_type"]
    arch = "llama" if family in ("llama", "mistral") else family
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or f"tiny {family}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if family == "mistral" and cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    writer.add_vocab_size(cfg["vocab_size"])
    _write_tokenizer(writer, hf_dir, tokenizer, cfg["vocab_size"], chat_template, pre)

    state = load_file(str(hf_dir / "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    quant = gguf.GGMLQuantizationType[qtype]
    if rope.get("rope_type") == "llama3":
        from pdserve.models.rope import _base_inv_freq, _llama3_inv_freq

        base = _base_inv_freq(head_dim, rope["rope_theta"])
        writer.add_tensor("rope_freqs.weight", (base / _llama3_inv_freq(base, rope)).numpy())
    for hf_name, tensor in sorted(state.items()):
        array = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            array = _permute(array, heads if ".q_proj." in hf_name else kv_heads)
        _add_tensor(writer, gguf_name(hf_name), np.ascontiguousarray(array), quant)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else
                         gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer, name: str, array: np.ndarray, quant) -> None:
    import gguf

    block = gguf.GGML_QUANT_SIZES[quant][0]
    if array.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array.astype(np.float32))
        return
    if array.shape[-1] % block:
        quant = gguf.GGMLQuantizationType.F16  # llama.cpp's fallback for odd rows
    data = gguf.quants.quantize(array, quant)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=quant)


def _write_tokenizer(writer, hf_dir: Path, kind: str, vocab_size: int,
                     chat_template: str | None, pre: str) -> None:
    if kind == "gpt2":
        tokens, types, merges = byte_level_vocab(hf_dir / "tokenizer.json")
        _pad(tokens, types, None, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_add_bos_token(True)
    elif kind == "llama":
        tokens, types, scores = sentencepiece_vocab()
        _pad(tokens, types, scores, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
    else:
        raise ValueError(f"tokenizer must be gpt2 or llama, got {kind!r}")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


@pytest.fixture(scope="session")
def gguf_file(hf_checkpoint, tmp_path_factory):
    """Factory: ``gguf_file(name_or_family, qtype="F32", tokenizer="gpt2", pre="default",
    chat_template=None, name=None, **overrides)`` -> path of a cached ``model.gguf``."""
    built: dict[str, Path] = {}

    def make(name_or_family: str, qtype: str = "F32", tokenizer: str = "gpt2",
             pre: str = "default", chat_template: str | None = None, name: str | None = None,
             **overrides) -> Path:
        key = json.dumps([name_or_family, qtype, tokenizer, pre, chat_template, name, overrides],
                         sort_keys=True)
        if key not in built:
            hf_dir = hf_checkpoint(name_or_family, **overrides)
            out = tmp_path_factory.mktemp(f"gguf-{name_or_family}-{qtype}") / "model.gguf"
            built[key] = write_gguf(hf_dir, out, qtype, tokenizer, name, chat_template, pre)
        return built[key]

    return make


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own GGUF loading of a file (fp32, eager), cached per file."""
    loaded: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:
        if path not in loaded:
            from transformers import AutoModelForCausalLM

            loaded[path] = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32,
                attn_implementation="eager").eval()
        return loaded[path]

    return load
