"""What the CLI checks before it starts anything: will each worker's engine fit its budget?

A worker sizes its KV pool in ``engine.memory.plan_kv_pool`` from the budget, the weights and an
analytic activation estimate. All three are known without loading a weight: the model config
comes from ``config.json`` (or a GGUF's metadata), the weight bytes from the model built on the
``meta`` device (tied to the embedding where the safetensors headers or the GGUF tensor table
have no ``lm_head.weight``, as the loader does; GGUF weights count dequantized, as loaded),
the activations from the same estimate. :func:`check_engine_fits` runs that plan and raises the
worker's own :class:`MemoryBudgetError` (or the ValueError a worker would raise for a bad
``--max-model-len`` or ``--model``), so the user gets one message instead of a failed actor.

It checks only what this process can know: on a joined Ray cluster (``--ray-address``) the
workers' devices may differ from this one, and on CUDA without ``--memory-budget-mib`` the
budget is the worker's free device memory; there the worker's error (unwrapped by
:func:`user_error`) is what the user sees.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from pdserve.cluster.options import ClusterOptions
from pdserve.engine import memory
from pdserve.engine.config import DEFAULT_CPU_MEMORY_BUDGET, EngineConfig
from pdserve.engine.memory import MemoryBudgetError
from pdserve.engine.parts import ResolvedModel
from pdserve.models import ModelConfig, build_model
from pdserve.models.loader import weight_tensor_names

logger = logging.getLogger(__name__)


def meta_weight_bytes(model_dir: Path, mc: ModelConfig, dtype: torch.dtype) -> int:
    """What ``engine.memory.weight_bytes`` will count for the loaded model, read from the
    safetensors headers and a ``meta``-device model (no weight is read)."""
    names = weight_tensor_names(model_dir)  # safetensors headers or a GGUF's tensor table
    model = build_model(mc, dtype=dtype, device="meta")
    if "lm_head.weight" not in names:
        model.tie_weights()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_engine_fits(config: EngineConfig) -> int | None:
    """Plan ``config``'s KV pool as a worker on this machine would; returns the number of
    blocks (None when the budget is this process's to guess: CUDA with no explicit budget, or
    a pinned ``num_kv_blocks``). Raises what the worker would: :class:`MemoryBudgetError`,
    ``ValueError`` for a context longer than the model's, ``FileNotFoundError`` for a folder
    with no checkpoint."""
    model_dir = Path(config.model)
    resolved = ResolvedModel.of(config)
    mc, device, dtype = resolved.model_config, resolved.device, resolved.dtype
    backend, max_model_len = resolved.backend, resolved.max_model_len
    budget = config.memory_budget_bytes
    if budget is None and device.type == "cpu":
        budget = DEFAULT_CPU_MEMORY_BUDGET
    if budget is None or config.num_kv_blocks is not None:
        weight_tensor_names(model_dir)  # a folder without weights still fails here
        return None
    weights = meta_weight_bytes(model_dir, mc, dtype)
    activations = memory.estimate_activation_bytes(mc, config, dtype, max_model_len,
                                                   attention_scratch=backend == "torch")
    layer_dtypes = memory.kv_layer_dtypes(mc.num_hidden_layers, dtype, config)
    per_block = memory.kv_bytes_per_block(mc, config, layer_dtypes)
    return memory.blocks_in_budget(config, budget, weights, activations, per_block, max_model_len)


def check_cluster(options: ClusterOptions, model_dir: str) -> None:
    """:func:`check_engine_fits` for the workers ``options`` describes, and that a local Ray
    can hold the pools at their largest (``ClusterOptions.local_ray_cpus``), unless they run
    on a joined Ray cluster (their devices are not this machine's)."""
    if options.ray_address:
        logger.info("--ray-address: the memory budget is checked by the workers themselves")
        return
    from pdserve.cluster.settings import SettingsError, name_flags

    config = EngineConfig(model=model_dir, **options.engine)
    try:
        options.local_ray_cpus()
        if config.device != "cpu" and torch.cuda.is_available():  # CUDA workers, one GPU each
            options.check_local_gpus(torch.cuda.device_count())
    except ValueError as exc:
        raise SettingsError(name_flags("cluster", str(exc))) from None
    check_engine_fits(config)


_WORKER_ERROR = re.compile(r"MemoryBudgetError: (.*)")


def user_error(exc: BaseException | None) -> MemoryBudgetError | None:
    """The :class:`MemoryBudgetError` behind a failed worker start, or None.

    A ``RayTaskError`` carries it as ``.cause``; an actor whose constructor raised it fails its
    calls with an ``ActorDiedError`` that keeps only the creation task's text, whose last line
    is ``...MemoryBudgetError: <message>``."""
    from ray.exceptions import RayError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(exc, RayError) and isinstance(cause, BaseException):
            exc = cause
            continue
        if isinstance(exc, MemoryBudgetError):
            return exc
        found = _WORKER_ERROR.findall(str(exc)) if isinstance(exc, RayError) else []
        if found:
            return MemoryBudgetError(found[-1].strip())
        exc = exc.__cause__
    return None
