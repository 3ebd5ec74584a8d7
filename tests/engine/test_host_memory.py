"""The CPU engine keeps large freed buffers in the heap (glibc's mmap threshold raised once per
process), unless turned off: a 64 MB allocation is then no separate mapping."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes
from pdserve.engine.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_host_memory()
keep_freed_host_memory()
before = libc.mallinfo2().hblks  # mappings made so far (torch's own, at import)
buffer = libc.malloc(64 << 20)
print(applied, keep_freed_host_memory.cache_info().misses, libc.mallinfo2().hblks - before)
libc.free(ctypes.c_void_p(buffer))
"""


def run(env: dict) -> str:
    return subprocess.run([sys.executable, "-P", "-c", SCRIPT], env={**os.environ, **env},
                          capture_output=True, text=True, check=True).stdout.strip()


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def test_large_buffers_stay_in_the_heap():
    assert run({}) == "True 1 0"  # applied once; the 64 MB buffer is not its own mapping


def test_turned_off_by_env():
    assert run({"PDSERVE_KEEP_HOST_MEMORY": "0"}) == "False 1 1"  # glibc maps it apart
