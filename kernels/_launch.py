"""Shared checks and sizing helpers for the Triton launchers (imports triton: Triton path only)."""

from __future__ import annotations

import functools

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs under ``TRITON_INTERPRET=1`` (CPU tests)."""
    return bool(triton.knobs.runtime.interpret)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be upcast to fp32.

    fp32 always computes in fp32; the interpreter's ``tl.dot`` mishandles bf16 operands, so
    under it half-precision operands are upcast too (products of bf16 are exact in fp32).
    """
    return dtype == torch.float32 or interpreting()


def check_tensor(name: str, t, ndim: int | None = None, dtypes=None, device=None,
                 shape: tuple | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` when ``t`` is not a tensor of the expected kind.

    ``shape`` entries of ``None`` are not checked.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if shape is not None:
        for want, got in zip(shape, t.shape, strict=True):
            if want is not None and want != got:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_cache(name: str, cache, device) -> None:
    """Validate a :class:`KVCacheLayer` for the kernels (contiguous pool, scales on device)."""
    check_tensor(f"{name}.kv", cache.kv, ndim=5, device=device,
                 dtypes=FLOAT_DTYPES + (torch.int8,))
    check_contiguous(f"{name}.kv", cache.kv)
    if cache.is_quantized:
        shape = (cache.kv.shape[3], cache.kv.shape[4])
        for scale_name in ("k_scale", "v_scale"):
            scale = getattr(cache, scale_name)
            check_tensor(f"{name}.{scale_name}", scale, ndim=2, dtypes=(torch.float32,),
                         device=device, shape=shape)
            check_contiguous(f"{name}.{scale_name}", scale)
        for scale_name in ("k_token_scale", "v_token_scale"):
            scale = getattr(cache, scale_name)
            if scale is not None:  # shape and dtype checked by KVCacheLayer
                check_tensor(f"{name}.{scale_name}", scale, device=device)
                check_contiguous(f"{name}.{scale_name}", scale)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed small number off-GPU)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else
                         torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
