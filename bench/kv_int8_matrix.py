"""int8 KV quality over model shapes: ``python -m pdserve.bench.kv_int8_matrix [--gguf PATH]``.

Every ``kv_int8_scales`` scheme on every shape of :data:`SHAPES` (random weights, fp32): the
Qwen2, Qwen3 and Mistral layouts with word-level tokenizers of a few hundred words that cannot
read the calibration text, head_dim 16 to 128, GQA and MHA, tied embeddings, a sliding window,
and a layer whose K/V projections are scaled by 100 (large activations). Each row is measured
teacher-forced against the fp32 cache of the same model in the same run, on random token ids
(these vocabularies cannot read the held-out text): mean KL in nats, dNLL %, top-1 agreement
%, the capacity against an fp16 cache, and the scheme the engine really runs (a scheme that
fails its start-up check falls back to ``token``). With ``--gguf`` the real checkpoint's rows
on the held-out text come first (``pdserve.bench.kv_int8``). Never asserts.

The checkpoints are written with transformers (imported only here: it is a test and benchmark
dependency, not a serving one).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.bench import kv_int8
from pdserve.bench.stats import format_table
from pdserve.engine.config import KV_INT8_SCALES
from pdserve.engine.kv_cache import int8_scales
from pdserve.engine.llm import LLM
from pdserve.models import tiny_model_dir

# name -> (family, config overrides, tokenizer: "words" (word-level, vocab_size words), "bpe"
# (the tiny model's byte-level BPE), "+x100": layer 0's K and V projections scaled by 100)
SHAPES: dict[str, tuple[str, dict, str]] = {
    "qwen2 hd16 gqa, words": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                            vocab_size=600), "words"),
    "qwen3 hd32 kv1, words": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=32, vocab_size=700), "words"),
    "mistral hd16 kv1 window, words": ("mistral", dict(num_attention_heads=4,
                                                       num_key_value_heads=1, sliding_window=8,
                                                       vocab_size=520), "words"),
    "llama hd64 mha tied": ("llama", dict(num_attention_heads=1, num_key_value_heads=1,
                                          tie_word_embeddings=True), "bpe"),
    "llama hd128 gqa": ("llama", dict(hidden_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=128), "bpe"),
    "qwen2 hd16 x100 activations, words": ("qwen2", dict(vocab_size=800), "words+x100"),
}
_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
EVAL_PROMPTS, EVAL_LEN, EVAL_SEED = 8, 128, 11


def word_level_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer of ``vocab_size`` ids: [UNK], <s>, </s>, w0, w1, ..."""
    # lazy: its names (models, Tokenizer) would shadow ours at module level
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def write_word_level_tokenizer(folder: Path, vocab_size: int) -> None:
    word_level_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]"}))


def scale_attention_kv(folder: Path, layer: int, factor: float) -> None:
    """Large activations: layer ``layer``'s K and V projections (and biases) times
    ``factor``."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    prefix = f"model.layers.{layer}.self_attn."
    for name in weights:
        if name.startswith(prefix) and name[len(prefix):].split(".")[0] in ("k_proj", "v_proj"):
            weights[name] = weights[name] * factor
    save_file(weights, path, metadata={"format": "pt"})


def write_shape(name: str, folder: Path, bpe_tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random-weight fp32 checkpoint of shape ``name`` in ``folder``."""
    # lazy: transformers (seconds to import; a test dependency) only for the Hugging Face reference
    import transformers  # (see the module docstring)

    family, overrides, tokenizer = SHAPES[name]
    prefix = _CLASSES[family]
    config = getattr(transformers, f"{prefix}Config")(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            else:
                param.copy_(1.0 + 0.1 * noise if "norm" in param_name else 0.1 * noise)
    model.save_pretrained(folder)
    if tokenizer.startswith("words"):
        write_word_level_tokenizer(folder, overrides["vocab_size"])
    else:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (folder / file).write_bytes((bpe_tokenizer_dir / file).read_bytes())
    if tokenizer.endswith("+x100"):
        scale_attention_kv(folder, 0, 100.0)
    return folder


def shape_rows(name: str, folder: Path, schemes: list[str]) -> list[list[str]]:
    common = dict(dtype="float32", block_size=kv_int8.BLOCK_SIZE, enable_prefix_caching=False,
                  num_kv_blocks=-(-EVAL_LEN // kv_int8.BLOCK_SIZE) + 1)
    base = LLM(str(folder), **common)
    vocab = base.engine.parts.model_config.vocab_size
    texts = int8_scales.random_prompts(vocab, EVAL_LEN, EVAL_PROMPTS * EVAL_LEN, seed=EVAL_SEED)
    reference = [kv_int8.teacher_forced_logprobs(base, ids) for ids in texts]
    ref_nll = kv_int8.stats(reference, reference, texts)[1]
    rows = []
    for scheme in schemes:
        llm = LLM(str(folder), kv_cache_dtype="int8", kv_int8_scales=scheme, **common)
        kl, nll, top1 = kv_int8.stats(reference, [kv_int8.teacher_forced_logprobs(llm, ids)
                                                  for ids in texts], texts)
        runs = llm.engine.parts.config.kv_int8_scales
        fp16 = llm.engine.parts.model_config.kv_bytes_per_token(torch.float16)
        rows.append([name, scheme, runs if runs == scheme else f"{runs} (fallback)",
                     f"{kl:.2e}", f"{100.0 * (nll - ref_nll) / ref_nll:+.3f}",
                     f"{100.0 * top1:.2f}", f"{fp16 / kv_int8.bytes_per_token_16bit(llm):.2f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="a real .gguf checkpoint to measure too "
                                                     "(on the held-out text)")
    parser.add_argument("--schemes", default=",".join(KV_INT8_SCALES))
    args = parser.parse_args(argv)
    schemes = args.schemes.split(",")
    if args.gguf:
        rows, num_tokens = kv_int8.compare(args.gguf, 512, schemes, with_bf16=False)
        print(f"{args.gguf}: held-out text, {num_tokens} tokens, teacher-forced")
        print(format_table(["KV cache", "fp edges", "KL", "NLL", "PPL", "dNLL %", "top-1 %",
                            "B/token", "x fp16"], rows))

    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-int8-") as tmp:
        for i, name in enumerate(SHAPES):
            folder = write_shape(name, Path(tmp, f"shape-{i}"), tiny_model_dir())
            rows += shape_rows(name, folder, schemes)
    print(f"random-weight shapes: {EVAL_PROMPTS} x {EVAL_LEN} random token ids, "
          f"teacher-forced against fp32")
    print(format_table(["shape", "scheme", "runs as", "KL", "dNLL %", "top-1 %", "x fp16"],
                       rows))
    worst = max(rows, key=lambda r: float(r[3]))
    print(f"worst KL: {worst[0]}, {worst[1]}: KL {worst[3]}, top-1 {worst[5]} % "
          f"({math.fsum(float(r[5]) for r in rows) / len(rows):.2f} % mean top-1)")


if __name__ == "__main__":
    main()
