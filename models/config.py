"""Typed model configuration parsed from a Hugging Face checkpoint folder.

``ModelConfig.from_hf_folder(path)`` reads ``config.json`` (and ``generation_config.json`` when
present) and normalises the differences between the four supported families and between the two ways
transformers writes RoPE settings:

* old style: top-level ``rope_theta`` plus ``rope_scaling`` ({"type" | "rope_type": ..., "factor"})
* new style (transformers 5): ``rope_parameters`` = {"rope_type", "rope_theta", "factor", ...}

Family differences that matter to the decoder (all mirrored from transformers' modeling code):

=========  ==============  ============  =========  =======================================
family     q/k/v bias      o_proj bias   q/k norm   sliding window
=========  ==============  ============  =========  =======================================
llama      attention_bias  attention_b.  no         never
mistral    no              no            no         ``sliding_window`` on every layer
qwen2      always          no            no         only when ``use_sliding_window``
qwen3      attention_bias  attention_b.  yes        only when ``use_sliding_window``
=========  ==============  ============  =========  =======================================

Qwen's windowed layers are those whose ``layer_types`` entry is ``"sliding_attention"``
(default: layers >= ``max_window_layers``). ``layer_sliding_windows`` holds each layer's window;
``sliding_window`` is set only when one window covers every layer, since that is the only case
in which KV blocks that fell out of the window may be freed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta for all supported families
# Keys each scaled rope type needs (besides rope_type / rope_theta).
_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _as_id_tuple(value: Any, name: str) -> tuple[int, ...]:
    """An eos/bos id field that may be null, an int or a list of ints."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")
    return tuple(dict.fromkeys(values))  # dedupe, keep order


def read_special_ids(model_dir: str | Path) -> tuple[tuple[int, ...], int | None]:
    """(eos_token_ids, bos_token_id) from generation_config.json, else config.json, else empty.

    Missing files are fine here (a tokenizer-only folder has neither)."""
    model_dir = Path(model_dir)
    sources = [model_dir / "generation_config.json", model_dir / "config.json"]
    datas = [_read_json(p) for p in sources if p.is_file()]
    eos: tuple[int, ...] = ()
    bos: int | None = None
    for data in datas:
        if not eos and data.get("eos_token_id") is not None:
            eos = _as_id_tuple(data["eos_token_id"], "eos_token_id")
        if bos is None and data.get("bos_token_id") is not None:
            bos_ids = _as_id_tuple(data["bos_token_id"], "bos_token_id")
            bos = bos_ids[0] if bos_ids else None
    return eos, bos


def _parse_rope(cfg: dict[str, Any], max_position_embeddings: int) -> tuple[float, dict | None]:
    """Return (rope_theta, rope_scaling) from either config style; rope_scaling is None for
    plain RoPE, else a dict with at least ``rope_type`` and that type's keys."""
    # transformers gives the old `rope_scaling` key priority over `rope_parameters`.
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported for these families: "
                         f"{sorted(params)}")
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", DEFAULT_ROPE_THETA)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if params.get(k) is None]
    if missing and not (rope_type == "yarn" and missing == ["factor"]):
        raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters")
    return float(theta), {"rope_type": rope_type, **params}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return cfg[key]


def _layer_windows(cfg: dict[str, Any], model_type: str,
                   num_layers: int) -> tuple[int | None, tuple[int | None, ...]]:
    """(window shared by all layers or None, per-layer windows), per transformers' semantics."""
    if model_type == "llama":
        return None, (None,) * num_layers
    if model_type == "mistral":
        # MistralConfig defaults sliding_window to 4096 when the key is absent; null disables it.
        window = cfg["sliding_window"] if "sliding_window" in cfg else 4096
        return window, (window,) * num_layers
    # qwen2 / qwen3: the window only applies with use_sliding_window, and then only to the
    # layers whose layer_types entry is "sliding_attention" (default: layers >= max_window_layers).
    if not cfg.get("use_sliding_window", False):
        return None, (None,) * num_layers
    window = cfg["sliding_window"] if "sliding_window" in cfg else 4096
    if window is None:
        return None, (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types holds unsupported entries {sorted(unknown)}")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Mixed full/windowed layers: no single window, so no KV block may be dropped.
    return (window if all(w == window for w in windows) else None), windows


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder, the loader and the engine need to know about a checkpoint."""

    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int  # rows of the embedding / lm_head (may exceed the tokenizer's vocab)
    hidden_size: int  # residual stream width
    intermediate_size: int  # MLP inner width
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # K/V heads (== query heads for MHA, fewer for GQA)
    head_dim: int  # per-head width (explicit in config.json, else hidden / heads)
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    rope_scaling: dict | None  # None for plain RoPE, else {"rope_type": ..., factors...}
    max_position_embeddings: int  # longest context the RoPE cache covers
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2 always)
    o_proj_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # The window shared by EVERY layer, else None: what KV block freeing may rely on.
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer: window or None (full)
    torch_dtype: str | None = None  # dtype the checkpoint was saved in ("bfloat16", ...)
    eos_token_ids: tuple[int, ...] = ()  # generation stops on any of these
    bos_token_id: int | None = None  # beginning-of-sequence id, if the model has one
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # raw config.json

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture model_type={self.model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.layer_sliding_windows:
            windows = (self.sliding_window,) * self.num_hidden_layers
            object.__setattr__(self, "layer_sliding_windows", windows)
        if len(self.layer_sliding_windows) != self.num_hidden_layers:
            raise ValueError(f"layer_sliding_windows has {len(self.layer_sliding_windows)} "
                             f"entries for {self.num_hidden_layers} layers")
        for w in (self.sliding_window, *self.layer_sliding_windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
                raise ValueError(f"sliding_window must be a positive int or None, got {w!r}")
        first = self.layer_sliding_windows[0]
        uniform = first if all(w == first for w in self.layer_sliding_windows) else None
        if self.sliding_window != uniform:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be the window every "
                             f"layer uses, or None when layers differ: layer_sliding_windows="
                             f"{self.layer_sliding_windows}")

    @classmethod
    def from_hf_folder(cls, model_dir: str | Path) -> ModelConfig:
        """Parse ``model_dir/config.json`` (+ generation_config.json when present). Any
        checkpoint, GGUF included: ``models.checkpoint.open_checkpoint(path).model_config``."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir} (is it a Hugging Face "
                                    "checkpoint folder?)")
        eos, bos = read_special_ids(model_dir)
        return cls.from_dict(_read_json(path), eos_token_ids=eos, bos_token_id=bos)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...] | None = None,
                  bos_token_id: int | None = None) -> ModelConfig:
        """Build from a config.json dict; eos/bos default to the dict's own fields."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = cfg.get("architectures") or []
            raise ValueError(f"unsupported architecture model_type={model_type!r} "
                             f"(architectures={arch}); supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        hidden = _require(cfg, "hidden_size")
        heads = _require(cfg, "num_attention_heads")
        layers = _require(cfg, "num_hidden_layers")
        kv_heads = cfg.get("num_key_value_heads") or heads
        # Qwen3Config defaults head_dim to 128 (not hidden / heads) when the key is absent.
        default_head_dim = 128 if model_type == "qwen3" else hidden // heads
        head_dim = cfg.get("head_dim") or default_head_dim
        max_pos = cfg.get("max_position_embeddings", 2048)
        theta, scaling = _parse_rope(cfg, max_pos)
        window, windows = _layer_windows(cfg, model_type, layers)
        bias = bool(cfg.get("attention_bias", False))
        if eos_token_ids is None or not eos_token_ids:
            eos_token_ids = _as_id_tuple(cfg.get("eos_token_id"), "eos_token_id")
        if bos_token_id is None:
            bos_ids = _as_id_tuple(cfg.get("bos_token_id"), "bos_token_id")
            bos_token_id = bos_ids[0] if bos_ids else None
        return cls(
            model_type=model_type, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
            intermediate_size=_require(cfg, "intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else (
                bias if model_type != "mistral" else False),
            o_proj_bias=bias if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3", sliding_window=window, layer_sliding_windows=windows,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=tuple(eos_token_ids), bos_token_id=bos_token_id, extra=dict(cfg))

    # ----- derived quantities -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes one token costs: 2 x layers x kv_heads x head_dim x element bytes."""
        element = dtype.itemsize
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged pool, see :mod:`pdserve.kernels.kv_layout`."""
        return (2, num_blocks, block_size, self.num_key_value_heads, self.head_dim)

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once), matching transformers' model."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        attn += h if self.o_proj_bias else 0
        attn += 2 * d if self.qk_norm else 0
        mlp = 3 * h * self.intermediate_size
        mlp += (2 * self.intermediate_size + h) if self.mlp_bias else 0
        per_layer = attn + mlp + 2 * h  # + two RMSNorm weights
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * per_layer + h + lm_head

    def weight_bytes(self, dtype: torch.dtype) -> int:
        element = dtype.itemsize
        return self.num_parameters() * element


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Hugging Face checkpoint of ``config`` holds, with its shape
    (``lm_head.weight`` included even when tied; the loader treats it as optional)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, d = config.q_size, config.kv_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
    }
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (rows, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            shapes[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
    return shapes
