"""Load GGUF files (llama.cpp's single-file format) into the Llama-family decoder.

``LLM("model.gguf")``, ``pdserve serve --model model.gguf`` and a folder holding exactly one
``.gguf`` (and no ``config.json``) all come here through
``models.checkpoint.open_checkpoint``, which tells them apart (``find_gguf_file``).

Steps, each with an error naming the file, key or tensor at fault:

1. Metadata -> :class:`ModelConfig`: ``general.architecture`` picks the family (``llama``:
   Llama 2/3, Mistral, SmolLM; ``qwen2``; ``qwen3``), then ``<arch>.block_count``,
   ``context_length``, ``embedding_length``, ``feed_forward_length``, ``attention.head_count``,
   ``attention.head_count_kv``, ``attention.layer_norm_rms_epsilon``, ``attention.key_length``
   (head_dim), ``attention.sliding_window``, ``rope.freq_base`` and the ``rope.scaling.*`` keys
   (linear, yarn) become config.json fields; the vocab size is the embedding's row count and
   ``tie_word_embeddings`` is "the file has no ``output.weight``". Biases and q/k norms are
   read off the tensors that exist.
2. Tensor names ``token_embd``, ``blk.N.attn_q`` ... map to Hugging Face names, and the usual
   shape checks of :func:`pdserve.models.loader.check_tensors` run on them.
3. Every tensor is dequantized at load (``gguf.dequantize``: F32, F16, BF16, Q4_0, Q4_1, Q5_0,
   Q5_1, Q8_0, the K-quants Q2_K..Q6_K and the IQ types) to the model dtype, with a progress
   bar. For the ``llama`` architecture llama.cpp's converter permuted the rows of ``attn_q`` and
   ``attn_k`` (interleaved rotary pairs); that permutation is undone so the rotate-half RoPE of
   the decoder applies. Qwen files are stored unpermuted (NEOX rope) and load as they are.
4. Llama 3.1-style rope scaling travels as a ``rope_freqs.weight`` tensor of per-frequency
   divisors (not as metadata); the RoPE table is rebuilt from ``base_inv_freq / rope_freqs``
   exactly as llama.cpp applies it. (transformers' GGUF loader drops that tensor.)

Not supported, with an error saying so: other architectures, fused ``attn_qkv`` tensors,
partial rotary (``rope.dimension_count`` < head_dim), split files, types the ``gguf`` package
cannot dequantize. Weights are not kept quantized: the memory ledger reports the dequantized
size and the types the file held (``model.weights_source``).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from pdserve.models.config import ModelConfig
from pdserve.models.gguf_tokenizer import tokenizer_from_metadata
from pdserve.models.llama import build_model
from pdserve.models.loader import check_tensors, copy_tensor
from pdserve.models.tensor_parallel import TensorShard
from pdserve.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# GGUF general.architecture -> our model_type (Mistral files use the llama architecture).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"
_REQUIRED_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
                  "attention.head_count", "attention.layer_norm_rms_epsilon")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _can_dequantize(qtype) -> bool:
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    # gguf.quants registers one class per type it can dequantize (BF16, Q*_0/1, K and IQ types)
    return qtype in getattr(gguf.quants, "_type_traits", {})


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows: per head, (2, half) -> (half, 2) back to
    rotate-half order. weight: (num_heads * head_dim, ...) or a bias (num_heads * head_dim,)."""
    half = weight.shape[0] // num_heads // 2
    shaped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """One GGUF file: its metadata, config, tensor inventory, weights and tokenizer."""

    format = "gguf"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except (ValueError, OSError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self.metadata: dict[str, Any] = {name: field.contents()
                                         for name, field in self.reader.fields.items()
                                         if not name.startswith("GGUF.")}
        if self.metadata.get("split.count", 1) > 1:
            raise ValueError(f"{self.path.name} is one part of a split GGUF "
                             f"({self.metadata['split.count']} files); merge it first with "
                             "llama.cpp's gguf-split --merge")
        self.tensors = {t.name: t for t in self.reader.tensors}

    # -- metadata -------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture general.architecture={arch!r} in "
                             f"{self.path.name}; supported: {', '.join(GGUF_ARCHITECTURES)} "
                             "(Llama 2/3, Mistral and SmolLM files use 'llama')")
        return arch

    def _key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def _require(self, name: str) -> Any:
        value = self._key(name)
        if value is None:
            raise ValueError(f"GGUF file {self.path.name} is missing required key "
                             f"{self.architecture}.{name!r}")
        return value

    def _uniform(self, name: str, value: Any) -> Any:
        """A per-layer array must hold one value (these families have no per-layer shapes)."""
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{self.architecture}.{name} differs per layer ({value}); "
                                 "not supported for this family")
            return value[0]
        return value

    def _rope_scaling(self) -> dict | None:
        kind = self._key("rope.scaling.type", "none")
        factor = self._key("rope.scaling.factor")
        if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": _float(factor)}
        if kind == "yarn":
            scaling = {"rope_type": "yarn", "factor": _float(factor) if factor else None,
                       "original_max_position_embeddings":
                           self._key("rope.scaling.original_context_length")}
            for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                                 ("attention_factor", "attn_factor")):
                if self._key(f"rope.scaling.{theirs}") is not None:
                    scaling[ours] = _float(self._key(f"rope.scaling.{theirs}"))
            return scaling
        raise ValueError(f"{self.architecture}.rope.scaling.type {kind!r} in {self.path.name} is "
                         "not supported (none, linear, yarn)")

    def config_dict(self) -> dict[str, Any]:
        """The metadata as a config.json dict (see the module docstring for the mapping)."""
        arch = self.architecture
        for name in _REQUIRED_KEYS:
            self._require(name)
        if "token_embd.weight" not in self.tensors:
            raise ValueError(f"GGUF file {self.path.name} has no token_embd.weight tensor")
        hidden = self._require("embedding_length")
        heads = self._uniform("attention.head_count", self._require("attention.head_count"))
        kv_heads = self._uniform("attention.head_count_kv",
                                 self._key("attention.head_count_kv", heads))
        head_dim = self._key("attention.key_length") or hidden // heads
        for name in ("attention.value_length", "rope.dimension_count"):
            value = self._key(name)
            if value is not None and value != head_dim:
                what = "partial rotary" if name.startswith("rope") else "value heads != key heads"
                raise ValueError(f"{arch}.{name} = {value} differs from head_dim {head_dim} in "
                                 f"{self.path.name} ({what} is not supported)")
        if any(".attn_qkv." in name for name in self.tensors):
            raise ValueError(f"{self.path.name} stores fused attn_qkv tensors; only separate "
                             "attn_q/attn_k/attn_v are supported")
        window = self._key("attention.sliding_window")
        model_type = GGUF_ARCHITECTURES[arch]
        if model_type == "llama" and window:
            model_type = "mistral"  # the one llama-architecture family with a window
        cfg: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": int(self.tensors["token_embd.weight"].shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": self._uniform("feed_forward_length",
                                               self._require("feed_forward_length")),
            "num_hidden_layers": self._require("block_count"),
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": _float(self._require("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": self._require("context_length"),
            "rope_theta": _float(self._key("rope.freq_base", 10_000.0)),
            "rope_scaling": self._rope_scaling(),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in self.tensors,
            "sliding_window": window or None,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_token_ids or None,
            "dtype": "float32",
        }
        return cfg

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: eos, and llama.cpp's end-of-turn / end-of-message ids."""
        ids = [self.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @cached_property
    def model_config(self) -> ModelConfig:
        cfg = self.config_dict()
        return ModelConfig.from_dict(cfg, eos_token_ids=tuple(self.eos_token_ids),
                                     bos_token_id=cfg["bos_token_id"])

    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer (:mod:`pdserve.models.gguf_tokenizer`)."""
        return tokenizer_from_metadata(self.metadata, tuple(self.eos_token_ids), self.path.name)

    # -- tensors --------------------------------------------------------------------------
    def inventory(self) -> dict[str, tuple[Path, tuple[int, ...]]]:
        """HF name -> (file, shape) for every weight tensor, checking names and types."""
        found: dict[str, tuple[Path, tuple[int, ...]]] = {}
        for name, tensor in self.tensors.items():
            if name == ROPE_FREQS:
                continue
            hf_name = _hf_name(name)
            if hf_name is None:
                raise ValueError(f"unexpected tensor {name!r} in {self.path.name}: not part of a "
                                 f"{self.architecture} decoder pdserve knows")
            if not _can_dequantize(tensor.tensor_type):
                raise ValueError(f"tensor {name!r} in {self.path.name} has type "
                                 f"{tensor.tensor_type.name}, which the gguf package cannot "
                                 "dequantize (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                                 "Q8_0, Q2_K..Q6_K, IQ types)")
            # GGUF lists dims innermost first; torch's shape is the reverse
            found[hf_name] = (self.path, tuple(int(d) for d in reversed(tensor.shape)))
        return found

    def weight_types(self) -> str:
        """e.g. ``"Q8_0 x14, F32 x7"``: the storage types of the file's tensors."""
        counts = Counter(t.tensor_type.name for t in self.tensors.values())
        return ", ".join(f"{name} x{n}" for name, n in counts.most_common())

    def dequantized(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 in torch's shape, q/k rows unpermuted (llama)."""
        tensor = self.tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(shape)
        if self.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            mc = self.model_config
            heads = mc.num_attention_heads if ".attn_q." in name else mc.num_key_value_heads
            array = _unpermute(array, heads)
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:  # an F32 tensor is a view of the read-only memmap
            array = array.copy()
        return torch.from_numpy(array)

    def rope_freq_factors(self) -> torch.Tensor | None:
        """The (head_dim / 2,) divisors of ``rope_freqs.weight`` (Llama 3.1 scaling), if any."""
        if ROPE_FREQS not in self.tensors:
            return None
        return self.dequantized(ROPE_FREQS).reshape(-1)

    def tensor_names(self) -> set[str]:
        """Hugging Face names of the file's weight tensors, from its tensor table."""
        return set(self.inventory())

    def load(self, dtype: torch.dtype, device: torch.device | str,
             shard: TensorShard | None = None) -> torch.nn.Module:
        """The model with every tensor dequantized to ``dtype`` on ``device`` (with ``shard``,
        that tensor parallel rank's part)."""
        start = time.perf_counter()
        config = self.model_config
        found = self.inventory()
        tie = check_tensors(config, found, source=self.path.name)
        model = build_model(config if shard is None else shard.local_config(config),
                            dtype=dtype, device=device)
        if tie:
            model.tie_weights()
        by_hf = {_hf_name(n): n for n in self.tensors if n != ROPE_FREQS}
        names = [n for n in found if not (tie and n == "lm_head.weight")]
        for hf_name in tqdm(names, desc=f"dequantizing {self.path.name}", unit="tensor",
                            disable=None):
            copy_tensor(model, config, hf_name, self.dequantized(by_hf[hf_name]), shard)
        factors = self.rope_freq_factors()
        if factors is not None:
            if factors.numel() != config.head_dim // 2:
                raise ValueError(f"{ROPE_FREQS} has {factors.numel()} entries, head_dim / 2 is "
                                 f"{config.head_dim // 2}")
            model.set_rope_freq_factors(factors)
        model.weights_source = f"GGUF {self.weight_types()}, dequantized to " \
                               f"{str(dtype).replace('torch.', '')}"
        logger.info("loaded %s (%s, %.1fM params; %s) in %.2fs", self.path.name,
                    config.model_type, config.num_parameters() / 1e6, self.weight_types(),
                    time.perf_counter() - start)
        return model
