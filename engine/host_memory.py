"""Keep freed host memory in the process, so the CPU forward's large buffers cost no page faults.

The CPU decode path gathers every sequence's context per layer into fresh buffers (tens of MB at
batch 64 on a ~100M model). glibc serves a request above its mmap threshold with a new mapping
and unmaps it on free; the threshold adapts upward only to 32 MiB, so such buffers are mapped,
faulted in page by page and unmapped again in every layer of every step. Raising the threshold
and the trim threshold keeps them in the heap for reuse (the figures: docs/cpu-speed.md). The
cost is that the process keeps its peak heap instead of returning it to the system.

Linux with glibc only; elsewhere (or with another allocator preloaded) this does nothing.
``PDSERVE_KEEP_HOST_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB, once per process; True if applied."""
    if os.environ.get("PDSERVE_KEEP_HOST_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    logger.debug("glibc mmap/trim thresholds raised to %d bytes: %s", THRESHOLD_BYTES, applied)
    return applied
