"""RoPE cos/sin caches in the layout :func:`pdserve.kernels.torch_ops.rotary_torch` reads.

The cache is ``(max_positions, head_dim)`` float32 = ``[cos | sin]``, each half ``head_dim / 2``
wide, for the rotate-half convention Hugging Face uses (the first half of a head pairs with the
second half). Frequencies follow transformers' ``modeling_rope_utils`` exactly, computed in fp32
the same way, so the cache matches ``LlamaRotaryEmbedding`` bit for bit (or to the last ulp):

* ``default``: ``inv_freq = 1 / theta ** (arange(0, D, 2) / D)``
* ``linear``: ``inv_freq / factor``
* ``dynamic`` (NTK): identical to default up to ``max_position_embeddings``; the cache stops
  there, so the batch-dependent rescaling past it never applies
* ``llama3``: Llama 3.1 band-wise smoothing between scaled and unscaled frequencies
* ``yarn``: ramp blend of interpolated/extrapolated frequencies, cos/sin scaled by mscale
"""

from __future__ import annotations

import math

import torch

from pdserve.models.config import ModelConfig


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)  # (head_dim / 2,)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict,
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def inv_frequencies(head_dim: int, rope_theta: float, rope_scaling: dict | None = None,
                    max_position_embeddings: int = 2048) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim / 2,) float32, attention scaling applied to cos and sin)."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(head_dim, rope_theta), 1.0
    if rope_type == "linear":
        return _base_inv_freq(head_dim, rope_theta) / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, rope_theta), rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


def build_cos_sin_cache(head_dim: int, max_positions: int, rope_theta: float,
                        rope_scaling: dict | None = None,
                        max_position_embeddings: int | None = None,
                        device: torch.device | str | None = None,
                        freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The ``(max_positions, head_dim)`` float32 ``[cos | sin]`` table for positions 0.. .

    ``freq_factors`` (head_dim / 2,) divide the frequencies (a GGUF's ``rope_freqs`` tensor,
    how llama.cpp stores Llama 3.1 scaling)."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    with torch.device("cpu"):  # always computed on CPU in fp32, even under a meta context
        inv_freq, attention_scaling = inv_frequencies(
            head_dim, rope_theta, rope_scaling, max_position_embeddings or max_positions)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to("cpu", torch.float32)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim / 2)
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling),
                          dim=-1)
    return cache.to(device) if device is not None else cache  # (max_positions, head_dim)


def cos_sin_cache_for(config: ModelConfig, device: torch.device | str | None = None,
                      max_positions: int | None = None,
                      freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The cache for ``config`` covering ``max_position_embeddings`` (or ``max_positions``)."""
    return build_cos_sin_cache(config.head_dim, max_positions or config.max_position_embeddings,
                               config.rope_theta, config.rope_scaling,
                               config.max_position_embeddings, device, freq_factors)
