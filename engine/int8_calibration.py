"""int8 KV calibration and the start-up quality check: the model run over prompts with a
scratch pool (:mod:`pdserve.engine.kv_cache.int8_scales` has the schemes, what they are
calibrated on and the thresholds). It runs the model through the step's runner, so it sits
above both the KV cache and the step folders, beside ``parts.py``, which calls it.
"""

from __future__ import annotations

import logging
import math

import torch

from pdserve.engine.kv_cache import int8_scales
from pdserve.engine.kv_cache.int8_scales import (
    CALIBRATION_MAX_LEN,
    CALIBRATION_TOKENS,
    CHECK_LEN,
    CHECK_PROMPTS,
    INT8_SCHEMES,
    MIN_CHANNEL_SCALE,
    Calibration,
    Int8Scheme,
    QualityCheck,
    calibration_prompts,
    random_prompts,
    text_fits,
)
from pdserve.engine.sequence import Sequence
from pdserve.engine.step.model_runner import ModelRunner
from pdserve.engine.step.scheduler_output import ScheduledSequence, SchedulerOutput
from pdserve.kernels import KVCacheLayer
from pdserve.worker_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# (CHANNEL_SCALE_FLOOR and CHECK_SEED are read from int8_scales at each call: tests set them)


@torch.inference_mode()
def calibrate_kv_scales(model, mc, layer_dtypes: list[torch.dtype], device: torch.device,
                        backend: str, tokenizer, headroom: float = 1.0, block_size: int = 16,
                        scheme: Int8Scheme = INT8_SCHEMES["static"]
                        ) -> tuple[list[tuple[torch.Tensor, torch.Tensor] | None], Calibration]:
    """((k_scale, v_scale), each (kv_heads, head_dim) fp32, for every int8 layer, None
    elsewhere; what they were calibrated on). A half the scheme gives no channel scale gets
    ones. The text of :data:`CALIBRATION_TEXTS` when this tokenizer can read it
    (:func:`text_fits`), else token ids drawn from the whole vocabulary; no channel's scale
    ends below ``CHANNEL_SCALE_FLOOR`` of its head's largest."""
    shape = (mc.num_key_value_heads, mc.head_dim)
    ones = torch.ones(shape, dtype=torch.float32, device=device)
    if not scheme.needs_calibration:
        return ([(ones, ones) if d == torch.int8 else None for d in layer_dtypes],
                Calibration(scheme.name, "none"))
    if tokenizer is None:
        raise ValueError(f"kv_int8_scales={scheme.name!r} calibrates on text and needs the "
                         "checkpoint's tokenizer; kv_int8_scales='token' needs no calibration")
    max_len = min(CALIBRATION_MAX_LEN, mc.max_position_embeddings)
    prompts, known = calibration_prompts(tokenizer, mc.vocab_size, max_len)
    source = "text"
    if not text_fits(prompts, known, mc.vocab_size):
        logger.warning("the int8 KV calibration text is %.0f%% unknown to this tokenizer (or "
                       "too few different tokens): calibrating on random token ids instead",
                       100 * (1 - known))
        prompts, source = random_prompts(mc.vocab_size, max_len, CALIBRATION_TOKENS), \
            "random token ids"
    caches = scratch_caches(mc, model.dtype, device, len(layer_dtypes), prompts, block_size)
    teacher_forced_logits(model, caches, block_size, device, backend, prompts)
    scales = []
    for cache, dtype in zip(caches, layer_dtypes, strict=True):
        if dtype != torch.int8:
            scales.append(None)
            continue
        # (2, blocks, block_size, kv_heads, head_dim) -> (2, kv_heads, head_dim); unused slots are 0
        absmax = cache.kv.float().abs().amax(dim=(1, 2)) * headroom
        floor = absmax.amax(dim=-1, keepdim=True) * int8_scales.CHANNEL_SCALE_FLOOR
        scale = (torch.maximum(absmax, floor) / 127.0).clamp_min(MIN_CHANNEL_SCALE)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"int8 KV calibration of kv_int8_scales={scheme.name!r} gave "
                             "non-finite scales (the model's K/V overflow on the calibration "
                             "prompts); use kv_cache_dtype='auto'")
        scales.append((scale[0].contiguous() if scheme.k_channel else ones,
                       scale[1].contiguous() if scheme.v_channel else ones))
    num_tokens = sum(map(len, prompts))
    logger.info("calibrated int8 KV scales (%s) on %d tokens of %s", scheme.name, num_tokens,
                source)
    return scales, Calibration(scheme.name, source, num_tokens, known)


def scratch_caches(mc, dtype: torch.dtype, device: torch.device, num_layers: int,
                   prompts: list[list[int]], block_size: int,
                   like: list[KVCacheLayer] | None = None) -> list[KVCacheLayer]:
    """Zeroed pools holding ``prompts`` side by side: in ``dtype``, or with the layout, scales
    and dtypes of ``like`` (an int8 pool's layers)."""
    num_blocks = sum(-(-len(p) // block_size) for p in prompts)
    shape = (2, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim)
    if like is None:
        return [KVCacheLayer(torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    return [KVCacheLayer(torch.zeros(shape, dtype=layer.kv.dtype, device=device),
                         layer.k_scale, layer.v_scale,
                         *(None if t is None else torch.ones(shape[1:4], dtype=t.dtype,
                                                             device=device)
                           for t in (layer.k_token_scale, layer.v_token_scale)))
            for layer in like]


@torch.inference_mode()
def teacher_forced_logits(model, caches: list[KVCacheLayer], block_size: int,
                          device: torch.device, backend: str,
                          prompts: list[list[int]]) -> list[torch.Tensor]:
    """(len(prompt), vocab) fp32 logits at every position of every prompt: one prefill over
    the paged ``caches`` (blocks laid out prompt after prompt), whose K/V are written and read
    as the engine writes and reads them (quantised when the pool is int8)."""
    runner = ModelRunner(model, caches, block_size, device, backend)
    logits, first = [], 0
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"kv-check-{i}", prompt, SamplingParams(max_tokens=1))
        blocks = -(-len(prompt) // block_size)
        seq.block_table = list(range(first, first + blocks))
        first += blocks
        batch = runner.prepare(SchedulerOutput(chunks=[ScheduledSequence(seq, len(prompt))]))
        hidden = model(batch.input_ids, batch.positions, caches, batch.metadata)
        logits.append(model.compute_logits(hidden).float())
    return logits


def check_int8_quality(model, mc, caches: list[KVCacheLayer], block_size: int,
                       device: torch.device, backend: str) -> QualityCheck:
    """Teacher-forced comparison of a pool laid out as ``caches`` with the model-dtype cache,
    on :data:`CHECK_PROMPTS` prompts of random token ids (seeded, not the calibration's)."""
    max_len = min(CHECK_LEN, mc.max_position_embeddings)
    prompts = random_prompts(mc.vocab_size, max_len, CHECK_PROMPTS * max_len,
                             seed=int8_scales.CHECK_SEED)
    reference = teacher_forced_logits(
        model, scratch_caches(mc, model.dtype, device, len(caches), prompts, block_size),
        block_size, device, backend, prompts)
    quantized = teacher_forced_logits(
        model, scratch_caches(mc, model.dtype, device, len(caches), prompts, block_size,
                              like=caches), block_size, device, backend, prompts)
    ref = torch.cat(reference).log_softmax(-1)
    out = torch.cat(quantized)
    finite = bool(torch.isfinite(out).all())
    out = out.nan_to_num().log_softmax(-1)
    kl = float((ref.exp() * (ref - out)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == out.argmax(-1)).float().mean())
    return QualityCheck(top1, kl if math.isfinite(kl) else math.inf, len(ref), finite)
