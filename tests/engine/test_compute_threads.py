"""One computing thread a worker process (``engine.compute_threads``, ``workers.build``).

The counts are process-wide state, so each check runs in a fresh Python process. A thread's
OpenMP pool shows as threads of the process (``/proc/self/task``): a thread that computes on
two threads starts one more the first time it runs a parallel op, and keeps it while it lives.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pdserve.engine import compute_threads

PRELUDE = """
import json, os, threading, torch
from pdserve.engine import compute_threads

def threads_now():
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    torch.ones(1 << 22).mul_(2.0)  # far past torch's grain: split over the thread's count

def op_then_count():
    parallel_op()
    return threads_now()  # while this thread (and any pool of its own) lives

def on_fresh_thread(fn):
    return compute_threads.on_own_thread(fn)
"""


def run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_claimed_thread_computes_on_its_count_and_others_on_one():
    out = run("""
        torch.set_num_threads(2)  # as a worker process starts: its CPUs, process-wide
        box = {}
        def engine_thread():
            compute_threads.claim(2)
            parallel_op()
            box["engine"] = torch.get_num_threads()
            box["after_engine"] = threads_now()
            box["other"] = on_fresh_thread(torch.get_num_threads)
            box["during_other"] = on_fresh_thread(op_then_count)
        before = threads_now()
        thread = threading.Thread(target=engine_thread); thread.start(); thread.join()
        print(json.dumps({**box, "before": before}))
    """)
    assert out["engine"] == 2 and out["other"] == 1
    assert out["after_engine"] == out["before"] + 2  # the engine thread and its pool's one
    assert out["during_other"] == out["after_engine"] + 1  # the other thread alone: no pool


def test_without_a_claim_a_second_computing_thread_keeps_its_own_pool():
    """The control: what :func:`claim` prevents, measured the same way."""
    out = run("""
        torch.set_num_threads(2)
        parallel_op()  # this thread's pool
        first = threads_now()
        box = {}
        print(json.dumps({"first": first, "during": on_fresh_thread(op_then_count)}))
    """)
    assert out["during"] == out["first"] + 2  # the thread itself and a pool of its own


def test_a_worker_built_with_compute_threads_computes_on_its_engine_loop_thread(tiny_dir):
    out = run(f"""
        from pdserve.engine.config import EngineConfig
        from pdserve.workers.build import build_worker, with_compute_threads
        torch.set_num_threads(2)
        native = lambda: threads_now() - threading.active_count()  # OpenMP's pools, mostly
        native_before = native()
        config = EngineConfig(model={str(tiny_dir)!r}, dtype="float32", block_size=4,
                              num_kv_blocks=64, max_num_batched_tokens=64)
        worker = with_compute_threads(lambda: build_worker("colocated", "w", config), 2)
        names = sorted(t.name for t in threading.enumerate())
        worker.loop.call(parallel_op).result()
        pools = native() - native_before
        loop = worker.loop.call(torch.get_num_threads).result()
        caller = torch.get_num_threads()
        other = on_fresh_thread(torch.get_num_threads)
        ledger = worker.engine.parts.ledger.num_threads
        worker.close()
        print(json.dumps({{"loop": loop, "caller": caller, "other": other, "names": names,
                           "ledger": ledger, "pools": pools}}))
    """)
    assert (out["loop"], out["caller"], out["other"], out["ledger"]) == (2, 1, 1, 2)
    assert not any(name.endswith("-once") for name in out["names"])  # the build's thread ended
    assert out["pools"] == 1  # the engine loop's one; the build's ended with its thread


def test_on_own_thread_returns_the_result_and_raises_the_error():
    assert compute_threads.on_own_thread(lambda a, b: a + b, 2, 3) == 5

    def fail():
        raise KeyError("built wrong")

    with pytest.raises(KeyError, match="built wrong"):
        compute_threads.on_own_thread(fail)


@pytest.mark.parametrize("count", [0, -1])
def test_claim_refuses_a_count_below_one(count):
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        compute_threads.claim(count)
