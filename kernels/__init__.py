"""pdserve.kernels: Triton kernels beside their torch references, behind one dispatch point."""

from pdserve.kernels.dispatch import (
    BACKENDS,
    pack_blocks,
    paged_attention,
    paged_decode_attention,
    prompt_attention,
    resolve_backend,
    rms_norm,
    rotary,
    silu_and_mul,
    unpack_blocks,
    write_kv,
)
from pdserve.kernels.kv_layout import KVCacheLayer

__all__ = [
    "BACKENDS", "KVCacheLayer", "pack_blocks", "paged_attention", "paged_decode_attention",
    "prompt_attention", "resolve_backend", "rms_norm", "rotary", "silu_and_mul",
    "unpack_blocks", "write_kv",
]
