"""One thread computes in a worker process; every other thread of it runs torch on one thread.

A CPU worker asks Ray for N CPUs and splits its steps over N OpenMP threads. GNU OpenMP
(libgomp, which torch and pdserve's C kernels share) keeps a pool of N - 1 threads for every
thread that has ever run a parallel region, for as long as that thread lives, and once the
process holds more such threads than it has CPUs, every waiting OpenMP thread stops spinning
after a few iterations and sleeps instead (libgomp's "throttled" spin). A step has ~150
parallel regions, so every one of them then waits for a sleeping thread to be woken. That
happens as soon as a second thread computes on N threads: the thread that built the engine
(weights packed on N threads), a KV unpacking, tier or grammar thread doing a large copy.

So the engine loop's thread claims the N threads (:func:`claim`) and the rest of the process
computes on one: torch takes a thread's count from the process-wide one the first time that
thread runs a parallel op, and :func:`claim` sets the process-wide count to one after setting
its own thread's to N. :func:`on_own_thread` runs work (the engine's build) on a thread that
exits with its pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def claim(num_threads: int) -> None:
    """The calling thread computes on ``num_threads`` threads from now on; threads that have
    not yet run torch's parallel work run it on one."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.get_num_threads()  # this thread's count taken from the process-wide one (once)
    torch.set_num_threads(num_threads)  # this thread's count, and the process-wide one
    on_own_thread(torch.set_num_threads, 1)  # the process-wide count; this thread keeps its own


def on_own_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a new thread, waited for: whatever OpenMP threads it starts end with
    it. Its exception is raised here."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name=f"{getattr(fn, '__name__', 'work')}-once")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value
