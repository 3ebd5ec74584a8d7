"""pdserve.kernels: Triton kernels beside their torch references, behind one dispatch point.

``BACKENDS`` is read by configs in processes that never run a kernel (the router); the
kernels, and torch with them, load on the first use of any other name below."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdserve.kernels.backends import BACKENDS

if TYPE_CHECKING:
    from pdserve.kernels.dispatch import (
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

_HOMES = {
    **dict.fromkeys(("pack_blocks", "paged_attention", "paged_decode_attention",
                     "prompt_attention", "resolve_backend", "rms_norm", "rotary", "silu_and_mul",
                     "unpack_blocks", "write_kv"), "dispatch"),
    "KVCacheLayer": "kv_layout",
}

__all__ = [
    "BACKENDS", "KVCacheLayer", "pack_blocks", "paged_attention", "paged_decode_attention",
    "prompt_attention", "resolve_backend", "rms_norm", "rotary", "silu_and_mul",
    "unpack_blocks", "write_kv",
]


def __getattr__(name: str):
    """A name above from its module, or a submodule (``kernels.<module>``) as attribute access
    found it when this package imported them all."""
    # lazy: the kernels import torch; a config naming a backend (the router's) does not need it
    home = _HOMES.get(name)
    if home is not None:
        return getattr(importlib.import_module(f"pdserve.kernels.{home}"), name)
    try:
        return importlib.import_module(f"pdserve.kernels.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"pdserve.kernels.{name}":
            raise
    raise AttributeError(f"module 'pdserve.kernels' has no attribute {name!r}")
