"""``pdserve serve`` as a real subprocess (its own local Ray and redis-server child), answered by
``pdserve generate``, stopped by SIGTERM with no process of its tree left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pdserve.cluster.launcher import wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLI = [sys.executable, "-m", "pdserve.cluster.cli"]


def _wait_for_line(path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, path.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} from pdserve serve:\n{path.read_text()[-3000:]}")


def test_serve_answers_generate_and_stops_on_sigterm(tiny_dir, tmp_path):
    from pdserve import LLM, SamplingParams

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "serve.err"
    with open(log, "w") as err:
        proc = subprocess.Popen([*CLI, "serve", "--model", str(tiny_dir), "--port", "0",
                                 "--metrics-port", "0", "--memory-budget-mib", "256"],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        port = _wait_for_line(log, r"gRPC on [^\s]+:(\d+)", proc, 150).group(1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in tree}
        assert {"raylet", "gcs_server", "redis-server"} <= names
        out = subprocess.run([*CLI, "generate", "--target", f"127.0.0.1:{port}", "hello world",
                              "--max-tokens", "8", "--temperature", "0", "--ignore-eos"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert "finish_reason: length" in out.stderr
        expected = LLM(str(tiny_dir), num_kv_blocks=64).generate(
            "hello world", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False)[0].text
        assert out.stdout == expected + "\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "pdserve: stopping" in log.read_text()
    survivors = wait_gone({p.pid for p in tree}, timeout=15)
    assert survivors == set(), [psutil.Process(p).cmdline() for p in survivors]
