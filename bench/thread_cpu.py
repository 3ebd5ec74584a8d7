"""Where a served run's CPU went, thread by thread, from ``/proc`` (Linux): the worker's
computing threads against everything else on the machine (the router, the worker's other
threads, Ray's, Redis, the client). On a machine whose cores the engine shares with the
serving path, every millisecond of the second kind is one the engine's threads wait for.

:func:`snapshot` before and after a run, then :func:`split`. The computing threads are the
busiest ``computing`` threads of the processes whose command line starts with
``worker_prefix`` (a worker actor's threads are all named alike, so they are told apart by the
CPU they used). Never asserts; a bench helper.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
WORKER_PREFIX = "ray::WorkerActor"


@dataclass(frozen=True)
class ThreadCPU:
    command: str  # the process's command line, its first 60 characters
    cpu_s: float  # user + system time so far


def snapshot() -> dict[tuple[int, int], ThreadCPU]:
    """{(pid, tid): CPU so far} of every thread on the machine that can be read."""
    threads = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:60].decode(
                errors="replace")
            for task in (proc / "task").iterdir():
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                cpu_s = (int(fields[11]) + int(fields[12])) / TICKS_PER_S
                threads[(int(proc.name), int(task.name))] = ThreadCPU(command, cpu_s)
        except OSError:  # a process or thread that ended meanwhile
            continue
    return threads


def split(before: dict, after: dict, computing: int,
          worker_prefix: str = WORKER_PREFIX) -> dict[str, float]:
    """CPU seconds between the two snapshots: ``computing`` (the worker processes' busiest
    ``computing`` threads each) and ``other`` (every other thread alive at the second; one
    that started in between counts whole, one that ended in between is not seen)."""
    used = {key: thread.cpu_s - (before[key].cpu_s if key in before else 0.0)
            for key, thread in after.items()}
    by_worker: dict[int, list[float]] = {}
    for key, seconds in used.items():
        if after[key].command.startswith(worker_prefix):
            by_worker.setdefault(key[0], []).append(seconds)  # (pid, tid): by process
    computing_s = sum(sum(sorted(threads, reverse=True)[:computing])
                      for threads in by_worker.values())
    return {"computing": computing_s, "other": sum(used.values()) - computing_s}
