"""int8 KV cache scales: the schemes, and calibration of their static part on real text.

A stored int8 value ``q`` of layer ``l``, head ``h``, channel ``d``, token slot ``s`` means::

    real = q * channel_scale[l][h, d] * token_scale[l][s, h]

``EngineConfig.kv_int8_scales`` picks which factors K and V have (see
:mod:`pdserve.kernels.kv_layout` for the write rule):

=========  =============================  =============================  ==================
scheme     keys                           values                         extra bytes/token
=========  =============================  =============================  ==================
static     per channel, calibrated        per channel, calibrated        none
token      per token (dynamic)            per token (dynamic)            2 x 2 per kv head
kivi       per channel, calibrated        per token (dynamic)            2 per kv head
hybrid     per channel x per token        per channel x per token        2 x 2 per kv head
=========  =============================  =============================  ==================

Static per-channel scales follow the outlier channels RoPE'd keys have, but saturate on any
value beyond the calibrated range; per-token scales never saturate but one large channel sets
the step of all the others; ``kivi`` is KIVI's finding (keys per channel, values per token);
``hybrid`` divides by the calibrated channel scale first (balancing the channels) and then
takes the token's own maximum (no saturation). The default, ``hybrid``, is chosen from the
measurements of ``python -m pdserve.bench.kv_int8`` (docs/kv_int8.md).

Calibration: the model runs once over real text only, :data:`CALIBRATION_TEXTS` (documented in
:mod:`pdserve.engine.kv_calibration_text`) through the checkpoint's tokenizer, up to
``CALIBRATION_TOKENS`` tokens in prompts of at most 256, with a full-precision scratch pool;
the largest absolute K and V per (layer, kv head, channel), times ``headroom``, maps to 127.
A checkpoint without a tokenizer cannot be calibrated: only ``token`` (no static part) runs
there, the other schemes raise ValueError saying so. First and last layers can stay in the
model dtype
(``EngineConfig.kv_int8_keep_edge_layers``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.kv_calibration_text import CALIBRATION_TEXTS
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.schedule import ScheduledSequence
from pdserve.engine.sequence import Sequence
from pdserve.kernels import KVCacheLayer
from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 2048
CALIBRATION_MAX_LEN = 256


@dataclass(frozen=True)
class Int8Scheme:
    """Which scale factors the keys and values of an int8 layer carry."""

    name: str
    k_channel: bool  # keys: calibrated per-(head, channel) scale (else ones)
    k_token: bool  # keys: dynamic per-(token, head) scale
    v_channel: bool  # values: calibrated per-(head, channel) scale (else ones)
    v_token: bool  # values: dynamic per-(token, head) scale

    @property
    def needs_calibration(self) -> bool:
        return self.k_channel or self.v_channel

    @property
    def num_token_scaled(self) -> int:
        """Halves (K, V) that store a token scale."""
        return int(self.k_token) + int(self.v_token)


INT8_SCHEMES = {s.name: s for s in (
    Int8Scheme("static", k_channel=True, k_token=False, v_channel=True, v_token=False),
    Int8Scheme("token", k_channel=False, k_token=True, v_channel=False, v_token=True),
    Int8Scheme("kivi", k_channel=True, k_token=False, v_channel=False, v_token=True),
    Int8Scheme("hybrid", k_channel=True, k_token=True, v_channel=True, v_token=True),
)}


def token_scale_bytes_per_block(mc, block_size: int, scheme: Int8Scheme) -> int:
    """Bytes the token scales of one int8 layer's block take."""
    element = torch.empty((), dtype=TOKEN_SCALE_DTYPE).element_size()
    return scheme.num_token_scaled * block_size * mc.num_key_value_heads * element


def calibration_prompts(tokenizer, vocab_size: int, max_len: int = CALIBRATION_MAX_LEN,
                        total_tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """:data:`CALIBRATION_TEXTS` as prompts of at most ``max_len`` tokens, each text cut into
    windows, ``total_tokens`` in all at most (real text only, no random ids)."""
    prompts: list[list[int]] = []
    budget = total_tokens
    for text in CALIBRATION_TEXTS:
        ids = [t for t in tokenizer.encode(text) if t < vocab_size]
        for start in range(0, len(ids), max_len):
            window = ids[start:start + max_len][:budget]
            if len(window) > 1:
                prompts.append(window)
                budget -= len(window)
    return prompts


@torch.inference_mode()
def calibrate_kv_scales(model, mc, layer_dtypes: list[torch.dtype], device: torch.device,
                        backend: str, tokenizer, headroom: float = 1.0, block_size: int = 16,
                        scheme: Int8Scheme = INT8_SCHEMES["static"]
                        ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """(k_scale, v_scale), each (kv_heads, head_dim) fp32, for every int8 layer; None elsewhere.
    A half the scheme gives no channel scale gets ones."""
    from pdserve.engine.model_runner import ModelRunner

    shape = (mc.num_key_value_heads, mc.head_dim)
    ones = torch.ones(shape, dtype=torch.float32, device=device)
    if not scheme.needs_calibration:
        return [(ones, ones) if d == torch.int8 else None for d in layer_dtypes]
    if tokenizer is None:
        raise ValueError(f"kv_int8_scales={scheme.name!r} calibrates on text and needs the "
                         "checkpoint's tokenizer; kv_int8_scales='token' needs no calibration")
    max_len = min(CALIBRATION_MAX_LEN, mc.max_position_embeddings)
    prompts = calibration_prompts(tokenizer, mc.vocab_size, max_len)
    blocks_per_prompt = -(-max_len // block_size)
    num_blocks = blocks_per_prompt * len(prompts)
    pool_shape = (2, num_blocks, block_size, *shape)
    caches = [KVCacheLayer(torch.zeros(pool_shape, dtype=model.dtype, device=device))
              for _ in layer_dtypes]
    scheduled = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"calib-{i}", prompt, SamplingParams(max_tokens=1))
        seq.block_table = list(range(i * blocks_per_prompt, (i + 1) * blocks_per_prompt))
        scheduled.append(ScheduledSequence(seq, len(prompt)))
    runner = ModelRunner(model, caches, block_size, device, backend)
    runner.execute(scheduled)  # writes every prompt's K/V into the scratch pool
    scales = []
    for cache, dtype in zip(caches, layer_dtypes, strict=True):
        if dtype != torch.int8:
            scales.append(None)
            continue
        # (2, blocks, block_size, kv_heads, head_dim) -> (2, kv_heads, head_dim); unused slots are 0
        absmax = cache.kv.float().abs().amax(dim=(1, 2))
        scale = (absmax * headroom / 127.0).clamp_min(1e-8)
        scales.append((scale[0].contiguous() if scheme.k_channel else ones,
                       scale[1].contiguous() if scheme.v_channel else ones))
    logger.info("calibrated int8 KV scales (%s) on %d tokens of text", scheme.name,
                sum(map(len, prompts)))
    return scales
