"""The top-k, top-p and min-p filters of the sampler (``engine.sampling.sampler``), and the
pieces the draw shares with them.

The filters work on ``exp(logit - max)`` (max 1 per row, so min-p is ``weight >= min_p``) and
are thresholds per row. Top-k is one ranking (``top_values``: ``torch.topk``, or on CPU
numpy's vectorised sort, much faster there) with the largest k in the batch. Top-p ranks only
candidates: the tokens with ``p >= (1 - top_p) / (2 * vocab)`` are a superset of the kept set
(the others hold less than half of the mass top-p drops); on CPU, or if no row has more than
256 of them, they are ranked with ``top_values``, otherwise a two-level radix select on the
float32 bit patterns (histograms by ``index_add_``) finds the boundary sub-bucket (tokens
within ~5e-4 relative) and only that one is ranked. (num_rows, vocab) int64 tensors are
avoided: on CPU they cost more than the float math. On CPU the compares, counts and masks
over (rows, vocab) run as numpy ops on the same memory (torch's compare to bool costs 2-3x
more there); the weights are the same bit for bit.
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


def _numpy_pair(x: torch.Tensor, *per_row: torch.Tensor) -> bool:
    """``x`` and its per-row values are CPU tensors of one dtype numpy views: the
    elementwise compares and arithmetic then run as numpy ops (faster than torch's on small
    CPU tensors: docs/cpu-speed.md), with the same results."""
    return numpy_viewable(x) and all(numpy_viewable(v) and v.dtype == x.dtype for v in per_row)


def _zero_below(weights: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """In place: each row's weights below its threshold ``thr`` become 0."""
    if _numpy_pair(weights, thr):
        w = weights.detach().numpy()
        w *= w >= thr.detach().numpy()[:, None]
        return weights
    return weights.mul_(_as_float(weights >= thr[:, None]))


def _count_at_least(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: how many of each row's values are >= its ``bound``."""
    if _numpy_pair(x, bound):
        counts = np.count_nonzero(x.detach().numpy() >= bound.detach().numpy()[:, None], axis=1)
        return torch.from_numpy(counts.astype(np.int64))
    return (x >= bound[:, None]).sum(1)


def _count_kept(values: torch.Tensor, target: torch.Tensor,
                base: torch.Tensor | None = None) -> torch.Tensor:
    """(rows,) int64, at least 1: how many of the ranked ``values`` (descending) top-p keeps,
    those that weigh something and have less than ``target`` of mass above them (``base``
    plus the values before them)."""
    cum = torch.cumsum(values, dim=1)  # (on CPU float32 sums accumulate in float64)
    per_row = (target,) if base is None else (target, base)
    if _numpy_pair(values, cum, *per_row):
        v = values.detach().numpy()
        above = cum.numpy() - v
        if base is not None:
            above += base.detach().numpy()[:, None]
        kept = (above < target.detach().numpy()[:, None]) & (v > 0)
        return torch.from_numpy(np.count_nonzero(kept, axis=1).astype(np.int64)).clamp_(min=1)
    above = cum - values if base is None else cum - values + base[:, None]
    return ((above < target[:, None]) & (values > 0)).sum(1).clamp(min=1)


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


def _where_active(active: torch.Tensor, thresholds, weights: torch.Tensor,
                  *per_row: torch.Tensor) -> torch.Tensor:
    """(rows,) ``thresholds(weights, *per_row)`` of the rows where ``active`` holds, 0 (keep
    all) elsewhere; no row is copied out when every row is active."""
    if len(active) and bool(active.all()):
        return thresholds(weights, *per_row)
    thr = torch.zeros(weights.shape[0], dtype=weights.dtype, device=weights.device)
    if bool(active.any()):
        thr[active] = thresholds(weights[active], *(x[active] for x in per_row))
    return thr


def _top_k_threshold(weights: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """(rows,) weight of the k-th most likely token; 0 (keep all) where k == 0 or k >= vocab."""
    return _where_active((top_k > 0) & (top_k < weights.shape[1]), _kth_values, weights, top_k)


def _kth_values(weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    values = top_values(weights, int(k.max()))  # (rows, k_max) descending
    return values.gather(1, (k - 1)[:, None]).squeeze(1)


def _rank_top_p(weights: torch.Tensor, target: torch.Tensor,
                num_candidates: torch.Tensor) -> torch.Tensor:
    """Weight of the last token top-p keeps, the kept set lying within ``num_candidates`` best."""
    values = top_values(weights, int(num_candidates.max()))  # (rows, k) descending
    num_keep = torch.minimum(_count_kept(values, target), num_candidates)
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
    num_keep = _count_kept(values, target, base)
    return values.gather(1, (num_keep - 1)[:, None]).squeeze(1)


def _top_p_threshold(weights: torch.Tensor, top_k_thr: torch.Tensor | None,
                     top_p: torch.Tensor) -> torch.Tensor:
    """(rows,) weight of the least likely token top-p keeps; 0 (keep all) where top_p == 1.
    ``top_k_thr``: top-k's thresholds, which top-p applies first (None: no top-k)."""
    per_row = (top_p,) if top_k_thr is None else (top_p, top_k_thr)
    return _where_active(top_p < 1.0, _top_p_rows, weights, *per_row)


def _top_p_rows(weights: torch.Tensor, top_p: torch.Tensor,
                top_k_thr: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_top_p_threshold` of rows that all have top-p on."""
    if top_k_thr is not None and bool((top_k_thr > 0).any()):
        weights = _zero_below(weights.clone(), top_k_thr)  # top-p sees what top-k left
    mass = block_sums(weights).sum(dim=1)
    # Tokens below this bound hold < (1 - p) / 2 of the mass, so the kept set lies above it.
    bound = mass * (1.0 - top_p) / (2 * weights.shape[1])
    num_candidates = _count_at_least(weights, bound)
    if int(num_candidates.max()) <= _rank_limit(weights):
        return _rank_top_p(weights, top_p * mass, num_candidates)
    return _radix_top_p(weights, top_p * mass)


def _rank_limit(weights: torch.Tensor) -> int:
    """How many top-p candidates are ranked rather than radix-selected: all of them where
    :func:`top_values` sorts with numpy (faster there than the radix select)."""
    if numpy_viewable(weights):
        return weights.shape[1]
    return _TOP_P_RANK_MAX


def filter_weights(weights: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """In place: top-k, top-p, min-p zero the weights of filtered tokens (a threshold per row).
    A filter that no row uses may be None (its ops are skipped; the weights are the same).

    ``weights`` are ``softmax_weights`` (max 1 per row), so min-p is simply ``weight >= min_p``.
    """
    thr_k = None if top_k is None else _top_k_threshold(weights, top_k)
    thr_p = None if top_p is None else _top_p_threshold(weights, thr_k, top_p)
    thresholds = [thr for thr in (thr_k, thr_p, min_p) if thr is not None]
    if not thresholds:
        return weights
    thr = thresholds[0]
    for other in thresholds[1:]:
        thr = torch.maximum(thr, other)
    return _zero_below(weights, thr)
