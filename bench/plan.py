"""``pdserve plan``: the capacity arithmetic of ``engine/capacity/roofline.py`` as a tool, from
``config.json`` alone.

For a model on an accelerator (by name from ``accelerators.json``, by its three figures, or
this machine measured now):

1. KV bytes per token = 2 x layers x kv_heads x head_dim x bytes, each layer as the engine
   stores it (int8 layers 1 byte plus their token scales; kept edge layers in the model dtype):
   the engine's own ``kv_bytes_per_block`` / block size.
2. Weights from the config's parameter count (the safetensors headers when the folder has
   them, exactly as the engine counts its loaded weights); KV pool = memory - margin - weights
   - activation reserve (the engine's own activation estimate when no reserve is given), cut
   into whole blocks as the engine cuts it. ``memory_safety_margin`` is 0 by default here (the
   seed's arithmetic); the engine keeps 5 % of its budget, so pass it to plan its exact pool.
3. ``max_batch_theoretical`` = floor(pool / (avg_context x KV bytes per token)); ``max_batch``
   = floor(80 % of it): the seed's 20 % margin for length variance and fragmentation.
4. Roofline times: a decode step of ``max_batch`` sequences at ``avg_context`` is
   max(bytes / bandwidth, FLOPs / (peak x MFU)) with bytes = weights + batch x context x KV
   bytes per token; a 1000-token prefill the same with its FLOPs
   (:class:`pdserve.engine.capacity.roofline.StepCost`); the larger term names the binding resource.
5. With ``rate`` / ``isl`` / ``osl``: prefill workers = ceil(rate x prefill time(isl) / 0.8),
   each planned 80 % busy (queues grow without bound near 100 %); decode workers by Little's
   law: rate x osl x step time requests decode at once, each worker holds ``max_batch`` of
   them (the 20 % margin is in ``max_batch`` already).

With ``tensor_parallel_size`` N, a worker is N devices and every figure of steps 1-4 is one
rank's: its share of the heads and the MLP (embedding and head whole), its K/V heads of every
block (``models/tensor_parallel.py``), its step's bytes and FLOPs. The collectives between the
ranks are not in the step times (they depend on the interconnect).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.engine.capacity import memory
from pdserve.engine.capacity.budget_check import meta_weight_bytes
from pdserve.engine.capacity.roofline import StepCost, copy_bandwidth, matmul_rate
from pdserve.engine.config import DEFAULT_CPU_MEMORY_BUDGET, EngineConfig
from pdserve.models import ModelConfig
from pdserve.models.checkpoint import open_checkpoint
from pdserve.models.tensor_parallel import TensorShard
from pdserve.worker_api.stats import BANDWIDTH, COMPUTE

GiB = 1 << 30
BATCH_MARGIN = 0.8  # max_batch = 80 % of the theoretical batch; workers planned 80 % busy
PREFILL_TOKENS = 1000  # prefill_ms_per_1k_tokens: one prompt this long
DEFAULT_MFU = 0.5  # the share of dense peak FLOPs a prefill is assumed to reach
ACCELERATORS = Path(__file__).with_name("accelerators.json")


@dataclass(frozen=True)
class Hardware:
    """What one worker's device offers."""

    name: str
    memory_bytes: int  # the budget weights + activations + KV share
    bandwidth_bytes_per_s: float | None  # memory bandwidth (None: unknown, no time estimates)
    peak_flops_per_s: float | None  # dense matmul peak in the serving dtype (None: unknown)
    source: str  # where the figures come from
    device: str = "cuda"  # "cpu" | "cuda": decides the engine's dtype and attention path


def accelerators() -> dict[str, Hardware]:
    """The named accelerators of ``accelerators.json``."""
    raw = json.loads(ACCELERATORS.read_text())
    return {name: Hardware(name, int(v["memory_gib"] * GiB), v["bandwidth_gbps"] * 1e9,
                           v["bf16_tflops"] * 1e12, v["source"])
            for name, v in raw.items() if not name.startswith("_")}


def find_accelerator(name: str) -> Hardware:
    known = accelerators()
    for key, hw in known.items():
        if key.lower() == name.lower():
            return hw
    raise ValueError(f"device must be one of {', '.join(known)}, cpu or cuda (this machine, "
                     f"measured); got {name!r}")


def measured_hardware(device: str, dtype: torch.dtype, memory_bytes: int | None = None
                      ) -> Hardware:
    """This machine's ``device`` ("cpu" | "cuda"): matmul rate and copy bandwidth measured now
    (:func:`pdserve.engine.capacity.roofline.measure_peaks`); memory as the engine's default
    budget."""


    with tqdm(total=2, desc=f"measuring this {device}'s {dtype} matmul and copy",
              unit="test", leave=False) as bar, torch.inference_mode():
        flops = matmul_rate(device, dtype, 8192 if device == "cuda" else 2048, 5)
        bar.update()
        bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else None, 5)
        bar.update()
    if memory_bytes is None:
        memory_bytes = (memory.default_budget(torch.device(device)) if device == "cuda"
                        else DEFAULT_CPU_MEMORY_BUDGET)
    name = torch.cuda.get_device_name() if device == "cuda" else "this CPU"
    threads = "" if device == "cuda" else f", {torch.get_num_threads()} threads"
    return Hardware(f"{name} (measured)", memory_bytes, bandwidth, flops,
                    f"measured now: {dtype} matmul, device copy{threads}", device)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for (the ``pdserve plan`` flags)."""

    model: str  # checkpoint folder (config.json is enough)
    dtype: str = "auto"  # as EngineConfig.dtype
    kv_cache_dtype: str = "auto"
    kv_int8_keep_edge_layers: bool | None = None  # None: the engine's default
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max positions
    avg_context: int | None = None  # None: isl + osl / 2 with a rate, else min(4096, max len)
    activation_reserve_bytes: int | None = None  # None: the engine's estimate
    memory_safety_margin: float = 0.0
    mfu: float = DEFAULT_MFU
    max_num_batched_tokens: int = 2048  # the engine settings the activation estimate uses
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1  # devices per worker, each holding 1/N of every layer
    rate: float | None = None  # requests/s to serve
    isl: int | None = None  # input tokens per request
    osl: int | None = None  # output tokens per request

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        given = [x is not None for x in (self.rate, self.isl, self.osl)]
        if any(given) and not all(given):
            raise ValueError("rate, isl and osl go together")
        if self.rate is not None and not (self.rate > 0 and self.isl > 0 and self.osl > 0):
            raise ValueError("rate, isl and osl must be > 0")
        if self.avg_context is not None and self.avg_context < 1:
            raise ValueError(f"avg_context must be >= 1, got {self.avg_context}")
        if isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")

    def engine_config(self, device: str) -> EngineConfig:
        edges = {} if self.kv_int8_keep_edge_layers is None else {
            "kv_int8_keep_edge_layers": self.kv_int8_keep_edge_layers}
        return EngineConfig(model=self.model, dtype=self.dtype, device=device,
                            kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size,
                            **edges,
                            max_model_len=self.max_model_len,
                            memory_safety_margin=self.memory_safety_margin,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs,
                            tensor_parallel_size=self.tensor_parallel_size)

    def rank_config(self, mc: ModelConfig) -> ModelConfig:
        """The config one rank computes (``mc`` itself without tensor parallelism); raises
        ValueError naming the setting when the model does not split."""
        return TensorShard.rank_config(mc, self.tensor_parallel_size)


def model_weight_bytes(model_dir: str, mc: ModelConfig, dtype: torch.dtype) -> tuple[int, str]:
    """(bytes, how counted): the engine's count when the folder has weights, else the
    config's parameter count x dtype size."""
    try:
        return meta_weight_bytes(open_checkpoint(model_dir), mc, dtype), "checkpoint tensors"
    except (FileNotFoundError, ValueError):
        return mc.weight_bytes(dtype), "config parameter count"


def roofline_ms(flops: int, nbytes: int, hw: Hardware, mfu: float) -> dict:
    compute = flops / (hw.peak_flops_per_s * mfu) * 1e3
    memory_ms = nbytes / hw.bandwidth_bytes_per_s * 1e3
    return {"ms": max(compute, memory_ms), "compute_ms": compute, "memory_ms": memory_ms,
            "flops": flops, "bytes": nbytes, "binding": COMPUTE if compute >= memory_ms
            else BANDWIDTH}


def make_plan(req: PlanRequest, hw: Hardware, mc: ModelConfig | None = None) -> dict:
    """The plan (the ``--json`` document); see the module docstring."""
    full = mc or open_checkpoint(req.model).model_config
    mc = req.rank_config(full)  # what one rank holds and computes
    config = req.engine_config(hw.device)
    dtype = config.resolve_dtype(mc.torch_dtype, torch.device(hw.device))
    max_model_len = config.max_model_len or mc.max_position_embeddings
    layer_dtypes = memory.kv_layer_dtypes(mc.num_hidden_layers, dtype, config)
    per_block = memory.kv_bytes_per_block(mc, config, layer_dtypes)
    kv_per_token = per_block // config.block_size
    weights, weights_from = model_weight_bytes(req.model, mc, dtype)
    reserve = req.activation_reserve_bytes
    if reserve is None:
        reserve = memory.estimate_activation_bytes(mc, config, dtype, max_model_len,
                                                   attention_scratch=hw.device == "cpu")
    margin = int(hw.memory_bytes * config.memory_safety_margin)
    num_blocks = max(0, (hw.memory_bytes - margin - weights - reserve) // per_block)
    pool = num_blocks * per_block
    context = req.avg_context or (req.isl + req.osl // 2 if req.rate is not None
                                  else min(4096, max_model_len))
    theoretical = pool // (context * kv_per_token)
    batch = math.floor(BATCH_MARGIN * theoretical)
    cost = StepCost.for_model(mc, weights, kv_per_token)
    timed = hw.bandwidth_bytes_per_s is not None and hw.peak_flops_per_s is not None
    if req.rate is not None and not timed:
        raise ValueError("argument --rate: the worker counts need the device's speed: name it "
                         "with --device NAME, or give --hbm-gbps and --tflops")
    decode = roofline_ms(*cost.decode(max(batch, 1), context), hw, req.mfu) if timed else None
    prefill = roofline_ms(*cost.prefill(PREFILL_TOKENS), hw, req.mfu) if timed else None
    plan = {
        "model": req.model, "model_type": mc.model_type, "hardware": asdict(hw),
        "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": req.kv_cache_dtype,
        "block_size": config.block_size, "max_model_len": max_model_len,
        "avg_context": context, "mfu": req.mfu, "num_parameters": full.num_parameters(),
        "tensor_parallel_size": req.tensor_parallel_size,
        "kv_bytes_per_token": kv_per_token, "weight_bytes": weights,
        "weights_counted_from": weights_from, "activation_reserve_bytes": reserve,
        "activation_reserve_from": ("given" if req.activation_reserve_bytes is not None
                                    else "engine estimate"),
        "margin_bytes": margin, "kv_pool_bytes": pool, "bytes_per_block": per_block,
        "num_kv_blocks": num_blocks, "kv_token_capacity": num_blocks * config.block_size,
        "max_batch_theoretical": theoretical, "max_batch": batch,
    }
    if decode is None or prefill is None:  # memory only: the times need the device's speed
        plan.update(decode_step_ms=None, decode=None, decode_tokens_per_s=None,
                    prefill_ms_per_1k_tokens=None, prefill=None, binding=None)
        return plan
    plan.update({
        "decode_step_ms": decode["ms"], "decode": {**decode, "batch": max(batch, 1)},
        "decode_tokens_per_s": max(batch, 1) / decode["ms"] * 1e3,
        "prefill_ms_per_1k_tokens": prefill["ms"],
        "prefill": {**prefill, "tokens": PREFILL_TOKENS},
        "binding": {"prefill": prefill["binding"], "decode": decode["binding"]},
    })
    if req.rate is not None:
        plan.update(worker_counts(req, cost, hw, batch, context))
    return plan


def worker_counts(req: PlanRequest, cost: StepCost, hw: Hardware, batch: int,
                  context: int) -> dict:
    """Prefill and decode workers for ``req.rate`` (module docstring, step 5)."""
    prefill_s = roofline_ms(*cost.prefill(req.isl), hw, req.mfu)["ms"] / 1e3
    step_s = roofline_ms(*cost.decode(max(batch, 1), context), hw, req.mfu)["ms"] / 1e3
    num_prefill = max(1, math.ceil(req.rate * prefill_s / BATCH_MARGIN - 1e-9))
    decoding = req.rate * req.osl * step_s  # requests decoding at once (Little's law)
    num_decode = max(1, math.ceil(decoding / batch - 1e-9)) if batch >= 1 else None
    return {"rate": req.rate, "isl": req.isl, "osl": req.osl,
            "prefill_s_per_request": prefill_s, "requests_decoding": decoding,
            "num_prefill_workers": num_prefill, "num_decode_workers": num_decode,
            "num_devices": None if num_decode is None
            else (num_prefill + num_decode) * req.tensor_parallel_size,
            "pd_ratio": None if num_decode is None else f"{num_prefill}:{num_decode}"}
