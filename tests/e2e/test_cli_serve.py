"""``pdserve serve`` as a real subprocess (its own local Ray and redis-server child), answered by
``pdserve generate``, stopped by SIGTERM twice in a row under load within seconds, quietly,
with no process of its tree or of its Ray left behind; and stopped the same way by a SIGTERM
while it is still starting (its local Ray's init under way). It serves with
``--speculative-config`` (the model as its own draft): the flag must reach the decode worker
(its draft counters rise on the metrics port) and greedy text must stay the plain engine's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from pdserve.bench.chaos_routers import error_lines, sigterm_and_wait
from pdserve.bench.failover import StreamRecord, chaos_requests, stream_one
from pdserve.testing.waits import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster, pytest.mark.slow]

CLI = [sys.executable, "-m", "pdserve.cli.main"]
STOP_S = 10.0  # SIGTERM -> every process gone, at most (Kubernetes kills a few seconds later)


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
        session = _ray_session(proc)
        records = _under_load(f"127.0.0.1:{port}")
        seconds, left = sigterm_and_wait(proc, times=2)  # twice in a row, while streaming
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(r.token_ids for r in records)  # it was serving when the signals came
    assert left == set() and seconds < STOP_S and proc.returncode == 0
    assert "pdserve: stopping" in log.read_text() and error_lines(log) == []
    assert _processes_of(session) == []


@pytest.mark.parametrize("moment", ["gcs_server", "raylet"])
def test_sigterm_while_starting_stops_everything(tiny_dir, tmp_path, moment):
    log = tmp_path / "serve.err"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as err:
        proc = subprocess.Popen([*CLI, "serve", "--model", str(tiny_dir), "--port", "0",
                                 "--metrics-port", "0", "--memory-budget-mib", "256"],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        # the local Ray's init is under way (its GCS, then its raylet runs): a SIGTERM used to
        # be lost there, and a half-started Ray's processes left running
        session = wait_for(lambda: _ray_session(proc, moment), 120, f"{moment} of pdserve serve",
                           0.02)
        seconds, left = sigterm_and_wait(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert left == set() and seconds < STOP_S and proc.returncode == 0
    assert error_lines(log) == []
    assert _processes_of(session) == []


def _ray_session(proc: subprocess.Popen, process: str = "gcs_server") -> str | None:
    """The temp folder of the local Ray ``proc`` started, once its ``process`` runs."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            match = re.search(r"/tmp/pdray-[^/\s]+", " ".join(child.cmdline()))
        except psutil.Error:
            continue
        if match and child.name() == process:
            return match.group(0)
    return None


def _processes_of(session: str) -> list[str]:
    """Every process on this machine that belongs to that Ray (its folder is in the command)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if session in command:
            found.append(command[:200])
    return found


def _under_load(target: str) -> list[StreamRecord]:
    """Streams sent from a thread; returns their records once several have tokens (the
    thread goes on streaming until the server stops)."""
    from pdserve.api.client import AsyncPdserveClient

    requests = chaos_requests(8, seed=2, prefix="load", min_tokens=400, max_tokens=500)
    records = [StreamRecord(r.request_id) for r in requests]

    async def main() -> None:
        async with AsyncPdserveClient(target) as client:
            await asyncio.gather(*(stream_one(client, r, rec, 60)
                                   for r, rec in zip(requests, records, strict=True)))

    threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
    wait_for(lambda: sum(len(r.token_ids) >= 4 for r in records) >= 4, 60,
             "streams under way", 0.05)
    return records
