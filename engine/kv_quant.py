"""int8 KV cache calibration: one scale per (layer, K/V, kv head, channel).

How: the model runs once over a calibration set (the built-in text below through the
checkpoint's tokenizer, plus seeded random token ids, ``CALIBRATION_TOKENS`` tokens in all) with
a full-precision scratch pool; for every layer the largest absolute K and V value per
(kv head, channel) over all calibration tokens, times ``headroom``, maps to 127::

    scale = headroom * absmax / 127;   stored = round(x / scale) clamped to [-127, 127]

Per-channel scales follow the outlier channels RoPE'd keys have. Values beyond the calibrated
range saturate. First and last layers can stay in the model dtype
(``EngineConfig.kv_int8_keep_edge_layers``): they are the most sensitive.
"""

from __future__ import annotations

import logging
import random

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSequence
from pdserve.engine.sequence import Sequence
from pdserve.kernels import KVCacheLayer

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 2048
CALIBRATION_TEXT = (
    "The history of computing is a story of layers: transistors become gates, gates become "
    "processors, processors run compilers, and compilers turn ideas into programs. A language "
    "model reads a prompt, turns every word into vectors, and attends over everything it has "
    "seen so far. Numbers like 3.14159, 2048 and 1e-5 appear next to code such as "
    "`for i in range(n): total += x[i]`, dates like 2024-05-17, names, lists, and questions: "
    "What is the capital of France? Why is the sky blue? How many blocks fit in memory? "
)


def calibration_prompts(tokenizer, vocab_size: int, max_len: int, seed: int = 0,
                        total_tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """Text prompts (when a tokenizer exists) and random-id prompts, ``max_len`` tokens each."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT * 8)
        ids = [t for t in ids if t < vocab_size]
        prompts += [ids[i:i + max_len] for i in range(0, min(len(ids), total_tokens // 2),
                                                        max_len)]
    while sum(map(len, prompts)) < total_tokens:
        prompts.append([rng.randrange(vocab_size) for _ in range(max_len)])
    return [p for p in prompts if p]


@torch.inference_mode()
def calibrate_kv_scales(model, mc, layer_dtypes: list[torch.dtype], device: torch.device,
                        backend: str, tokenizer=None, headroom: float = 1.0,
                        block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """(k_scale, v_scale), each (kv_heads, head_dim) fp32, for every int8 layer; None elsewhere."""
    from pdserve.engine.model_runner import ModelRunner

    max_len = min(256, mc.max_position_embeddings)
    prompts = calibration_prompts(tokenizer, mc.vocab_size, max_len)
    blocks_per_prompt = -(-max_len // block_size)
    num_blocks = blocks_per_prompt * len(prompts)
    shape = (2, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim)
    caches = [KVCacheLayer(torch.zeros(shape, dtype=model.dtype, device=device))
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
        scales.append((scale[0].contiguous(), scale[1].contiguous()))
    logger.info("calibrated int8 KV scales on %d tokens", sum(map(len, prompts)))
    return scales
