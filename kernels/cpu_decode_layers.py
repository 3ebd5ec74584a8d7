"""A decode step's decoder layers in one C call on the CPU (``cpu_decode_layers.c``).

A batch of one new token per sequence through a small model spends as much time between its
kernels as in them: the unfused forward makes a few thousand Python-level dispatches a step
(argument checks, tensor allocations, ctypes calls), microseconds each, while the GEMMs
stream the weights once. :class:`DecodeLayers` hands the whole stack of layers, and the final
norm, to one C call that runs the same kernels in the same order with the same roundings
(``native_panel.h``'s GEMMs, ``native_pointwise.h``'s norms, RoPE and SiLU, and
``native_attention.h``'s paged decode attention). :func:`takes_model` and
:meth:`DecodeLayers.takes` say which models and steps it serves; the rest run unfused, the
unfused forward is its reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import cpu_panel_gemm, native_build
from pdserve.kernels.kv_layout import KVCacheLayer

# Rows (sequences) a call takes, by dtype: as many as its GEMMs run at least as fast as
# oneDNN's for (float32: the panel GEMM's 16; bf16: 32, one pass of AMX tiles over the weight)
MAX_ROWS = {torch.float32: cpu_panel_gemm.MAX_ROWS, torch.bfloat16: 32}
DTYPES = tuple(MAX_ROWS)
# Below this much work (a GEMM's rows x weight elements; attention's context tokens x heads x
# head_dim) a step of the call runs on one thread: far lower than the one-op kernels' bounds,
# since within one call the threads go from step to step without returning to Python, and a
# batch-1 GEMM of SmolLM2's already runs faster on two cores (docs/cpu-speed.md).
PARALLEL_MIN_WORK = 1 << 16


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down",
        "qkv_bias", "o_bias", "gate_up_bias", "down_bias")] + [
        (name, ctypes.c_int64) for name in ("qkv_kp", "o_kp", "gate_up_kp", "down_kp")] + [
        ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p), ("window", ctypes.c_int32)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("block_size", ctypes.c_int),
        ("num_blocks", ctypes.c_int), ("parallel_min_work", ctypes.c_int64)]


_ERRORS = {-1: "a shape it does not take", -2: "out of memory",
           -3: "a slot or block table entry outside the pool"}


@functools.cache
def _library():
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return native_build.bind("cpu_decode_layers", {"decode_layers": (
        i32, [ptr, i32, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i32, i32])})


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine (builds it on first call)."""
    return _library() is not None


def _linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def serves_dtype(dtype: torch.dtype) -> bool:
    """Whether the fused decode runs on this machine for models of ``dtype``: float32 or
    bfloat16, the C kernel built, and the panel GEMM the faster one for the dtype here."""
    return dtype in DTYPES and available() and cpu_panel_gemm.beats_onednn(dtype)


def takes_model(model) -> bool:
    """Whether the fused decode serves ``model`` (a ``LlamaForCausalLM``) at all: on the CPU in
    a dtype it serves here (:func:`serves_dtype`), every linear packed in a layout the panel
    GEMM confirmed, no per-head q/k norm, not a tensor parallel rank."""
    dtype = model.dtype
    if model.device.type != "cpu" or not serves_dtype(dtype):
        return False
    for layer in model.model.layers:
        if layer.all_reduce is not None or layer.self_attn.q_norm is not None:
            return False
        for linear in _linears(layer):
            if linear.packed is None or not cpu_panel_gemm.confirmed(linear.packed):
                return False
    return True


class DecodeLayers:
    """``model``'s layers over ``kv_caches`` as the C call takes them (a table of pointers,
    built once; the tensors it points into are held here)."""

    def __init__(self, model, kv_caches: list[KVCacheLayer]):
        config, dtype = model.config, model.dtype
        self.dtype = dtype
        self.caches = [cache.kv for cache in kv_caches]
        self._held = []  # biases in the model's dtype, contiguous
        self.layers = (_Layer * model.num_layers)()
        for entry, layer, cache in zip(self.layers, model.model.layers, kv_caches, strict=True):
            entry.input_norm = self._hold(layer.input_layernorm.weight)
            entry.post_norm = self._hold(layer.post_attention_layernorm.weight)
            for name, linear in zip(("qkv", "o", "gate_up", "down"), _linears(layer), strict=True):
                setattr(entry, name, torch.ops.mkldnn.data_ptr(linear.packed))
                setattr(entry, f"{name}_kp", cpu_panel_gemm.k_rows(linear.packed))
                bias = linear.bias
                setattr(entry, f"{name}_bias", None if bias is None else self._hold(bias))
            entry.k_pool, entry.v_pool = cache.k.data_ptr(), cache.v.data_ptr()
            entry.window = layer.self_attn.attn.sliding_window or 0
        first = kv_caches[0]
        self.shape = _Shape(
            hidden=config.hidden_size, heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            inter=config.intermediate_size, eps=config.rms_norm_eps,
            scale=config.head_dim ** -0.5, block_size=first.block_size,
            num_blocks=first.num_blocks, parallel_min_work=PARALLEL_MIN_WORK)
        self.final_norm = self._hold(model.model.norm.weight)
        self.embedding = model.model.embed_tokens.weight

    def _hold(self, t: torch.Tensor) -> int:
        t = t.detach().to(self.dtype).contiguous()
        self._held.append(t)
        return t.data_ptr()

    def serves(self, kv_caches: list[KVCacheLayer]) -> bool:
        """Whether this table points into ``kv_caches``' pools."""
        return len(kv_caches) == len(self.caches) and all(
            cache.kv is held for cache, held in zip(kv_caches, self.caches, strict=True))

    @staticmethod
    def takes(kv_caches: list[KVCacheLayer], dtype: torch.dtype) -> bool:
        """Whether the pools are what the call reads and writes: ``dtype``, contiguous."""
        return all(cache.kv.dtype == dtype and cache.kv.is_contiguous() for cache in kv_caches)

    def forward(self, input_ids: torch.Tensor, rope_table: tuple, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """(R,) new tokens, one per sequence -> the final norm's output (R, hidden); their K
        and V are written to ``slot_mapping``. ``rope_table``: ``rope_table_torch`` of their
        positions; block tables and context lengths as paged decode attention takes them."""
        rows = input_ids.shape[0]
        if not 0 < rows <= MAX_ROWS[self.dtype]:
            raise ValueError(f"the fused decode takes 1-{MAX_ROWS[self.dtype]} rows, got {rows}")
        hidden = torch.nn.functional.embedding(input_ids, self.embedding).contiguous()
        cos, sin = (t.reshape(rows, -1).contiguous() for t in rope_table)
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        code = _library().decode_layers(
            self.layers, len(self.layers), ctypes.byref(self.shape), self.final_norm,
            hidden.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            int(self.dtype == torch.bfloat16), torch.get_num_threads())
        if code:
            raise ValueError(f"the fused decode refused the batch: {_ERRORS.get(code, code)}")
        return hidden
