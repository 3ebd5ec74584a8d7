"""pdserve against vLLM on this machine: ``python -m pdserve.bench.peer [--sittings N]``.

The same model, the same client and the same cores, one server at a time: vLLM's own load
client, ``vllm bench serve`` (random prompts of ``--input-len`` tokens, ``--output-len``
tokens each with ignore_eos, greedy), drives each server's OpenAI front door at every
``--concurrency`` and at one Poisson ``--rate`` point. For every server in turn: start it,
wait for ``/health``, run the points, stop it. ``--sittings`` repeats the whole round, the
servers interleaved, so every ratio compares figures taken minutes apart. Prints a table with
each figure's ratio against vLLM's in the same sitting, and saves vLLM's JSON results (one per
server and point, with every request's output) under ``--out``. Not part of ``make test``.

Fairness: every point must have completed all ``--num-prompts`` requests with all their
output tokens (else the run stops, naming the server and point: a server that drops requests
must not look fast); the client runs in one environment for every server (vLLM's
``LD_PRELOAD`` included); each sitting shuffles the servers' order and draws new prompts
(``--seed`` and the sitting number choose both, printed with the table, with vLLM's thread
binding); the table says for each pdserve point how many of its greedy texts equal vLLM's.

``--cores`` picks the set-ups compared at equal cores:

* ``1`` (default): ``vllm`` (its CPU defaults: on 2 cores the model runs on one thread, the
  other core serves its API) against ``pdserve-colocated`` (one colocated worker with one CPU)
  and ``pdserve-1p1d``;
* ``2``: ``vllm-2t`` (its model on both cores, ``VLLM_CPU_OMP_THREADS_BIND=0-1``) against
  ``pdserve-2x1`` (two colocated workers of one CPU), ``pdserve-1x2`` (one colocated worker
  with two threads) and ``pdserve-1p1d``.

The servers:

* ``vllm``, ``vllm-2t``: ``vllm serve`` (the peer, set up apart from pdserve: a venv holding
  vLLM's CPU build and its CLI, ``--vllm``), float32;
* ``pdserve-colocated``: one colocated worker with one CPU (the counterpart of vLLM's one model
  thread); ``pdserve-2x1`` and ``pdserve-1x2`` as above;
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
import random
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
QUIET = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
         "DO_NOT_TRACK": "1"}
SET_UPS = {1: "vllm,pdserve-colocated,pdserve-1p1d",  # --cores: the servers compared
           2: "vllm-2t,pdserve-2x1,pdserve-1x2,pdserve-1p1d"}


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
    quiet = QUIET
    vllm_env = {**quiet, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto",
                **vllm_preload(vllm)}
    vllm_serve = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                  "--served-model-name", "peer", "--dtype", "float32",
                  "--disable-uvicorn-access-log"]
    return [
        Server("vllm", vllm_serve, vllm_env, "peer"),
        Server("vllm-2t", vllm_serve, {**vllm_env, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "peer"),
        Server("pdserve-colocated", [*pdserve, "--colocated", "--decode", "1"], quiet,
               Path(model).name),
        Server("pdserve-2x1", [*pdserve, "--colocated", "--decode", "2", "--worker-cpus", "1"],
               quiet, Path(model).name),
        Server("pdserve-1x2", [*pdserve, "--colocated", "--decode", "1", "--worker-cpus", "2"],
               quiet, Path(model).name),
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


def client_env(vllm: str) -> dict[str, str]:
    """The load client's environment, the same whichever server it drives."""
    return {**os.environ, **QUIET, **vllm_preload(vllm)}


def bench_point(vllm: str, server: Server, port: int, tokenizer: str, args, out: Path,
                concurrency: int | None, rate: float | None, client_args: tuple = (),
                label: str = "", sitting_seed: int = 0) -> dict:
    """One ``vllm bench serve`` point against the running server; its JSON result, checked
    complete (:func:`check_complete`). ``client_args``: more of the client's arguments;
    ``label`` tells the point's file apart; ``sitting_seed`` draws the sitting's prompts."""
    point = f"c{concurrency or 'inf'}-r{rate or 'inf'}{label}"
    out.mkdir(parents=True, exist_ok=True)
    name = f"{server.name}-{point}.json"
    # the same prompts for every server at this point of this sitting, other prompts at every
    # other point and sitting (a point repeating the last one's prompts would be served from
    # the prefix cache)
    seed = zlib.crc32(f"{point}/{sitting_seed}".encode())
    command = [vllm, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
               "--model", server.model_name, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.num_prompts), "--num-warmups", "2", "--ignore-eos",
               "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
               "--result-dir", str(out),
               "--result-filename", name, "--disable-tqdm",
               "--request-rate", "inf" if rate is None else str(rate)]
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    command += list(client_args)
    result = subprocess.run(command, env=client_env(vllm), capture_output=True, text=True,
                            timeout=1800, cwd=out)
    if result.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed: "
                           f"{result.stdout[-1500:]}{result.stderr[-1500:]}")
    saved = json.loads((out / name).read_text())
    check_complete(saved, args.num_prompts, args.output_len, f"{server.name} at {point}")
    return saved


def check_complete(result: dict, num_prompts: int, output_len: int, what: str) -> None:
    """RuntimeError naming ``what`` unless every request completed with every output token
    (figures of a run that dropped or cut requests compare nothing)."""
    completed, tokens = result.get("completed"), result.get("total_output_tokens")
    if completed != num_prompts or tokens != num_prompts * output_len:
        raise RuntimeError(f"{what}: {completed} of {num_prompts} requests completed with "
                           f"{tokens} of {num_prompts * output_len} output tokens; its "
                           f"figures are not comparable (see the saved result)")


def same_texts(result: dict, reference: dict) -> str:
    """How many of ``result``'s generated texts equal ``reference``'s, request by request
    ("k/n"; "" when either saved none)."""
    texts, ref = result.get("generated_texts"), reference.get("generated_texts")
    if not texts or not ref or len(texts) != len(ref):
        return ""
    return f"{sum(a == b for a, b in zip(texts, ref, strict=True))}/{len(ref)}"


def rows_of(results: dict, sitting: int) -> list[list]:
    """Table rows of one sitting: every server's figures and their ratio against vLLM's (the
    sitting's vLLM set-up: ``vllm`` or ``vllm-2t``), and how many greedy texts equal its."""
    rows = []
    peers = {server for server, _ in results if server.startswith("vllm")}
    for (server, point), res in results.items():
        base = next((results[(p, point)] for p in sorted(peers) if (p, point) in results),
                    None)
        row = [sitting, server, point]
        for figure in FIGURES:
            value = res[figure]
            ratio = "" if base is None or server in peers or not base[figure] else \
                f" ({value / base[figure]:.2f}x)"
            row.append(f"{value:,.1f}{ratio}")
        row.append("" if base is None or server in peers else same_texts(res, base))
        rows.append(row)
    return rows


def run(args) -> str:
    points = [(c, None) for c in args.concurrency] + [(None, args.rate)]
    out = Path(args.out).resolve()  # (absolute: the servers and the client run elsewhere)
    out.mkdir(parents=True, exist_ok=True)
    table, notes = [], []
    for sitting in range(1, args.sittings + 1):
        results = {}
        chosen = [s for s in servers(args.vllm, args.model, args.port)
                  if s.name in args.servers]
        sitting_seed = args.seed * 1000 + sitting
        random.Random(sitting_seed).shuffle(chosen)  # (vLLM neither always first nor last)
        notes.append(f"sitting {sitting}: order {', '.join(s.name for s in chosen)}; prompt "
                     f"seed {sitting_seed}; vLLM thread binding "
                     + ", ".join(f"{s.name} {s.env.get('VLLM_CPU_OMP_THREADS_BIND')}"
                                 for s in chosen if s.name.startswith("vllm")))
        for server in chosen:
            proc = start(server, args.port, out / f"{server.name}-{sitting}.log")
            try:
                for concurrency, rate in points:
                    label = f"c={concurrency}" if rate is None else f"rate={rate:g}/s"
                    results[(server.name, label)] = bench_point(
                        args.vllm, server, args.port, args.model, args, out / str(sitting),
                        concurrency, rate, sitting_seed=sitting_seed)
            finally:
                stop(proc)
        table += rows_of(results, sitting)
    return "\n".join(notes) + "\n" + format_table(
        ["sitting", "server", "point", "output tok/s", "TTFT P50 ms", "TPOT P50 ms",
         "TPOT P99 ms", "texts = vLLM's"], table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=DEFAULT_VLLM, help="the peer's vllm executable")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a Hugging Face folder both servers load (also the tokenizer)")
    parser.add_argument("--cores", type=int, choices=sorted(SET_UPS), default=1,
                        help="the set-ups compared at equal cores (see above)")
    parser.add_argument("--servers", default=None,
                        help="comma-separated server names (default: --cores' set-ups)")
    parser.add_argument("--seed", type=int, default=0,
                        help="with the sitting number: each sitting's order and prompts")
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
    args.vllm, args.servers = vllm, (args.servers or SET_UPS[args.cores]).split(",")
    args.model = str(Path(args.model).resolve())
    return True


if __name__ == "__main__":
    main()
