"""The built-in tiny model: a real Hugging Face format Llama checkpoint generated on first use.

    *** THE WEIGHTS ARE RANDOM. THE MODEL'S OUTPUT IS GIBBERISH. ***

It exists so that every part of pdserve (loader, engine, workers, router, CLI, demo, tests) can
run end to end with no download and no GPU. The folder it writes is an ordinary checkpoint:

* ``config.json``: llama, hidden 128, 4 layers, 4 query heads, 2 KV heads (GQA), vocab 512,
  max_position_embeddings 2048;
* ``model.safetensors``: weights drawn from a fixed-seed ``torch.Generator``, so two
  generations with the same torch version produce identical bytes;
* ``tokenizer.json``: a byte-level BPE trained deterministically with the ``tokenizers``
  library on the short text embedded below (byte-level, so any text encodes); its vocab
  (480) is smaller than the model's (512), as with many real checkpoints;
* ``tokenizer_config.json``, ``generation_config.json`` (bos 1, eos 2) and a README.md.

Location: ``<cache>/tiny-llama-<TINY_VERSION>`` where ``<cache>`` is the ``cache_dir``
argument, else ``$PDSERVE_CACHE_DIR``, else ``~/.cache/pdserve``. The folder is written into a
temporary sibling and renamed into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.models.config import ModelConfig, hf_tensor_shapes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TINY_VERSION = "v1"  # bump when anything written below changes
TINY_SEED = 1234  # seeds the weight generator
TINY_TOKENIZER_VOCAB = 480  # BPE vocab incl. specials and the 256 byte symbols
TINY_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "README.md")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}

# Training text for the tokenizer: a little prose, numbers, code and punctuation.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the small cat watches from the window.
A request arrives at the router, waits in a queue, and is sent to a prefill worker. The
prefill worker runs the whole prompt at once, writes the keys and values of every layer into
paged blocks, and ships those blocks to a decode worker over a fast channel. The decode worker
adds the request to its running batch and produces one new token per step until the answer is
complete, the length limit is reached, or the client goes away.
Memory is the ledger that matters: weights, the key value pool, and the activations of the
largest step. Time is the other ledger: queueing, prefill, transfer, and decode.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 3.14159 2.71828 42.
Dates and times: 2024-05-17 09:30:00, 1999-12-31 23:59:59, Monday, Tuesday, Wednesday.
def generate(prompt, max_tokens=32, temperature=0.0):
    ids = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(ids)
        ids.append(int(logits[-1].argmax()))
    return tokenizer.decode(ids)
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } return sum;
Hello, world! How are you today? I am fine, thank you. What time is it? It is late.
Questions and answers, stories and lists, tables and charts: all of them are just text.
The engine schedules prefill and decode, the allocator hands out blocks, the sampler picks
tokens, and the tokenizer turns them back into words that people can read and understand.
"""


def _train_tokenizer():
    """Byte-level BPE, deterministic for a given ``tokenizers`` version."""
    # lazy: its names (models, Tokenizer) would shadow ours at module level
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_TOKENIZER_VOCAB,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    bos = SPECIAL_TOKENS[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 1)])
    return tok


def _random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded weights: matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1)."""
    # lazy: torch only to write the weights; finding the generated folder (the launcher and
    # the router do) needs none
    import torch

    gen = torch.Generator().manual_seed(TINY_SEED)
    tensors = {}
    for name, shape in sorted(hf_tensor_shapes(config).items()):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 2:
            tensors[name] = (noise / shape[1] ** 0.5).contiguous()
        else:
            tensors[name] = 1.0 + 0.1 * noise
    return tensors


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_checkpoint(out_dir: str | Path) -> Path:
    """Write the tiny checkpoint's files into the existing folder ``out_dir``."""
    from safetensors.torch import save_file  # lazy: only when generating (imports torch)

    out_dir = Path(out_dir)
    config = ModelConfig.from_dict(TINY_CONFIG)
    _write_json(out_dir / "config.json", TINY_CONFIG)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    save_file(_random_weights(config), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _train_tokenizer().save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0], "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast"})
    (out_dir / "README.md").write_text(
        "# pdserve tiny-llama\n\nGenerated by `pdserve.models.tiny`. THE WEIGHTS ARE RANDOM "
        f"(seed {TINY_SEED}); the output is gibberish.\nIt exists to exercise pdserve end to "
        "end with no download.\n", encoding="utf-8")
    return out_dir


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in TINY_FILES)


def tiny_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Path of the tiny checkpoint, generating it on first use (see the module docstring)."""
    root = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    final = root / f"tiny-llama-{TINY_VERSION}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        write_tiny_checkpoint(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        for child in tmp.iterdir():
            child.chmod(0o644)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not _is_complete(final):
                raise OSError(f"{final} exists but is incomplete; delete it and retry") from None
        else:
            logger.warning("generated the tiny model (RANDOM weights, gibberish output) in %s",
                           final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
