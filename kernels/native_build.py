"""Build pdserve's C kernels for this machine on first use and load them with ctypes.

A kernel's source (``kernels/<name>.c``, shipped with the package) is compiled by the system's C
compiler (``$CC``, else ``cc``) with ``-O3 -march=native`` into a shared library under
``$PDSERVE_CACHE_DIR/native`` (default ``~/.cache/pdserve/native``), named by a hash of the
source and the headers beside it (``native_vec.h``), the flags, the compiler's version and this
CPU's model and flags, so a changed source, compiler or machine builds anew and an unchanged one
loads in milliseconds. Builds write a temporary file and rename it, so workers starting together
on one node cannot load a half-written library.

Where no compiler works (a slim image without one), :func:`load` logs once what to install and
returns None; callers then take their torch path. ``PDSERVE_NATIVE_KERNELS=0`` turns the C
kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")
OPENMP = "-fopenmp"  # dropped when the compiler lacks it (the kernels then run on one thread)
BUILD_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """The C compiler is missing or failed; the message says what to install or read."""


def enabled() -> bool:
    return os.environ.get("PDSERVE_NATIVE_KERNELS", "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "native"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("no C compiler found (set CC, or install one: "
                               "apt-get install gcc libc6-dev)")
    return cc


def _machine() -> str:
    """This CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compile(cc: str, source: Path, target: Path, flags: tuple[str, ...]) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        done = subprocess.run([cc, *flags, "-o", str(partial), str(source), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode:
            raise NativeBuildError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def build(name: str) -> Path:
    """The shared library of ``kernels/<name>.c`` for this machine, compiled if not cached."""
    source = SOURCE_DIR / f"{name}.c"
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"the C compiler {cc} does not run: {exc}") from exc
    headers = [header.read_text() for header in sorted(SOURCE_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(FLAGS), version,
                                    _machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        _compile(cc, source, target, (*FLAGS, OPENMP))
    except NativeBuildError:
        _compile(cc, source, target, FLAGS)
    logger.info("built the C kernel %s for this CPU: %s", name, target)
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` loaded, or None (off, or no working compiler: logged once)."""
    if not enabled():
        return None
    try:
        return ctypes.CDLL(str(build(name)))
    except (NativeBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("the C kernel %s is not available, so the slower torch path runs "
                       "instead: %s", name, exc)
        return None


def bind(name: str, signatures: dict[str, tuple]) -> ctypes.CDLL | None:
    """:func:`load` with each listed function's ctypes signature set, ``{symbol: (restype,
    [argtypes])}``; None where the kernels do not load."""
    lib = load(name)
    if lib is None:
        return None
    for symbol, (restype, argtypes) in signatures.items():
        fn = getattr(lib, symbol)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def threads(work: int, parallel_min_work: int) -> int:
    """Threads for a kernel call: torch's count from ``parallel_min_work`` (a kernel's own
    measure of work) on, else one. Waking a second thread for a small call costs more than it
    saves, and an idle OpenMP thread spins for a while after each call, taking a core from the
    worker's other processes (torch splits its own ops by a grain size too)."""
    return torch.get_num_threads() if work >= parallel_min_work else 1

