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

Calibration (run by :mod:`pdserve.engine.int8_calibration`: it runs the model, so this folder
needs nothing of the step): the model runs once over real text only,
:data:`CALIBRATION_TEXTS` (documented in :mod:`pdserve.engine.kv_cache.calibration_text`)
through the checkpoint's tokenizer, up to
``CALIBRATION_TOKENS`` tokens in prompts of at most 256, with a full-precision scratch pool;
the largest absolute K and V per (layer, kv head, channel), times ``headroom``, maps to 127.
A checkpoint without a tokenizer cannot be calibrated: only ``token`` (no static part) runs
there, the other schemes raise ValueError saying so. First and last layers can stay in the
model dtype
(``EngineConfig.kv_int8_keep_edge_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache.calibration_text import CALIBRATION_TEXTS
from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE

CALIBRATION_TOKENS = 2048
CALIBRATION_MAX_LEN = 256
MIN_TEXT_KNOWN = 0.9  # share of the calibration text's tokens the tokenizer must know
MIN_DISTINCT_TOKENS = 64  # ... and different tokens it must read it as (or a quarter of vocab)
CHANNEL_SCALE_FLOOR = 1 / 64  # no channel's scale below this share of its head's largest: a
# channel the calibration barely saw would otherwise amplify its values past all others (hybrid
# then quantises the others to 0) or saturate (static)
MIN_CHANNEL_SCALE = 1e-8  # an all-zero head (never written) still divides by something
CHECK_PROMPTS, CHECK_LEN, CHECK_SEED = 4, 64, 1  # the start-up check's random prompts
MIN_CHECK_TOP1 = 0.8  # the start-up check passes at this teacher-forced top-1 agreement
MAX_CHECK_KL = 0.02  # ... and this mean KL (nats) with the model-dtype cache, at most


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


@dataclass(frozen=True)
class Calibration:
    """What an int8 pool's static channel scales were calibrated on, and how the pool compared
    with the model dtype at start-up (the memory ledger and ``pdserve status`` show it)."""

    scheme: str  # the scheme the pool runs
    source: str  # "text" | "random token ids" | "none" (the scheme has no static part)
    num_tokens: int = 0  # tokens the model ran over to calibrate
    text_known: float | None = None  # share of the calibration text's tokens the tokenizer
    # knows (not its unknown token); None when not measured (no tokenizer, no static part)
    check: QualityCheck | None = None  # the start-up comparison with the model dtype
    fallback_from: str | None = None  # the configured scheme, when it failed its check

    def describe(self) -> str:
        parts = [self.scheme]
        if self.fallback_from:
            parts.append(f"(fallback from {self.fallback_from}, which failed the check)")
        if self.source == "none":
            parts.append("no calibration (dynamic scales)")
        else:
            parts.append(f"calibrated on {self.num_tokens} {self.source}")
        if self.text_known is not None and self.source != "text":
            parts.append(f"(the calibration text is {1 - self.text_known:.0%} unknown to "
                         f"the tokenizer)")
        if self.check is not None:
            parts.append(f"; check: {self.check.describe()}")
        return " ".join(parts).replace(" ;", ";")


@dataclass(frozen=True)
class QualityCheck:
    """Teacher-forced agreement of an int8 pool with the model-dtype cache on the same
    prompts (:func:`check_int8_quality`)."""

    top1: float  # share of positions whose argmax next token is the same
    kl: float  # mean KL(p_model_dtype || p_int8) per position, nats
    num_positions: int
    finite: bool = True  # every int8 logit finite

    @property
    def passed(self) -> bool:
        return self.finite and self.top1 >= MIN_CHECK_TOP1 and self.kl <= MAX_CHECK_KL

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"top-1 {self.top1:.1%}, KL {self.kl:.2e} nats over {self.num_positions} "
                f"positions{'' if self.finite else ', non-finite logits'} ({verdict}: needs "
                f"top-1 >= {MIN_CHECK_TOP1:.0%} and KL <= {MAX_CHECK_KL})")


def unknown_token_id(tokenizer) -> int | None:
    """The id the tokenizer gives text it cannot represent (None: it can represent any text,
    as byte-level tokenizers can)."""
    backend = getattr(tokenizer, "backend", None)
    unk = getattr(getattr(backend, "model", None), "unk_token", None)
    return tokenizer.token_to_id(unk) if unk else None


def calibration_prompts(tokenizer, vocab_size: int, max_len: int = CALIBRATION_MAX_LEN,
                        total_tokens: int = CALIBRATION_TOKENS
                        ) -> tuple[list[list[int]], float]:
    """(:data:`CALIBRATION_TEXTS` as prompts of at most ``max_len`` tokens, each text cut into
    windows, ``total_tokens`` in all at most; the share of the text's tokens the tokenizer
    knows). Real text only, no random ids."""
    prompts: list[list[int]] = []
    budget, known, total = total_tokens, 0, 0
    unknown = unknown_token_id(tokenizer)
    for text in CALIBRATION_TEXTS:
        ids = [t for t in tokenizer.encode(text) if t < vocab_size]
        known += sum(t != unknown for t in ids)
        total += len(ids)
        for start in range(0, len(ids), max_len):
            window = ids[start:start + max_len][:budget]
            if len(window) > 1:
                prompts.append(window)
                budget -= len(window)
    return prompts, known / total if total else 0.0


def text_fits(prompts: list[list[int]], known: float, vocab_size: int) -> bool:
    """Whether the calibration text, as this tokenizer reads it, can stand for real inputs:
    mostly known tokens, and enough different ones (a text read as a few ids over and over
    calibrates the channels of those ids only)."""
    distinct = len({t for prompt in prompts for t in prompt})
    return known >= MIN_TEXT_KNOWN and distinct >= min(MIN_DISTINCT_TOKENS, vocab_size // 4)


def random_prompts(vocab_size: int, max_len: int, total_tokens: int,
                   seed: int = 0) -> list[list[int]]:
    """Prompts of token ids drawn uniformly from the vocabulary (seeded: the same on every
    worker, so every worker of a model gets the same scales)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [max_len] * (total_tokens // max_len)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
