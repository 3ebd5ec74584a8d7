"""``pdserve serve`` as a real subprocess (its own local Ray and redis-server child), answered by
``pdserve generate``, stopped by SIGTERM with no process of its tree left behind. It serves with
``--speculative-config`` (the model as its own draft): the flag must reach the decode worker
(its draft counters rise on the metrics port) and greedy text must stay the plain engine's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from pdserve.cluster.processes import wait_gone
from pdserve.testing import wait_for

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


def _drafts(metrics_url: str) -> float:
    """Sum of pdserve_spec_decode_num_drafts_total over the workers."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_spec_decode_num_drafts_total{"))


def test_serve_answers_generate_and_stops_on_sigterm(tiny_dir, tmp_path):
    from pdserve import LLM, SamplingParams

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "serve.err"
    with open(log, "w") as err:
        spec = json.dumps({"method": "draft_model", "model": str(tiny_dir),
                           "num_speculative_tokens": 2})
        proc = subprocess.Popen([*CLI, "serve", "--model", str(tiny_dir), "--port", "0",
                                 "--metrics-port", "0", "--memory-budget-mib", "256",
                                 "--speculative-config", spec],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        match = _wait_for_line(log, r"gRPC on [^\s]+:(\d+), metrics on (\S+),", proc, 150)
        port, metrics_url = match.group(1), match.group(2)
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
        wait_for(lambda: _drafts(metrics_url) > 0, 30, "decode worker draft counters")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "pdserve: stopping" in log.read_text()
    survivors = wait_gone({p.pid for p in tree}, timeout=15)
    assert survivors == set(), [psutil.Process(p).cmdline() for p in survivors]
