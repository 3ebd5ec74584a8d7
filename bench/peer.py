"""pdserve against vLLM on this machine: ``python -m pdserve.bench.peer [--sittings N]``.

The same model, the same client and the same cores, one server at a time: vLLM's own load
client, ``vllm bench serve`` (random prompts, ``--ignore-eos``, greedy), drives each server's
OpenAI front door over a grid (:mod:`pdserve.bench.peer_grid`): every ``--dtypes`` (both
servers load the model in it), every ``--shapes`` (prompt/output lengths, fixed or spread:
``1024~0.5/256~0.5``), closed loops at every ``--concurrency`` and Poisson arrivals at every
``--rate-fractions`` of vLLM's capacity (the requests/s it completed at its highest
concurrency of that dtype and shape, in the same sitting: each dtype runs its closed-loop pass,
every server in turn, then its Poisson pass). A point sends ``--num-prompts`` requests (a
closed loop at least two per slot). Every ratio compares two servers' figures from the same
pass of one sitting; ``--sittings`` repeats the whole round, to see the spread. Writes
``report.md`` under ``--out`` (one table per sitting, each figure beside its ratio to vLLM's
and the issue's goals marked met or not per row, :mod:`pdserve.bench.peer_report`), a PNG of
the ratios per sitting, and every point's saved result with each request's output; prints
the table. Not part of ``make test``.

A short sitting: ``--servers vllm,pdserve-colocated --shapes 256/64 --dtypes float32
--concurrency 1 8 --rate-fractions 1.0``.

Fairness: every request of every point must have completed with exactly the output tokens it
asked for (with spread lengths, each request's own: the client's sampler, run in the peer's
venv, draws them again from the point's seed; else the run stops, naming the server and point:
a server that drops or cuts requests must not look fast); the client runs in one environment
for every server (vLLM's ``LD_PRELOAD`` included); each pass shuffles the servers' order and
each sitting draws new prompts (``--seed`` and the sitting number choose both, noted in the
report with vLLM's thread binding); the table says for each pdserve point how many of its
greedy texts equal vLLM's.

``--cores`` picks the set-ups compared at equal cores:

* ``1`` (default): ``vllm`` (its CPU defaults: on 2 cores the model runs on one thread, the
  other core serves its API) against ``pdserve-colocated`` (one colocated worker with one CPU)
  and ``pdserve-1p1d``;
* ``2``: ``vllm-2t`` (its model on both cores, ``VLLM_CPU_OMP_THREADS_BIND=0-1``) against
  ``pdserve-2x1`` (two colocated workers of one CPU), ``pdserve-1x2`` (one colocated worker
  with two threads) and ``pdserve-1p1d``.

The servers:

* ``vllm``, ``vllm-2t``: ``vllm serve`` (the peer, set up apart from pdserve: a venv holding
  vLLM's CPU build and its CLI, ``--vllm``);
* ``pdserve-colocated``: one colocated worker with one CPU (the counterpart of vLLM's one model
  thread); ``pdserve-2x1`` and ``pdserve-1x2`` as above;
* ``pdserve-colocated-hold``: the same worker holding new prompts while others decode
  (``--admission-hold-s 10``: prompts that arrive within the hold prefill together, the
  decodes run without prefills between them; not in the default ``--servers``);
* ``pdserve-colocated-prefill-batch``: the same worker with ``--prefill-batch-tokens 512``
  (prompts that arrive together prefill two of 256 tokens a step, the first ones taking
  their first token sooner; not in the default ``--servers``);
* ``pdserve-1x2-prefill-batch``: ``pdserve-1x2`` with ``--prefill-batch-tokens 512`` (two
  prompts of 256 tokens a step; not in the default ``--servers``);
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.peer_grid import (
    DEFAULT_SHAPES,
    DTYPES,
    Point,
    Shape,
    grid,
    parse_shape,
    passes,
    rate_of,
)
from pdserve.bench.peer_report import rows_of, sitting_section, text_table, write_plot

DEFAULT_VLLM = "/tmp/peer-vllm/bin/vllm"
DEFAULT_MODEL = "/tmp/peer-model/smollm2-hf"
START_TIMEOUT_S = 900.0  # vLLM compiles the model at every start (minutes on 2 cores)
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


def servers(vllm: str, model: str, port: int, dtype: str = "float32") -> list[Server]:
    """Every set-up of the module docstring, each loading the model in ``dtype``."""
    pdserve = [sys.executable, "-m", "pdserve.cli.main", "serve", "--model", model,
               "--dtype", dtype, "--http-port", str(port), "--port", "0",
               "--metrics-port", "none"]
    quiet = QUIET
    vllm_env = {**quiet, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto",
                **vllm_preload(vllm)}
    vllm_serve = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                  "--served-model-name", "peer", "--dtype", dtype,
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
        Server("pdserve-colocated-prefill-batch", [*pdserve, "--colocated", "--decode", "1",
                                                   "--prefill-batch-tokens", "512"], quiet,
               Path(model).name),
        Server("pdserve-1x2-prefill-batch", [*pdserve, "--colocated", "--decode", "1",
                                             "--worker-cpus", "2", "--prefill-batch-tokens",
                                             "512"], quiet, Path(model).name),
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


def workload(tokenizer: str, shape: Shape, num_prompts: int, seed: int) -> list[str]:
    """The client's arguments that choose the requests: the prompts and every request's
    output length (what :func:`requested_lengths` replays)."""
    return ["--tokenizer", tokenizer, "--dataset-name", "random", *shape.client_args(),
            "--num-prompts", str(num_prompts), "--seed", str(seed)]


@dataclass(frozen=True)
class Lengths:
    """What the client asked for, request by request, in the order of its saved result."""
    inputs: list[int] | None  # prompt tokens (None: not checked)
    outputs: list[int]  # output tokens asked for (ignore_eos: every one must come)

    @classmethod
    def fixed(cls, num_prompts: int, output_len: int) -> Lengths:
        return cls(None, [output_len] * num_prompts)


# Run by the peer's Python: the client's own parser and sampler draw each workload's requests
# (argv[1]: {key: workload arguments}), their lengths go to argv[2] as {key: [ins, outs]}.
_SAMPLER = """
import json, sys
from vllm.benchmarks.datasets import get_samples
from vllm.benchmarks.serve import add_cli_args
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
lengths, tokenizers = {}, {}
for key, argv in json.loads(open(sys.argv[1]).read()).items():
    args = parser.parse_args(["--model", "unused", *argv])
    if args.tokenizer not in tokenizers:
        tokenizers[args.tokenizer] = get_tokenizer(
            args.tokenizer, tokenizer_mode=args.tokenizer_mode,
            trust_remote_code=args.trust_remote_code)
    requests = get_samples(args, tokenizers[args.tokenizer])
    lengths[key] = [[r.prompt_len for r in requests], [r.expected_output_len for r in requests]]
open(sys.argv[2], "w").write(json.dumps(lengths))
"""


def requested_lengths(vllm: str, workloads: dict[str, list[str]], scratch: Path
                      ) -> dict[str, Lengths]:
    """Every workload's requested lengths, drawn by the client's own sampler in the peer's
    venv (the saved result holds the lengths each request got, not the ones it asked for)."""
    jobs, answer = scratch / "workloads.json", scratch / "lengths.json"
    jobs.write_text(json.dumps(workloads))
    python = Path(vllm).parent / "python"
    done = subprocess.run([str(python), "-c", _SAMPLER, str(jobs), str(answer)],
                          env=client_env(vllm), capture_output=True, text=True, cwd=scratch,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the client's sampler failed: {done.stderr[-1500:]}")
    drawn = json.loads(answer.read_text())
    return {key: Lengths(ins, outs) for key, (ins, outs) in drawn.items()}


def bench_point(vllm: str, server: Server, port: int, requests: list[str], out: Path,
                name: str, concurrency: int | None, rate: float | None,
                expected: Lengths, client_args: tuple = ()) -> dict:
    """One ``vllm bench serve`` point against the running server: ``requests`` (see
    :func:`workload`) at ``concurrency`` or Poisson ``rate``; its JSON result, saved as
    ``out/name.json`` and checked complete against ``expected`` (:func:`check_complete`).
    ``client_args``: more of the client's arguments."""
    out.mkdir(parents=True, exist_ok=True)
    command = [vllm, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
               "--model", server.model_name, *requests, "--num-warmups", "2", "--ignore-eos",
               "--temperature", "0", "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
               "--result-dir", str(out), "--result-filename", f"{name}.json",
               "--disable-tqdm", "--request-rate", "inf" if rate is None else str(rate)]
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    command += list(client_args)
    result = subprocess.run(command, env=client_env(vllm), capture_output=True, text=True,
                            timeout=3600, cwd=out)
    if result.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed: "
                           f"{result.stdout[-1500:]}{result.stderr[-1500:]}")
    saved = json.loads((out / f"{name}.json").read_text())
    check_complete(saved, expected, f"{server.name} at {name}")
    return saved


def check_complete(result: dict, expected: Lengths, what: str) -> None:
    """RuntimeError naming ``what`` unless every request completed with exactly the output
    tokens it asked for (figures of a run that dropped or cut requests compare nothing), or
    when the saved prompts' lengths are not the ones ``expected`` was drawn for."""
    asked, got = expected.outputs, result.get("output_lens")
    completed = result.get("completed")
    if completed != len(asked) or got is None or len(got) != len(asked):
        raise RuntimeError(f"{what}: {completed} of {len(asked)} requests completed; its "
                           "figures are not comparable (see the saved result)")
    if expected.inputs is not None and result.get("input_lens") != expected.inputs:
        raise RuntimeError(f"{what}: the saved prompt lengths are not the ones the requested "
                           "output lengths were drawn with; the check would compare nothing")
    short = [(i, g, a) for i, (g, a) in enumerate(zip(got, asked, strict=True)) if g != a]
    if short:
        shown = ", ".join(f"request {i} got {g} of {a}" for i, g, a in short[:3])
        raise RuntimeError(f"{what}: {len(short)} of {len(asked)} requests did not get the "
                           f"output tokens they asked for ({shown}); its figures are not "
                           "comparable (see the saved result)")


def peer_of(names: list[str]) -> str | None:
    """The sitting's vLLM set-up (the first by name of ``vllm``, ``vllm-2t``), or None."""
    return next(iter(sorted(n for n in names if n.startswith("vllm"))), None)


@dataclass
class Sitting:
    """One sitting's state: its number, seed, results and notes."""
    number: int
    seed: int  # with the point's label: each point's prompts; and the servers' orders
    results: dict[tuple[str, Point], dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def point_seed(self, point: Point) -> int:
        # the same prompts for every server at this point of this sitting, other prompts at
        # every other point and sitting (a point repeating another's prompts would be served
        # from the prefix cache)
        return zlib.crc32(f"{point.label}/{self.seed}".encode())

    def peer_results(self, peer: str | None) -> dict[Point, dict]:
        return {p: r for (s, p), r in self.results.items() if s == peer}

    def workload(self, args, point: Point) -> list[str]:
        """The client's requests at ``point`` (:func:`workload`)."""
        return workload(args.model, point.shape, point.num_prompts(args.num_prompts),
                        self.point_seed(point))


def run_pass(args, sitting: Sitting, points: list[Point], lengths: dict[str, Lengths],
             out: Path) -> None:
    """Every chosen server in a new shuffled order, each started once in the pass's dtype,
    through ``points`` (one dtype's closed-loop points, or its Poisson points)."""
    peer = peer_of(args.servers)
    rates = {p: rate_of(p, sitting.peer_results(peer)) for p in points}
    dtype = points[0].dtype
    chosen = [s for s in servers(args.vllm, args.model, args.port, dtype)
              if s.name in args.servers]
    random.Random(f"{sitting.seed}/{points[0].label}").shuffle(chosen)
    kind = "closed-loop" if points[0].load.closed else "poisson"
    sitting.notes.append(f"{dtype} {kind} pass: order {', '.join(s.name for s in chosen)}"
                         + "".join(f"; {p.shape.label} {p.load.label} = {r:.2f} req/s"
                                   for p, r in rates.items() if r is not None))
    for server in chosen:
        proc = start(server, args.port, out / f"{server.name}-{dtype}-{kind}.log")
        try:
            for point in points:
                name = f"{server.name}-{point.label}".replace(" ", "-").replace("/", "_")
                sitting.results[(server.name, point)] = bench_point(
                    args.vllm, server, args.port, sitting.workload(args, point), out, name,
                    point.load.concurrency, rates[point], lengths[point.label])
        finally:
            stop(proc)


def run_sitting(args, sitting: Sitting, points: list[Point], out: Path) -> None:
    """The sitting's requested lengths, then every dtype's passes, into ``sitting``."""
    out.mkdir(parents=True, exist_ok=True)
    lengths = requested_lengths(args.vllm, {p.label: sitting.workload(args, p) for p in points},
                                out)
    sitting.notes.append(f"seed {sitting.seed}; vLLM thread binding " + ", ".join(
        f"{s.name} {s.env.get('VLLM_CPU_OMP_THREADS_BIND')}"
        for s in servers(args.vllm, args.model, args.port) if s.name in args.servers
        and s.name.startswith("vllm")))
    for dtype in args.dtypes:
        for one_pass in passes(dtype, args.shapes, args.concurrency, args.rate_fractions):
            run_pass(args, sitting, one_pass, lengths, out)


def write_report(sittings: list[Sitting], points: list[Point], peer: str | None,
                 out: Path) -> dict[int, list[list]]:
    """``report.md`` and each sitting's plot under ``out`` (what the sittings hold so far);
    the rows of every sitting."""
    sections, rows = [], {}
    for sitting in sittings:
        rows[sitting.number] = rows_of(sitting.results, points, peer)
        sections.append(sitting_section(sitting.number, sitting.notes, rows[sitting.number]))
        if peer is not None and sitting.results:
            write_plot(sitting.results, points, peer,
                       out / f"ratios-sitting-{sitting.number}.png")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("# pdserve against vLLM\n\n" + "\n".join(sections))
    return rows


def run(args) -> str:
    """Every sitting; writes the report under ``--out``, also when a point stops the run
    (with what was measured before it); returns the text table."""
    out = Path(args.out).resolve()  # (absolute: the servers and the client run elsewhere)
    points = grid(args.dtypes, args.shapes, args.concurrency, args.rate_fractions)
    sittings: list[Sitting] = []
    try:
        for number in range(1, args.sittings + 1):
            sittings.append(Sitting(number, args.seed * 1000 + number))
            run_sitting(args, sittings[-1], points, out / str(number))
    finally:
        rows = write_report(sittings, points, peer_of(args.servers), out)
    return text_table(rows)


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
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help="IN[~R]/OUT[~R] prompt/output lengths, ~R a range ratio")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                        help="the closed-loop points")
    parser.add_argument("--rate-fractions", type=float, nargs="*", default=[0.5, 0.8, 1.0, 1.2],
                        help="the Poisson points, fractions of vLLM's capacity (none: skip)")
    parser.add_argument("--num-prompts", type=int, default=24,
                        help="requests per point (a closed loop: at least 2 per slot)")
    parser.add_argument("--sittings", type=int, default=1)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", default="bench/results/peer",
                        help="saved results, logs, report.md and the plots")
    args = parser.parse_args(argv)
    args.shapes = [parse_shape(text) for text in args.shapes]
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
    if args.rate_fractions and peer_of(args.servers) is None:
        raise ValueError("--rate-fractions: the Poisson rates are fractions of vLLM's capacity; "
                         "put vllm or vllm-2t in --servers, or pass --rate-fractions alone")
    return True


if __name__ == "__main__":
    main()
