"""What one step costs in FLOPs and bytes, what this device can do, and which of the two binds.

The arithmetic behind the prefill/decode split (prefill is compute-bound, decode
bandwidth-bound; docs/architecture.md), shared by the capacity planner (``pdserve plan``) and
by every worker, which reports what binds it now (``worker_api.stats.Utilization``: the
figures it sends, and which of the two is closer to its peak).

Per step of ``num_tokens`` new tokens, ``attended`` (query, key) pairs (the sum over new tokens
of the context each attends to), ``num_context`` KV tokens read and ``num_sampled`` logits rows:

* FLOPs = 2 x ``linear_params`` x num_tokens            (every decoder projection, one MAC each)
  + 4 x layers x heads x head_dim x attended             (Q.K^T and P.V)
  + 2 x vocab x hidden x num_sampled                     (the LM head, sampled rows only);
* bytes = weight bytes (each read once per step) + num_context x KV bytes per token (the
  context read and the new tokens' KV written: num_context counts both). Activations are
  left out: at serving sizes they are small against weights and KV, and mostly stay in cache.

Sliding windows and prefix-cache hits are not modelled (a window only shortens ``attended``),
nor the last layer's unsampled rows, which compute their K/V and nothing else (at most 1/layers
of a prompt's FLOPs counted that were not spent).

:class:`UtilizationMeter` sums those costs over the forward passes of the last ``window_s``
seconds; achieved FLOP/s and bytes/s are taken per forward second (the rate while computing),
``busy_fraction`` is forward time over wall time. :func:`measure_peaks` measures this device's
dense matmul rate and copy bandwidth once per process (the "measured peak" both are held to;
a worker never holds them below the rates it has sustained itself over a window, since a probe
run on a busy machine reads low).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from pdserve.worker_api.stats import Utilization

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepCost:
    """The cost model of one model (see the module docstring)."""

    linear_params: int  # decoder projection weights (q, k, v, o, gate, up, down), all layers
    attention_flops_per_pair: int  # 4 x layers x heads x head_dim
    lm_head_flops_per_row: int  # 2 x vocab x hidden
    weight_bytes: int  # as the engine counts them (parameters and buffers, as stored)
    kv_bytes_per_token: int  # all layers, K and V, as the pool stores them

    @classmethod
    def for_model(cls, mc, weight_bytes: int, kv_bytes_per_token: int) -> StepCost:
        h = mc.hidden_size
        per_layer = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * mc.intermediate_size
        return cls(per_layer * mc.num_hidden_layers,
                   4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim,
                   2 * mc.vocab_size * h, weight_bytes, kv_bytes_per_token)

    def flops(self, num_tokens: int, attended: int, num_sampled: int) -> int:
        return (2 * self.linear_params * num_tokens + self.attention_flops_per_pair * attended
                + self.lm_head_flops_per_row * num_sampled)

    def bytes(self, num_context: int) -> int:
        """Weights + the KV of ``num_context`` tokens (the new ones, written, included)."""
        return self.weight_bytes + num_context * self.kv_bytes_per_token

    def prefill(self, num_tokens: int, num_seqs: int = 1) -> tuple[int, int]:
        """(FLOPs, bytes) of prefilling ``num_seqs`` prompts of ``num_tokens`` from scratch in
        one step."""
        attended = num_seqs * num_tokens * (num_tokens + 1) // 2
        return (self.flops(num_seqs * num_tokens, attended, num_seqs),
                self.bytes(num_seqs * num_tokens))

    def decode(self, batch: int, context: int) -> tuple[int, int]:
        """(FLOPs, bytes) of one decode step of ``batch`` sequences of ``context`` tokens
        (the new token included)."""
        return self.flops(batch, batch * context, batch), self.bytes(batch * context)


def attended_pairs(starts: list[int], q_lens: list[int]) -> int:
    """Sum over a step's new tokens of the context each attends to (causal, no window):
    a chunk of ``q`` tokens after ``s`` computed ones attends q x s + q(q + 1) / 2 pairs."""
    return sum(q * s + q * (q + 1) // 2 for s, q in zip(starts, q_lens, strict=True))


class UtilizationMeter:
    """Costs of the forward passes of the last ``window_s`` seconds (thread-safe: steps record
    on the engine thread, stats may read from another)."""

    def __init__(self, cost: StepCost, device: torch.device, dtype: torch.dtype,
                 window_s: float = 5.0) -> None:
        self.cost = cost
        self.device = device
        self.dtype = dtype
        self.window_s = window_s
        self._steps: deque[tuple[float, int, int, float]] = deque()  # (end, flops, bytes, s)
        self._lock = threading.Lock()
        self._peaks: tuple[float, float] | None = None
        self._best = (0.0, 0.0)  # the highest window rates seen (FLOP/s, bytes/s)

    def peaks(self) -> tuple[float, float]:
        """:func:`measure_peaks` of the meter's device, once; (0, 0) when it cannot be measured
        (a device without room for the probes: utilisation then reads 0)."""
        if self._peaks is None:
            try:
                self._peaks = measure_peaks(self.device.type, self.dtype)
            except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError included
                logger.warning("cannot measure the device's peaks (%s): utilisation is 0", exc)
                self._peaks = (0.0, 0.0)
        return self._peaks

    def record(self, num_tokens: int, attended: int, num_context: int, num_sampled: int,
               seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        entry = (now, self.cost.flops(num_tokens, attended, num_sampled),
                 self.cost.bytes(num_context), seconds)
        with self._lock:
            self._steps.append(entry)
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()

    def snapshot(self, now: float | None = None, peaks: tuple[float, float] | None = None
                 ) -> Utilization:
        """Rates over the window; ``peaks`` (FLOP/s, bytes/s) default to :func:`measure_peaks`
        of the meter's device (measured on first use)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            steps = list(self._steps)
        seconds = sum(s[3] for s in steps)
        flops = sum(s[1] for s in steps) / seconds if seconds > 0 else 0.0
        nbytes = sum(s[2] for s in steps) / seconds if seconds > 0 else 0.0
        if peaks is None:  # a probe disturbed by a busy machine reads low: never below what
            # this worker has itself sustained over a window
            self._best = (max(self._best[0], flops), max(self._best[1], nbytes))
            probe = self.peaks()
            peaks = (max(probe[0], self._best[0]) if probe[0] else 0.0,
                     max(probe[1], self._best[1]) if probe[1] else 0.0)
        if not steps or seconds <= 0:
            return Utilization(peak_flops_per_s=peaks[0], peak_bytes_per_s=peaks[1])
        span = max(now - (steps[0][0] - steps[0][3]), seconds)
        return Utilization(flops, nbytes, peaks[0], peaks[1], seconds / span)


def _best_seconds(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_rate(device: str, dtype: torch.dtype, n: int | None = None, repeats: int = 3) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` matmul in ``dtype`` (best of ``repeats``)."""
    n = n or (4096 if device == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b), repeats, sync)


def copy_bandwidth(device: str, nbytes: int | None = None, repeats: int = 3) -> float:
    """Bytes/s moved (read + write) by a device-local copy of ``nbytes`` (best of ``repeats``;
    the default is larger than CPU caches)."""
    nbytes = nbytes or (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats, sync)


def gemv_bandwidth(device: str, dtype: torch.dtype, nbytes: int | None = None,
                   repeats: int = 3) -> float:
    """Weight bytes/s a one-row ``linear`` streams (the decode step's own kernel at batch 1):
    on CPUs far below the copy bandwidth, on GPUs close to it."""
    nbytes = nbytes or ((1 << 30) if device == "cuda" else (256 << 20))
    cols = 4096
    element = torch.empty((), dtype=dtype).element_size()
    weight = torch.randn(nbytes // (cols * element), cols, device=device).to(dtype)
    x = torch.randn(1, cols, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    seconds = _best_seconds(lambda: torch.nn.functional.linear(x, weight), repeats, sync)
    return weight.numel() * element / seconds


@functools.lru_cache(maxsize=8)
def measure_peaks(device: str, dtype: torch.dtype, thorough: bool = False
                  ) -> tuple[float, float]:
    """(matmul FLOP/s in ``dtype``, copy bytes/s) of this process's ``device``, measured once
    (``thorough``: a larger matmul, more repeats; the planner's, not every worker's)."""
    with torch.inference_mode():
        if thorough:
            return (matmul_rate(device, dtype, 8192 if device == "cuda" else 2048, 5),
                    copy_bandwidth(device, (1 << 30) if device == "cuda" else None, 5))
        return matmul_rate(device, dtype), copy_bandwidth(device)
