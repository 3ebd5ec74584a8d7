"""Where a worker's memory goes: weights, KV pool, activations, margin.

The KV pool is what is left of the budget::

    kv_pool_bytes = budget * (1 - margin) - weight_bytes - activation_peak_bytes
    num_kv_blocks = kv_pool_bytes // bytes_per_block

``activation_peak_bytes`` is an analytic estimate of the largest step (documented in
:func:`estimate_activation_bytes`), not a measurement: CPU allocations are not tracked by torch.
The budget defaults to the free device memory on CUDA and to ``DEFAULT_CPU_MEMORY_BUDGET`` on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.config import DEFAULT_CPU_MEMORY_BUDGET, EngineConfig
from pdserve.engine.kv_cache.int8_scales import INT8_SCHEMES, token_scale_bytes_per_block
from pdserve.kernels import KVCacheLayer
from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE
from pdserve.models.checkpoint import open_checkpoint

logger = logging.getLogger(__name__)
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class MemoryLedger:
    """One worker's memory accounts, in bytes unless named otherwise."""

    budget_bytes: int  # what the worker may use in all
    margin_bytes: int  # kept free for fragmentation and allocator slack
    weight_bytes: int  # model parameters
    activation_bytes: int  # estimated peak of one step's temporaries
    kv_pool_bytes: int  # the paged KV pool actually allocated
    num_kv_blocks: int  # blocks in the pool
    block_size: int  # tokens per block
    kv_bytes_per_token: int  # all layers, K and V, as stored (int8 layers count 1 byte)
    kv_dtype: str  # storage dtype of the pool ("int8" when quantized)
    num_kv_blocks_model_dtype: int  # blocks the same pool bytes would hold in the model dtype
    weights_source: str = ""  # how the weights were stored when not as loaded (a GGUF's types)
    device: str = ""  # where the worker computes: "cpu", or "cuda:0 (its name)"
    num_threads: int = 0  # torch intra-op threads of the process
    draft_bytes: int = 0  # speculative decoding: the draft model's weights + its KV pool (as
    # many blocks as the target's), inside the budget
    kv_int8: str = ""  # int8 pools: the scheme, what its scales were calibrated on and how it
    # compared with the model dtype at start-up (int8_scales.Calibration.describe)
    tensor_parallel_size: int = 1  # ranks computing the engine; every figure here is one
    # rank's (each holds its share of the heads and the MLP, and as many KV blocks)
    lora_bytes: int = 0  # LoRA: the adapter slots in the model (inside weight_bytes)
    lora_slots: str = ""  # LoRA: "N slots of rank <= R"
    kv_host_tier_bytes: int = 0  # KV tiers: host memory for blocks evicted from the pool
    # (outside the budget: the tier's own, --kv-offload-cpu-gib)
    kv_disk_tier_bytes: int = 0  # KV tiers: disk for blocks evicted from the host tier
    kv_tier_int8: str = ""  # KV tiers storing a float pool's blocks as int8: the scheme and
    # its start-up check (int8_scales.Calibration.describe)

    @property
    def kv_token_capacity(self) -> int:
        return self.num_kv_blocks * self.block_size

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for printing."""
        mib = lambda b: f"{b / (1 << 20):,.1f} MiB"  # noqa: E731
        ranks = (f", tensor parallel over {self.tensor_parallel_size} ranks (figures per rank)"
                 if self.tensor_parallel_size > 1 else "")
        return [
            ("device", f"{self.device}, {self.num_threads} torch thread(s){ranks}"),
            ("budget", mib(self.budget_bytes)),
            ("weights", mib(self.weight_bytes) + (f" ({self.weights_source})"
                                                  if self.weights_source else "")),
            ("activations (est. peak)", mib(self.activation_bytes)),
            ("safety margin", mib(self.margin_bytes)),
            ("KV pool", f"{mib(self.kv_pool_bytes)} = {self.num_kv_blocks} blocks x "
                        f"{self.block_size} tokens ({self.kv_dtype})"),
            ("KV bytes per token", f"{self.kv_bytes_per_token:,} B"),
            ("KV capacity", f"{self.kv_token_capacity:,} tokens"),
        ] + ([("int8 KV gain", f"{self.num_kv_blocks / self.num_kv_blocks_model_dtype:.2f}x "
                                f"blocks ({self.num_kv_blocks_model_dtype} in model dtype)")]
             if self.kv_dtype.startswith("int8") and self.num_kv_blocks_model_dtype else []) \
            + ([("int8 KV", self.kv_int8)] if self.kv_int8 else []) \
            + ([("draft model (weights + KV)", mib(self.draft_bytes))] if self.draft_bytes else [])\
            + ([("LoRA slots (in weights)", f"{mib(self.lora_bytes)}, {self.lora_slots}")]
               if self.lora_bytes else []) \
            + ([("KV host tier (outside the budget)", mib(self.kv_host_tier_bytes))]
               if self.kv_host_tier_bytes else []) \
            + ([("KV disk tier", mib(self.kv_disk_tier_bytes))]
               if self.kv_disk_tier_bytes else []) \
            + ([("KV tiers store int8", self.kv_tier_int8)] if self.kv_tier_int8 else [])

    def to_dict(self) -> dict:
        return {**self.__dict__, "kv_token_capacity": self.kv_token_capacity}


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, each tensor once (tied ones share storage); a packed GEMM
    weight (an opaque oneDNN tensor, no storage torch can see) counts its elements."""
    seen, total = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        key = id(p) if p.is_mkldnn else p.data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def estimate_activation_bytes(mc, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                              attention_scratch: bool) -> int:
    """Peak temporaries of one step of ``max_num_batched_tokens`` tokens.

    Per token: residual, hidden and normed states (3 x hidden), q/k/v and attention output,
    gate/up and the activated product (3 x intermediate), in the model dtype; logits for up to
    ``max_num_seqs`` sampled rows in fp32, seven copies in the sampler's top-p path. With the
    torch attention path (CPU), the fp32 score and probability matrices of a full-budget chunk
    against the longest context: 2 x heads x tokens x context x 4 bytes.
    """
    tokens = config.max_num_batched_tokens
    elt = torch.finfo(dtype).bits // 8
    heads, kv_heads, hd = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per_token = 3 * mc.hidden_size + (2 * heads + 2 * kv_heads) * hd + 3 * mc.intermediate_size
    total = tokens * per_token * elt + min(config.max_num_seqs, tokens) * mc.vocab_size * 4 * 7
    if attention_scratch:
        total += 2 * heads * tokens * min(max_model_len, tokens + max_model_len) * 4
    return total


def default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    return DEFAULT_CPU_MEMORY_BUDGET


def kv_layer_dtypes(num_layers: int, model_dtype: torch.dtype, config: EngineConfig):
    """Storage dtype per layer: int8 everywhere with int8, except the edges when kept."""
    if config.kv_cache_dtype != "int8":
        return [model_dtype] * num_layers
    keep = {0, num_layers - 1} if config.kv_int8_keep_edge_layers else set()
    return [model_dtype if i in keep else torch.int8 for i in range(num_layers)]


def bytes_per_block(mc, block_size: int, layer_dtypes) -> int:
    per_layer_elems = 2 * block_size * mc.num_key_value_heads * mc.head_dim
    return sum(per_layer_elems * (torch.finfo(d).bits if d.is_floating_point else 8) // 8
               for d in layer_dtypes)


def kv_bytes_per_block(mc, config: EngineConfig, layer_dtypes) -> int:
    """One block over all layers as the pool stores it: K/V, plus the int8 layers' dynamic
    token scales under ``config.kv_int8_scales``."""

    scales = token_scale_bytes_per_block(mc, config.block_size,
                                         INT8_SCHEMES[config.kv_int8_scales])
    num_int8 = sum(d == torch.int8 for d in layer_dtypes)
    return bytes_per_block(mc, config.block_size, layer_dtypes) + num_int8 * scales


class MemoryBudgetError(ValueError):
    """The memory budget leaves no room for the KV cache: a user error whose message names the
    settings that fix it as ``pdserve serve`` flags (``LLM`` / ``EngineConfig`` take the same
    names in snake case, ``memory_budget_bytes`` for ``--memory-budget-mib``).

    Pickles by its message, so it crosses the Ray boundary as itself (``RayTaskError.cause``)."""


def blocks_in_budget(config: EngineConfig, budget: int, weights: int, activations: int,
                     per_block: int, max_model_len: int) -> int:
    """KV blocks the budget holds after margin, weights and activations; at least one, else
    :class:`MemoryBudgetError` with the numbers and the flags that change them."""
    margin = int(budget * config.memory_safety_margin)
    num_blocks = (budget - margin - weights - activations) // per_block
    if num_blocks >= 1:
        return num_blocks
    mib = lambda b: f"{b / MiB:,.1f} MiB" if b >= MiB // 10 else f"{b / 1024:,.1f} KiB"  # noqa: E731
    needed = weights + activations + per_block
    at_least = -(-needed // int(MiB * (1 - config.memory_safety_margin)))  # ceil, in MiB
    raise MemoryBudgetError(
        f"the memory budget ({mib(budget)}) is too small for this model: weights "
        f"{mib(weights)} + activations {mib(activations)} + one KV block {mib(per_block)} "
        f"need {mib(needed)}, and the budget leaves {mib(max(0, budget - margin))} after its "
        f"{config.memory_safety_margin:.0%} safety margin. Raise --memory-budget-mib to at "
        f"least {at_least}, or shrink the activations with a smaller --max-num-batched-tokens "
        f"(now {config.max_num_batched_tokens}), --max-num-seqs (now {config.max_num_seqs}) "
        f"or --max-model-len (now {max_model_len}); --kv-cache-dtype int8 makes each KV block "
        "smaller, and --num-kv-blocks N pins the pool size instead of deriving it from the "
        "budget.")


def draft_footprint(config: EngineConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes, KV bytes per block) of the speculative draft model; (0, 0) without one.
    Weights are counted from the draft's config (it is loaded after the pool is sized)."""
    spec = config.speculative_config
    if not spec or spec.get("method", "draft_model" if "model" in spec else None) != "draft_model":
        return 0, 0

    mc = open_checkpoint(spec["model"]).model_config
    elt = torch.finfo(dtype).bits // 8
    return (mc.num_parameters() * elt,
            bytes_per_block(mc, config.block_size, [dtype] * mc.num_hidden_layers))


def plan_kv_pool(mc, config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, backend: str) -> MemoryLedger:
    """Size the KV pool from the budget (or ``config.num_kv_blocks``) and return the ledger."""
    layer_dtypes = kv_layer_dtypes(mc.num_hidden_layers, dtype, config)
    per_block = kv_bytes_per_block(mc, config, layer_dtypes)
    budget = config.memory_budget_bytes or default_budget(device)
    margin = int(budget * config.memory_safety_margin)
    weights = weight_bytes(model)
    activations = estimate_activation_bytes(mc, config, dtype, max_model_len,
                                            attention_scratch=backend != "triton")
    draft_weights, draft_per_block = draft_footprint(config, dtype)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = blocks_in_budget(config, budget, weights + draft_weights, activations,
                                      per_block + draft_per_block, max_model_len)
    kv_dtype = (f"int8, {config.kv_int8_scales} scales" if config.kv_cache_dtype == "int8"
                else str(dtype).replace("torch.", ""))
    model_dtype_block = bytes_per_block(mc, config.block_size, [dtype] * mc.num_hidden_layers)
    return MemoryLedger(
        budget_bytes=budget, margin_bytes=margin, weight_bytes=weights,
        activation_bytes=activations, kv_pool_bytes=num_blocks * per_block,
        num_kv_blocks=num_blocks, block_size=config.block_size,
        kv_bytes_per_token=per_block // config.block_size, kv_dtype=kv_dtype,
        num_kv_blocks_model_dtype=num_blocks * per_block // model_dtype_block,
        weights_source=getattr(model, "weights_source", ""), device=device_label(device),
        num_threads=torch.get_num_threads(), tensor_parallel_size=config.tensor_parallel_size,
        draft_bytes=draft_weights + num_blocks * draft_per_block)


def device_label(device: torch.device) -> str:
    """"cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)": the device a worker really computes on."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def allocate_kv_caches(mc, ledger: MemoryLedger, layer_dtypes, device: torch.device,
                       scales: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                       scheme=None) -> list[KVCacheLayer]:
    """The ledger's pool: :func:`kv_layers` of ``ledger.num_kv_blocks`` blocks."""
    return kv_layers(mc, ledger.num_kv_blocks, ledger.block_size, layer_dtypes, device, scales,
                     scheme)


def kv_layers(mc, num_blocks: int, block_size: int, layer_dtypes, device: torch.device,
              scales: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
              scheme=None) -> list[KVCacheLayer]:
    """Zero-filled pools of ``num_blocks``, one :class:`KVCacheLayer` per layer (int8 layers
    need ``scales``; ``scheme``, an :class:`~pdserve.engine.kv_cache.int8_scales.Int8Scheme`,
    adds their token scales)."""
    shape = (2, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim)
    caches = []
    for layer, dtype in enumerate(layer_dtypes):
        kv = torch.zeros(shape, dtype=dtype, device=device)
        if dtype == torch.int8:
            if scales is None or scales[layer] is None:
                raise ValueError(f"int8 KV layer {layer} needs calibrated scales")
            k_scale, v_scale = scales[layer]
            token = [torch.ones(shape[1:4], dtype=TOKEN_SCALE_DTYPE, device=device)
                     if scheme is not None and dynamic else None
                     for dynamic in ((scheme.k_token, scheme.v_token) if scheme else (0, 0))]
            caches.append(KVCacheLayer(kv, k_scale.to(device), v_scale.to(device), *token))
        else:
            caches.append(KVCacheLayer(kv))
    return caches
