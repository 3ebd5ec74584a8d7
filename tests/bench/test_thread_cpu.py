"""``bench.thread_cpu``: a snapshot holds this very thread; a split counts a worker's busiest
threads as computing (each worker on its own, a thread started in between among them) and
every other thread alive at the second snapshot as other."""

from __future__ import annotations

import os
import threading

from pdserve.bench import thread_cpu
from pdserve.bench.thread_cpu import ThreadCPU


def test_a_snapshot_holds_this_thread():
    threads = thread_cpu.snapshot()
    mine = threads[(os.getpid(), threading.get_native_id())]
    assert "python" in mine.command and mine.cpu_s >= 0


def test_a_split_takes_each_workers_busiest_threads_as_computing():
    worker, other = "ray::WorkerActor.poll", "ray::RouterActor"
    before = {(1, 10): ThreadCPU(worker, 1.0), (1, 11): ThreadCPU(worker, 1.0),
              (1, 12): ThreadCPU(worker, 1.0), (2, 20): ThreadCPU(worker, 0.0),
              (2, 21): ThreadCPU(worker, 0.0), (3, 30): ThreadCPU(other, 5.0),
              (4, 40): ThreadCPU(other, 0.0)}  # (4, 40) ended before the second snapshot
    after = {(1, 10): ThreadCPU(worker, 4.0), (1, 11): ThreadCPU(worker, 1.5),
             (1, 12): ThreadCPU(worker, 3.0), (2, 20): ThreadCPU(worker, 0.25),
             (2, 21): ThreadCPU(worker, 2.0), (2, 22): ThreadCPU(worker, 1.5),
             (3, 30): ThreadCPU(other, 6.0),
             (5, 50): ThreadCPU(other, 9.0)}  # (2, 22) and (5, 50) started in between
    assert thread_cpu.split(before, after, computing=2) == {
        "computing": 3.0 + 2.0 + 2.0 + 1.5, "other": 0.5 + 0.25 + 1.0 + 9.0}
    assert thread_cpu.split(before, after, computing=1) == {
        "computing": 3.0 + 2.0, "other": 0.5 + 2.0 + 1.5 + 0.25 + 1.0 + 9.0}
