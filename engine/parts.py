"""What an engine is built from: the model, its KV pool and block manager, the tokenizer and
the memory ledger (``EngineParts.build``, from a ``ResolvedModel``). ``LLMEngine``
(engine/llm_engine.py) steps over these parts."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch

from pdserve.engine.adapters import AdapterSlots
from pdserve.engine.capacity.memory import (
    MemoryLedger,
    allocate_kv_caches,
    kv_layer_dtypes,
    kv_layers,
    plan_kv_pool,
)
from pdserve.engine.capacity.roofline import StepCost, UtilizationMeter
from pdserve.engine.config import EngineConfig
from pdserve.engine.int8_calibration import calibrate_kv_scales, check_int8_quality
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.kv_cache.events import KVEventLog
from pdserve.engine.kv_cache.int8_scales import INT8_SCHEMES, Calibration, Int8Scheme
from pdserve.engine.kv_cache.offload import PoolTiers
from pdserve.engine.kv_cache.tier_int8 import Int8TierStorage
from pdserve.engine.resolved_model import ResolvedModel
from pdserve.engine.step.cuda_graphs import DecodeGraphs, cuda_capture
from pdserve.engine.step.model_runner import ModelRunner
from pdserve.engine.tensor_parallel.group import Followers, RankRole, TensorParallelRunner
from pdserve.models import ModelConfig, Tokenizer
from pdserve.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """The components an engine or a worker is composed of."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    runner: ModelRunner
    block_manager: BlockManager
    ledger: MemoryLedger
    max_model_len: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    adapters: AdapterSlots | None = None  # LoRA slots and host cache (enable_lora)

    @classmethod
    def build(cls, config: EngineConfig, rank_role: RankRole | None = None) -> EngineParts:
        """The parts of ``config``'s engine; with ``tensor_parallel_size`` N > 1, this process
        is rank 0 and starts ranks 1..N-1 (engine/tensor_parallel/group.py), which load alongside
        and take ``rank_role`` (what a worker's ranks do besides the forward)."""
        resolved = ResolvedModel.of(config)
        size = config.tensor_parallel_size
        shard = None
        if size > 1:
            shard = TensorShard(0, size)
            shard.check(resolved.model_config)
            gpus = torch.cuda.device_count() if resolved.device.type == "cuda" else size
            if gpus < size:
                raise ValueError(f"tensor_parallel_size ({size}) needs a GPU per rank; this "
                                 f"process sees {gpus}")
        followers = Followers.start(config, rank_role) if size > 1 else None
        try:
            return cls._build(config, resolved, shard, followers)
        except BaseException:
            if followers is not None:
                followers.stop()
            raise

    @classmethod
    def _build(cls, config: EngineConfig, resolved: ResolvedModel, shard: TensorShard | None,
               followers: Followers | None) -> EngineParts:
        mc, device, dtype = resolved.model_config, resolved.device, resolved.dtype
        backend, max_model_len = resolved.backend, resolved.max_model_len
        model = resolved.load_model(config, shard)
        local = model.config  # this rank's shapes (mc itself without tensor parallelism)
        # LoRA slots before the pool is sized: the ledger counts them as weights
        adapters = AdapterSlots.for_config(config, model, mc, shard)
        ledger = plan_kv_pool(local, config, model, dtype, device, max_model_len, backend)
        if adapters is not None:
            ledger = dataclasses.replace(
                ledger, lora_bytes=adapters.slot_bytes,
                lora_slots=f"{adapters.max_loras} slots of rank <= {adapters.max_lora_rank}")
        layer_dtypes = kv_layer_dtypes(mc.num_hidden_layers, dtype, config)
        try:
            tokenizer = resolved.checkpoint.tokenizer()
        except (FileNotFoundError, ValueError) as exc:
            logger.info("no tokenizer (%s): token-id prompts only, empty text", exc)
            tokenizer = None
        if config.kv_cache_dtype == "int8":
            config, ledger, caches = _int8_pool(config, resolved, model, ledger, layer_dtypes,
                                                tokenizer)
        else:
            caches = allocate_kv_caches(local, ledger, layer_dtypes, device)
        runner_args = (model, caches, config.block_size, device, backend, max_model_len)
        if followers is None:
            runner = ModelRunner(*runner_args)
        else:
            model.join_tensor_group(followers.join(ledger, device).all_reduce)
            runner = TensorParallelRunner(*runner_args, followers=followers)
            if adapters is not None:
                adapters.on_load = functools.partial(runner.call_ranks,
                                                     AdapterSlots.load_slot.__name__)
        runner.serves_lora = adapters is not None
        runner.meter = UtilizationMeter(
            StepCost.for_model(local, ledger.weight_bytes, ledger.kv_bytes_per_token), device,
            dtype)
        block_manager = BlockManager(ledger.num_kv_blocks, config.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching,
                                     sliding_window=mc.sliding_window,
                                     hash_salt=_salt_bytes(config.prefix_cache_salt))
        if config.enable_prefix_caching:  # what the routers' prefix index is fed from
            block_manager.events = KVEventLog()
        block_manager.offload = _kv_tiers(config, resolved, model, tokenizer, caches,
                                          block_manager.events)
        if block_manager.offload is not None:
            ledger = _with_tiers(ledger, block_manager.offload)
            if followers is not None:
                block_manager.offload.ranks = runner
        logger.info("engine ready: %s", ", ".join(f"{k} {v}" for k, v in ledger.rows()))
        parts = cls(config, mc, tokenizer, runner, block_manager, ledger, max_model_len,
                    tuple(mc.eos_token_ids), adapters)
        if (device.type == "cuda" and backend == "triton" and not config.enforce_eager
                and followers is None):
            parts.capture_decode_graphs()
        return parts

    def close(self) -> None:
        """Release what outlives the Python objects: a tensor parallel engine's followers, the
        KV tiers' writer and disk folder."""
        self.runner.close()
        if self.block_manager.offload is not None:
            self.block_manager.offload.close()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Validate a prompt and return its token ids (ValueError naming ``prompt``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt is text but the checkpoint has no tokenizer.json; "
                                 "pass token ids instead")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids
               if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    def capture_decode_graphs(self, capture=cuda_capture) -> None:
        """Replay pure decode steps from CUDA graphs (engine/step/cuda_graphs.py); one block of the
        pool becomes the padding rows' scratch. ``capture``: how (tests pass eager_capture)."""
        runner = self.runner
        scratch = self.block_manager.withhold_last_block()
        runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, self.config.block_size,
                                     runner.device, runner.backend, self.max_model_len,
                                     self.config.max_num_seqs, scratch, capture=capture)


def _salt_bytes(salt: str | None) -> bytes | None:
    return None if salt is None else salt.encode()


def _int8_pool(config: EngineConfig, resolved: ResolvedModel, model, ledger: MemoryLedger,
               layer_dtypes, tokenizer) -> tuple[EngineConfig, MemoryLedger, list]:
    """(config, ledger, caches) of an int8 pool whose scheme passed its start-up check
    (:func:`_checked_int8`); when none passes, the engine refuses to start with both
    measurements. Never serves garbage."""
    scheme, scales, calibration = _checked_int8(config, resolved, model, layer_dtypes,
                                                tokenizer, "int8 KV cache")
    if not calibration.check.passed:
        raise ValueError(f"kv_cache_dtype='int8' is not usable with this model: "
                         f"{calibration.describe()}. Serve it with kv_cache_dtype='auto'")
    if scheme.name != config.kv_int8_scales:  # (the fallback's pool has other token scales)
        config = dataclasses.replace(config, kv_int8_scales=scheme.name)
        ledger = plan_kv_pool(resolved.model_config, config, model, resolved.dtype,
                              resolved.device, resolved.max_model_len, resolved.backend)
    caches = allocate_kv_caches(resolved.model_config, ledger, layer_dtypes, resolved.device,
                                scales, scheme)
    logger.info("int8 KV cache: %s", calibration.describe())
    return config, dataclasses.replace(ledger, kv_int8=calibration.describe()), caches


def _kv_tiers(config: EngineConfig, resolved: ResolvedModel, model, tokenizer, caches,
              events) -> PoolTiers | None:
    """The KV tiers below rank 0's pool that ``config`` asks for (``kv_offload_*``), or None."""
    int8 = (_int8_tiers(config, resolved, model, tokenizer) if config.kv_offload_int8
            else None)
    return PoolTiers.for_config(config, caches, 0, config.tensor_parallel_size, events, int8)


def _with_tiers(ledger: MemoryLedger, offload: PoolTiers) -> MemoryLedger:
    """``ledger`` with the tiers' budgets and how they store blocks."""
    tiers = offload.tiers
    return dataclasses.replace(
        ledger, kv_host_tier_bytes=tiers.host_capacity,
        kv_disk_tier_bytes=tiers.disk_capacity if tiers.folder is not None else 0,
        kv_tier_int8="" if offload.int8 is None else offload.int8.description)


def _int8_tiers(config: EngineConfig, resolved: ResolvedModel, model,
                tokenizer) -> Int8TierStorage | None:
    """How the KV tiers store a float pool's blocks as int8 (``kv_offload_int8``): the
    scheme that passed its start-up check (:func:`_checked_int8`), or None (the tiers store
    blocks as the pool holds them, with a warning) when none passes."""
    mc = resolved.model_config
    layer_dtypes = [torch.int8] * mc.num_hidden_layers
    scheme, scales, calibration = _checked_int8(config, resolved, model, layer_dtypes,
                                                tokenizer, "int8 KV tiers")
    if not calibration.check.passed:
        logger.warning("int8 KV tiers: no int8 scheme passed its start-up check against the "
                       "model dtype (%s); the tiers store blocks in the model dtype",
                       calibration.describe())
        return None
    logger.info("int8 KV tiers: %s", calibration.describe())
    staging = functools.partial(kv_layers, mc, block_size=config.block_size,
                                layer_dtypes=layer_dtypes, device=resolved.device,
                                scales=scales, scheme=scheme)
    return Int8TierStorage(staging, calibration.describe())


def _checked_int8(config: EngineConfig, resolved: ResolvedModel, model, layer_dtypes,
                  tokenizer, what: str) -> tuple[Int8Scheme, list, Calibration]:
    """(scheme, scales, calibration) of ``config.kv_int8_scales`` for int8 layers of
    ``layer_dtypes``, compared with the model dtype (``int8_calibration.check_int8_quality``;
    ``calibration.check`` says whether it passed). A scheme that fails falls back to ``token``
    (no calibration, so no calibration to go wrong) with a warning."""
    mc, device, backend = resolved.model_config, resolved.device, resolved.backend

    def calibrated(scheme: Int8Scheme) -> tuple[list, Calibration]:
        scales, calibration = calibrate_kv_scales(model, mc, layer_dtypes, device, backend,
                                                  tokenizer, scheme=scheme)
        layout = kv_layers(mc, 1, config.block_size, layer_dtypes, device, scales, scheme)
        check = check_int8_quality(model, mc, layout, config.block_size, device, backend)
        return scales, dataclasses.replace(calibration, check=check)

    scheme = INT8_SCHEMES[config.kv_int8_scales]
    scales, calibration = calibrated(scheme)
    if not calibration.check.passed and scheme.name != "token":
        logger.warning("%s: kv_int8_scales=%r failed its start-up check against the model "
                       "dtype (%s); falling back to 'token'", what, scheme.name,
                       calibration.check.describe())
        scheme = INT8_SCHEMES["token"]
        scales, token = calibrated(scheme)
        calibration = Calibration("token", "none", check=token.check,
                                  fallback_from=config.kv_int8_scales)
    return scheme, scales, calibration
