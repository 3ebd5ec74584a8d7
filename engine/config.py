"""Typed engine configuration with cross-field validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.engine_loop import check_step_timeout
from pdserve.engine.speculative_config import SpeculativeConfig
from pdserve.kernels.backends import BACKENDS

if TYPE_CHECKING:
    import torch


def check_admission_hold(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= value < float("inf"):
        raise ValueError(f"admission_hold_s must be a finite number of seconds >= 0, "
                         f"got {value!r}")


DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
KV_CACHE_DTYPES = ("auto", "int8")
# engine/kv_cache/int8_scales.py describes each
KV_INT8_SCALES = ("static", "token", "kivi", "hybrid")
DEFAULT_KV_INT8_SCALES = "hybrid"  # lowest KL / highest top-1 in bench.kv_int8 (docs/kv_int8.md)
DEFAULT_CPU_MEMORY_BUDGET = 4 << 30  # bytes for weights + KV pool + activations on a CPU worker


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_int8_tiers(config: EngineConfig) -> None:
    """``kv_offload_int8`` needs tiers, a float pool and one rank."""
    if not (config.kv_offload_cpu_gib or config.kv_offload_disk_gib):
        raise ValueError("kv_offload_int8 needs KV tiers (kv_offload_cpu_gib or "
                         "kv_offload_disk_gib)")
    if config.kv_cache_dtype == "int8":
        raise ValueError("kv_offload_int8 stores a float pool's blocks as int8; with "
                         "kv_cache_dtype='int8' the tiers store int8 already: drop it")
    if config.tensor_parallel_size > 1:
        raise ValueError("kv_offload_int8 with tensor_parallel_size > 1 is not supported (its "
                         "int8 calibration runs the model on one rank, as kv_cache_dtype='int8')")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (offline, colocated, prefill or decode worker) is built from."""

    model: str  # Hugging Face checkpoint folder, a .gguf file, or a folder holding one .gguf
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (CPU: fp32, CUDA: checkpoint)
    device: str = "auto"  # cpu | cuda | auto
    block_size: int = 16  # tokens per KV block
    kv_cache_dtype: str = "auto"  # auto (= model dtype) | int8
    kv_int8_keep_edge_layers: bool = False  # with int8: first and last layers stay in model
    # dtype (no quality gain with hybrid scales, less capacity: docs/kv_int8.md)
    kv_int8_scales: str = DEFAULT_KV_INT8_SCALES  # with int8: static | token | kivi | hybrid
    # (per-channel calibrated, per-token dynamic, or both; see pdserve.engine.kv_cache.int8_scales)
    num_kv_blocks: int | None = None  # pin the pool size instead of deriving it from the budget
    memory_budget_bytes: int | None = None  # worker memory for weights + KV + activations
    memory_safety_margin: float = 0.05  # fraction of the budget kept free
    max_num_seqs: int = 256  # sequences per step at most
    max_num_batched_tokens: int = 2048  # tokens per step at most (chunked prefill budget)
    max_model_len: int | None = None  # context limit; None = the model's max positions
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    admission_hold_s: float = 0.0  # while sequences decode, a new prompt waits up to this
    # long (seconds from its arrival) so that prompts arriving close together prefill in one
    # step and the decodes run without prefills between them: lower time per output token,
    # later first tokens; prompts go at once when nothing decodes, when as many wait as
    # decode, or when they fill a step. 0: admitted at once
    prefill_batch_tokens: int | None = None  # a step admits a further waiting prompt only
    # while its prompt tokens (prompt chunks and admitted prompts) stay within this many; the
    # step's first prompt always goes (split by max_num_batched_tokens alone). Every prompt in
    # a step waits for all of them: fewer a step, sooner first tokens. None: no bound but
    # max_num_batched_tokens
    attention_backend: str = "auto"  # auto | torch | native | triton
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, never as captured CUDA graphs
    cpu_packed_gemm: bool = True  # CPU, float32 (and bf16 where the CPU has oneDNN's bf16
    # kernels): linear layers through oneDNN with weights packed once at load
    # (pdserve.kernels.linear); off: plain F.linear
    seed: int = 0  # seeds the random streams of requests that bring no seed
    scheduling_policy: str = "fcfs"  # fcfs | priority: lower SamplingParams.priority first in
    # admission, prefill chunks and preemption (the router's waiting queue follows it too)
    speculative_config: dict | None = None  # speculative decoding on decode and colocated
    # workers, vLLM's keys: {"method": "draft_model", "model": DIR, "num_speculative_tokens":
    # K} or {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
    # "prompt_lookup_min": M} (docs/speculative_decoding.md); None: off
    tensor_parallel_size: int = 1  # ranks computing one engine, each 1/N of every layer's
    # heads and MLP (one process per rank on the worker's machine; gloo on CPU, NCCL on CUDA);
    # memory_budget_bytes is per rank
    step_timeout_s: float | None = None  # a step (or other work of the engine loop) running
    # longer makes the worker not ready: it refuses new work, its pool replaces it, its
    # requests move (docs/failure-handling.md). None: derived from the measured step time,
    # max(60 s, 10 x the slowest of the last 64 steps); inf: no bound
    enable_lora: bool = False  # serve LoRA adapters of the model (a request's adapter runs
    # in the same steps as the base model's requests and other adapters'; docs/lora.md)
    max_loras: int = 4  # with LoRA: adapters resident in the model at once (slots)
    max_lora_rank: int = 16  # with LoRA: the largest adapter rank served (sizes the slots)
    max_cpu_loras: int | None = None  # with LoRA: adapters kept read in host memory (None:
    # max_loras), so that a slot is refilled without reading files
    kv_offload_cpu_gib: float = 0.0  # host memory for prefix-cache blocks evicted from the
    # pool (docs/kv-tiers.md); 0: no host tier
    kv_offload_disk_gib: float = 0.0  # disk for blocks evicted from the host tier (needs
    # kv_offload_dir); 0: no disk tier
    kv_offload_dir: str | None = None  # the disk tier's folder (made private to the worker)
    kv_offload_int8: bool = False  # the tiers store a float pool's blocks as int8 with the
    # kv_int8_scales scheme (calibrated and checked at start-up; ~3.9x the blocks of float32
    # per GiB, a loaded prefix no longer bit-exact with recomputing it; docs/kv-tiers.md)
    prefix_cache_salt: str | None = field(default=None, repr=False)  # secret mixed into every
    # prefix-cache block hash, one per cluster (the launcher generates it); None: each engine
    # draws its own; never in the repr

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_int8_scales not in KV_INT8_SCALES:
            raise ValueError(f"kv_int8_scales must be one of {KV_INT8_SCALES}, "
                             f"got {self.kv_int8_scales!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, "
                             f"got {self.scheduling_policy!r}")
        if self.speculative_config is not None:  # keys and ranges (the draft is checked at build)

            SpeculativeConfig.from_dict(self.speculative_config)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and self.kv_cache_dtype == "int8":
            raise ValueError("kv_cache_dtype='int8' with tensor_parallel_size > 1 is not "
                             "supported (the int8 calibration runs the model on one rank); "
                             "use kv_cache_dtype='auto'")
        _positive_int("block_size", self.block_size)
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        _positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        _positive_int("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive_int("memory_budget_bytes", self.memory_budget_bytes, allow_none=True)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("prefill_batch_tokens", self.prefill_batch_tokens, allow_none=True)
        check_admission_hold(self.admission_hold_s)
        check_step_timeout(self.step_timeout_s)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        if not 0.0 <= self.memory_safety_margin < 0.5:
            raise ValueError("memory_safety_margin must be in [0, 0.5), "
                             f"got {self.memory_safety_margin!r}")
        for name in ("kv_offload_cpu_gib", "kv_offload_disk_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value <= 1 << 20:
                raise ValueError(f"{name} must be a number of GiB in [0, 1048576], "
                                 f"got {value!r}")
        if self.kv_offload_disk_gib and not self.kv_offload_dir:
            raise ValueError("kv_offload_disk_gib needs kv_offload_dir (the disk tier's folder)")
        if self.kv_offload_int8:
            _check_int8_tiers(self)
        if (self.kv_offload_cpu_gib or self.kv_offload_disk_gib) \
                and not self.enable_prefix_caching:
            raise ValueError("KV tiers (kv_offload_cpu_gib, kv_offload_disk_gib) keep prefix-"
                             "cache blocks: they need enable_prefix_caching")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= "
                             f"max_model_len ({self.max_model_len})")

    def resolve_device(self) -> torch.device:
        import torch  # lazy: a config crosses the router, which does not import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        import torch  # lazy: a config crosses the router, which does not import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type == "cpu":
            return torch.float32
        saved = str(checkpoint_dtype).replace("torch.", "")
        return getattr(torch, saved if saved in DTYPES else "bfloat16")
