"""The top-k, top-p and min-p filters of the sampler (``engine.sampler``), and the pieces the
draw shares with them.

The filters work on ``exp(logit - max)`` (max 1 per row, so min-p is ``weight >= min_p``) and
are thresholds per row. Top-k is one ranking (``top_values``: ``torch.topk``, or on CPU
numpy's vectorised sort, much faster there) with the largest k in the batch. Top-p ranks only
candidates: the tokens with ``p >= (1 - top_p) / (2 * vocab)`` are a superset of the kept set
(the others hold less than half of the mass top-p drops); on CPU, or if no row has more than
256 of them, they are ranked with ``top_values``, otherwise a two-level radix select on the
float32 bit patterns (histograms by ``index_add_``) finds the boundary sub-bucket (tokens
within ~5e-4 relative) and only that one is ranked. (num_rows, vocab) int64 tensors are
avoided: on CPU they cost more than the float math.
"""

from __future__ import annotations

import numpy as np
import torch

CDF_BLOCK = 128  # tokens per block of the sums (and of the draw's two-level inverse CDF)
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)  # dtypes numpy can view
_LOW_BITS = 12  # float32 bits below the radix-select keys (2**-11 relative: near-ties)
_HI_BUCKETS = 1024  # level-1 radix buckets: weights <= 1.0 have bits >> 20 <= 1016
_TOP_P_RANK_MAX = 256  # off CPU top-p ranks this many candidates; more: radix select
_SORT_VOCAB_MAX = 1024  # top_values on CPU: up to this vocabulary numpy sorts whole rows
_PARTITION_K_MIN = 64  # above it, from this k numpy partitions; below, torch.topk is faster


def block_sums(weights: torch.Tensor) -> torch.Tensor:
    """(rows, num_blocks) sums of 128-token blocks (zero-padded).

    Summing in fixed blocks keeps a row's sums independent of the batch: a plain ``sum(dim=1)``
    may split one long row across threads when the batch is small, changing the rounding.
    """
    rows, vocab = weights.shape
    pad = (-vocab) % CDF_BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    return weights.view(rows, -1, CDF_BLOCK).sum(dim=2)  # (rows, num_blocks)


def _as_float(mask: torch.Tensor) -> torch.Tensor:
    """bool -> float32 before multiplying: much faster on CPU than mixing dtypes in ``mul``."""
    return mask.to(torch.float32)


def softmax_weights(scaled: torch.Tensor) -> torch.Tensor:
    """In place: ``exp(logits - max)``, the unnormalized softmax; the most likely token weighs 1."""
    return scaled.sub_(scaled.amax(dim=1, keepdim=True)).exp_()


def numpy_viewable(x: torch.Tensor) -> bool:
    """A CPU tensor of a dtype numpy can view without a copy (:func:`top_values` then ranks
    it with numpy)."""
    return x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS


def top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk(x, k).values``: each row's ``k`` largest, in descending order. On CPU
    numpy's vectorised sort (a small vocabulary) or partition then sort (large k) where they
    are faster: 20-30x for a 512-token vocabulary, 2x for k = 256 of 32k; the same values."""
    vocab = x.shape[1]
    if (not numpy_viewable(x) or not 0 < k <= vocab
            or (vocab > _SORT_VOCAB_MAX and k < _PARTITION_K_MIN)):
        return torch.topk(x, k).values
    rows = x.detach().numpy()
    if vocab > _SORT_VOCAB_MAX:
        rows = np.partition(rows, vocab - k, axis=1)[:, vocab - k:]
    return torch.from_numpy(np.sort(rows, axis=1)[:, :-k - 1:-1].copy())


def _top_k_threshold(weights: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """(rows,) weight of the k-th most likely token; 0 (keep all) where k == 0 or k >= vocab."""
    vocab = weights.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    thr = torch.zeros(weights.shape[0], dtype=weights.dtype, device=weights.device)
    if bool(active.any()):
        k = top_k[active]
        sub = weights if bool(active.all()) else weights[active]
        values = top_values(sub, int(k.max()))  # (num_active, k_max) descending
        thr[active] = values.gather(1, (k - 1)[:, None]).squeeze(1)
    return thr


def _rank_top_p(weights: torch.Tensor, target: torch.Tensor,
                num_candidates: torch.Tensor) -> torch.Tensor:
    """Weight of the last token top-p keeps, the kept set lying within ``num_candidates`` best."""
    values = top_values(weights, int(num_candidates.max()))  # (rows, k) descending
    above = torch.cumsum(values, dim=1) - values  # mass strictly above each candidate
    num_keep = ((above < target[:, None]) & (values > 0)).sum(1).clamp(min=1)
    num_keep = torch.minimum(num_keep, num_candidates.long())
    return values.gather(1, (num_keep - 1)[:, None]).squeeze(1)


def _histogram(keys: torch.Tensor, weights: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """(rows, num_buckets) sum of the weights per key; int32 flat indices (no int64 copy)."""
    rows = keys.shape[0]
    offsets = torch.arange(rows, dtype=torch.int32, device=keys.device)[:, None] * num_buckets
    hist = torch.zeros(rows * num_buckets, dtype=weights.dtype, device=weights.device)
    hist.index_add_(0, (keys + offsets).view(-1), weights.reshape(-1))
    return hist.view(rows, num_buckets)  # (rows, num_buckets)


def _boundary_bucket(hist: torch.Tensor, base: torch.Tensor,
                     target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest nonempty bucket whose best token top-p keeps, and the mass above that bucket.

    ``hist`` (rows, buckets) holds each bucket's mass, buckets in increasing weight order;
    ``base`` is the mass above all of them; a token is kept if the mass above it < ``target``.
    """
    above = hist.flip(1).cumsum(1).flip(1) - hist + base[:, None]  # (rows, buckets)
    usable = (above < target[:, None]) & (hist > 0)
    bucket = usable.to(torch.float32).argmax(dim=1)  # first (lowest) usable bucket
    return bucket.to(torch.int32), above.gather(1, bucket[:, None]).squeeze(1)


def _radix_top_p(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Weight of the last token top-p keeps: radix select on the float bits, no sort.

    For weights >= 0 the int32 bit pattern orders like the value. Level 1 buckets by the top
    bits (exponent + 3 mantissa bits, 1/8 octave), level 2 by the next 8 bits inside the boundary
    bucket; only the tokens of the final boundary sub-bucket (near-ties) are ranked with topk.
    """
    key = (weights.view(torch.int32) >> _LOW_BITS).clamp_(max=(_HI_BUCKETS << 8) - 1)  # NaN-safe
    high = key >> 8  # (rows, vocab) level-1 bucket
    bucket_hi, base = _boundary_bucket(_histogram(high, weights, _HI_BUCKETS),
                                       torch.zeros_like(target), target)
    in_bucket = weights * _as_float(high == bucket_hi[:, None])  # the rest weigh 0 at level 2
    bucket_lo, base = _boundary_bucket(_histogram(key & 255, in_bucket, 256), base, target)
    chosen = key == ((bucket_hi << 8) | bucket_lo)[:, None]
    num_chosen = int(chosen.sum(1, dtype=torch.int32).max())
    values = top_values(weights * _as_float(chosen), num_chosen)  # (rows, k) desc
    above = torch.cumsum(values, dim=1) - values + base[:, None]
    num_keep = ((above < target[:, None]) & (values > 0)).sum(1).clamp(min=1)
    return values.gather(1, (num_keep - 1)[:, None]).squeeze(1)


def _top_p_threshold(weights: torch.Tensor, top_k_thr: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """(rows,) weight of the least likely token top-p keeps; 0 (keep all) where top_p == 1."""
    vocab = weights.shape[1]
    thr = torch.zeros(weights.shape[0], dtype=weights.dtype, device=weights.device)
    active = top_p < 1.0
    if not bool(active.any()):
        return thr
    sub = weights if bool(active.all()) else weights[active]  # (num_active, vocab)
    k_thr = top_k_thr[active]
    if bool((k_thr > 0).any()):
        sub = sub * _as_float(sub >= k_thr[:, None])  # top-p sees what top-k left
    mass = block_sums(sub).sum(dim=1)
    p = top_p[active]
    # Tokens below this bound hold < (1 - p) / 2 of the mass, so the kept set lies above it.
    bound = mass * (1.0 - p) / (2 * vocab)
    num_candidates = (sub >= bound[:, None]).sum(1, dtype=torch.int32)
    if int(num_candidates.max()) <= _rank_limit(sub):
        thr[active] = _rank_top_p(sub, p * mass, num_candidates)
    else:
        thr[active] = _radix_top_p(sub, p * mass)
    return thr


def _rank_limit(weights: torch.Tensor) -> int:
    """How many top-p candidates are ranked rather than radix-selected: all of them where
    :func:`top_values` sorts with numpy (3x faster than the radix select at 32k tokens)."""
    if numpy_viewable(weights):
        return weights.shape[1]
    return _TOP_P_RANK_MAX


def filter_weights(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """In place: top-k, top-p, min-p zero the weights of filtered tokens (a threshold per row).

    ``weights`` are ``softmax_weights`` (max 1 per row), so min-p is simply ``weight >= min_p``.
    """
    thr_k = _top_k_threshold(weights, top_k)
    thr_p = _top_p_threshold(weights, thr_k, top_p)
    thr = torch.maximum(torch.maximum(thr_k, thr_p), min_p)
    return weights.mul_(_as_float(weights >= thr[:, None]))
