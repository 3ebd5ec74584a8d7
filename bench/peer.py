"""pdserve against vLLM on this machine: ``python -m pdserve.bench.peer [--sittings N]``.

The same model, the same client and the same cores, one server at a time: vLLM's own load
client, ``vllm bench serve`` (random prompts of ``--input-len`` tokens, ``--output-len``
tokens each with ignore_eos, greedy), drives each server's OpenAI front door at every
``--concurrency`` and at one Poisson ``--rate`` point. For every server in turn: start it,
wait for ``/health``, run the points, stop it. ``--sittings`` repeats the whole round, the
servers interleaved, so every ratio compares figures taken minutes apart. Prints a table with
each figure's ratio against vLLM's in the same sitting, and saves vLLM's JSON results (one per
server and point) under ``--out``. Never asserts; not part of ``make test``.

The servers:

* ``vllm``: ``vllm serve`` (the peer, set up apart from pdserve: a venv holding vLLM's CPU build
  and its CLI, ``--vllm``), float32, its CPU defaults (on 2 cores it runs the model on one
  thread and keeps the other core for its API server);
* ``pdserve-colocated``: one colocated worker with one CPU (the counterpart of vLLM's one model
  thread);
* ``pdserve-colocated-hold``: the same worker holding new prompts while others decode
  (``--admission-hold-s 10``: prompts that arrive within the hold prefill together, the
  decodes run without prefills between them; not in the default ``--servers``);
* ``pdserve-1p1d``: one prefill and one decode worker, one CPU each (conditional
  disaggregation, the default: a prompt may be prefilled on the decode worker);
* ``pdserve-1p1d-always``: the same with every prompt on the prefill worker
  (``--disaggregation always``; not in the default ``--servers``).

Where the peer is not installed (no ``vllm`` executable), it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.stats import format_table

DEFAULT_VLLM = "/tmp/peer-vllm/bin/vllm"
DEFAULT_MODEL = "/tmp/peer-model/smollm2-hf"
START_TIMEOUT_S = 900.0  # vLLM compiles the model at every start (minutes on 2 cores)
FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
HIGHER_IS_BETTER = {"output_throughput"}


@dataclass(frozen=True)
class Server:
    name: str
    command: list[str]  # started in its own process group
    env: dict[str, str]
    model_name: str  # what the client sends as "model"


def servers(vllm: str, model: str, port: int) -> list[Server]:
    pdserve = [sys.executable, "-m", "pdserve.cli.main", "serve", "--model", model,
               "--dtype", "float32", "--http-port", str(port), "--port", "0",
               "--metrics-port", "none"]
    quiet = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
             "DO_NOT_TRACK": "1"}
    vllm_env = {**quiet, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto",
                **vllm_preload(vllm)}
    return [
        Server("vllm", [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                        "--served-model-name", "peer", "--dtype", "float32",
                        "--disable-uvicorn-access-log"], vllm_env, "peer"),
        Server("pdserve-colocated", [*pdserve, "--colocated", "--decode", "1"], quiet,
               Path(model).name),
        Server("pdserve-colocated-hold", [*pdserve, "--colocated", "--decode", "1",
                                          "--admission-hold-s", "10"], quiet, Path(model).name),
        Server("pdserve-1p1d", [*pdserve, "--prefill", "1", "--decode", "1"], quiet,
               Path(model).name),
        Server("pdserve-1p1d-always", [*pdserve, "--prefill", "1", "--decode", "1",
                                       "--disaggregation", "always"], quiet, Path(model).name),
    ]


def vllm_preload(vllm: str) -> dict[str, str]:
    """LD_PRELOAD as vLLM's CPU install guide asks (tcmalloc, then the venv's Intel OpenMP),
    for the libraries this machine has."""
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
            Path(vllm).resolve().parent.parent / "lib" / "libiomp5.so"]
    present = [str(lib) for lib in libs if lib.is_file()]
    return {"LD_PRELOAD": ":".join(present)} if present else {}


def start(server: Server, port: int, log: Path) -> subprocess.Popen:
    """Start ``server`` and wait until its ``/health`` answers."""
    # cwd: not the clone's root, whose kernels/ folder would hide the package of that name
    # that transformers imports in vLLM's processes (pdserve's own imports guard against it)
    proc = subprocess.Popen(server.command, env={**os.environ, **server.env},
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=log.parent)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop(proc)
    raise RuntimeError(f"{server.name} did not become healthy in {START_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server itself, which stops what it started (a signal to its whole
    process group at once would stop its children under it, and it would wait for them until
    the grace ran out); after ``grace_s``, SIGTERM to the group, then SIGKILL. Whatever of the
    group is left when the server has exited is killed."""
    steps = ((lambda sig: proc.send_signal(sig), signal.SIGTERM, grace_s),
             (lambda sig: os.killpg(proc.pid, sig), signal.SIGTERM, 10.0),
             (lambda sig: os.killpg(proc.pid, sig), signal.SIGKILL, 10.0))
    for send, sig, wait_s in steps:
        try:
            send(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def bench_point(vllm: str, server: Server, port: int, tokenizer: str, args, out: Path,
                concurrency: int | None, rate: float | None, client_args: tuple = (),
                label: str = "") -> dict:
    """One ``vllm bench serve`` point against the running server; its JSON result.
    ``client_args``: more of the client's arguments; ``label`` tells the point's file apart."""
    point = f"c{concurrency or 'inf'}-r{rate or 'inf'}{label}"
    out.mkdir(parents=True, exist_ok=True)
    name = f"{server.name}-{point}.json"
    # the same prompts for every server at this point, other prompts at every other point
    # (a point repeating the last one's prompts would be served from the prefix cache)
    seed = zlib.crc32(point.encode())
    command = [vllm, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
               "--model", server.model_name, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.num_prompts), "--num-warmups", "2", "--ignore-eos",
               "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out),
               "--result-filename", name, "--disable-tqdm",
               "--request-rate", "inf" if rate is None else str(rate)]
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    command += list(client_args)
    result = subprocess.run(command, env={**os.environ, **server.env}, capture_output=True,
                            text=True, timeout=1800, cwd=out)
    if result.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed: "
                           f"{result.stdout[-1500:]}{result.stderr[-1500:]}")
    return json.loads((out / name).read_text())


def rows_of(results: dict, sitting: int) -> list[list]:
    """Table rows of one sitting: every server's figures and their ratio against vLLM's."""
    rows = []
    for (server, point), res in results.items():
        base = results.get(("vllm", point))
        row = [sitting, server, point]
        for figure in FIGURES:
            value = res[figure]
            ratio = "" if base is None or server == "vllm" or not base[figure] else \
                f" ({value / base[figure]:.2f}x)"
            row.append(f"{value:,.1f}{ratio}")
        rows.append(row)
    return rows


def run(args) -> str:
    points = [(c, None) for c in args.concurrency] + [(None, args.rate)]
    out = Path(args.out).resolve()  # (absolute: the servers and the client run elsewhere)
    out.mkdir(parents=True, exist_ok=True)
    table = []
    for sitting in range(1, args.sittings + 1):
        results = {}
        for server in servers(args.vllm, args.model, args.port):
            if server.name not in args.servers:
                continue
            proc = start(server, args.port, out / f"{server.name}-{sitting}.log")
            try:
                for concurrency, rate in points:
                    label = f"c={concurrency}" if rate is None else f"rate={rate:g}/s"
                    results[(server.name, label)] = bench_point(
                        args.vllm, server, args.port, args.model, args, out / str(sitting),
                        concurrency, rate)
            finally:
                stop(proc)
        table += rows_of(results, sitting)
    return format_table(["sitting", "server", "point", "output tok/s", "TTFT P50 ms",
                         "TPOT P50 ms", "TPOT P99 ms"], table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=DEFAULT_VLLM, help="the peer's vllm executable")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a Hugging Face folder both servers load (also the tokenizer)")
    parser.add_argument("--servers", default="vllm,pdserve-colocated,pdserve-1p1d")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rate", type=float, default=2.0, help="the Poisson point (req/s)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--sittings", type=int, default=1)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", default="bench/results/peer")
    args = parser.parse_args(argv)
    if find_peer(args):
        print(run(args))


def find_peer(args) -> bool:
    """Resolve ``args.vllm`` and ``args.model`` and split ``args.servers``; False (having said
    what to set up) when the peer is not installed here."""
    vllm = shutil.which(args.vllm) or (args.vllm if os.access(args.vllm, os.X_OK) else None)
    if vllm is None or not Path(args.model, "config.json").is_file():
        print(f"the peer is not installed here (no vllm at {args.vllm!r} or no model folder "
              f"{args.model!r}): set up vLLM's CPU build in a venv of its own and convert the "
              "model to a Hugging Face folder, then pass --vllm and --model")
        return False
    args.vllm, args.servers = vllm, args.servers.split(",")
    args.model = str(Path(args.model).resolve())
    return True


if __name__ == "__main__":
    main()
