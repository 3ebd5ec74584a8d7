"""End to end: real Ray (one local instance per test session), real redis-server, real gRPC.

Fixtures:
* ``ray_session``: a local Ray on loopback for the whole session (temp dir under /tmp).
* ``redis_url``: one redis-server child for the session; clusters get their own key prefix.
* ``start_cluster(model_dir, own_redis=False, stage=None, **options)``: an
  ``EmbeddedCluster`` with small pools (block_size 4, 128 KV blocks, 32 tokens per step) on
  free ports, started and SERVING. ``stage(cluster)`` runs between the router's start and the
  workers' (to observe NOT_SERVING). Stop it yourself (module fixtures do, in teardown).
* ``e2e``: helpers (:class:`Helpers`): prompts, the offline reference, waiting on stats,
  ``wait_for(predicate, timeout, what)``: the one way tests poll for a condition.
* ``ray_node_processes``: :class:`RayNodes`, a multi-node Ray cluster as local processes
  (``RayNodes(tmp_dir)``; stop it with ``stop()``).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
from pdserve.cluster.processes import is_running
from pdserve.cluster.redis_server import RedisServer, free_port
from pdserve.testing.chat_templates import CHATML_WITH_TOOLS
from pdserve.testing.waits import wait_for

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
WAIT_S = 30.0  # bound on waiting for an asynchronous effect
# How often e2e waits look: each look asks the cluster (a Ray call, an RPC, a process table),
# and on 2 cores looking every 0.02 s takes CPU from the start or replacement waited for.
POLL_S = 0.1


@pytest.fixture(scope="session")
def ray_session():
    from pdserve.cluster.ray_env import init_ray

    temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
    # Logical CPUs: the e2e pools (each worker asks for one, --worker-cpus) share this
    # machine's two cores on purpose, as an embedded cluster's local Ray lets them.
    ray = init_ray(temp_dir=temp_dir, num_cpus=16)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def start_cluster(ray_session, redis_url):
    def start(model_dir: Path, own_redis: bool = False, stage=None,
              **options) -> EmbeddedCluster:
        engine = {**ENGINE, **options.pop("engine", {})}
        opts = ClusterOptions(model=str(model_dir), port=0, metrics_port=0,
                              redis_url=None if own_redis else redis_url, engine=engine,
                              heartbeat_s=0.5, ttl_s=3.0, **options)
        cluster = EmbeddedCluster(opts)
        try:
            cluster.start_infra()
            cluster.start_router()
            if stage is not None:
                stage(cluster)
            cluster.start_workers()
            cluster.wait_ready(60)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    return start


class Helpers:
    """Shared test helpers (test files cannot import each other)."""

    def __init__(self):
        self._reference: dict = {}
        self._offline: dict = {}  # model folder -> its offline LLM, loaded once a session

    @staticmethod
    def prompts(seed: int, n: int, low: int = 3, high: int = 40) -> list[list[int]]:
        """Token-id prompts of mixed lengths."""
        rng = random.Random(seed)
        return [[rng.randrange(3, 400) for _ in range(rng.randrange(low, high))]
                for _ in range(n)]

    def reference(self, model_dir: Path, prompts: list[list[int]], max_tokens: int,
                  **sampling):
        """Greedy token ids from the offline LLM (which the engine tests tie to HF);
        ``sampling``: more SamplingParams fields (ignore_eos is on unless it says)."""
        from pdserve import LLM, SamplingParams

        key = (str(model_dir), tuple(map(tuple, prompts)), max_tokens,
               json.dumps(sampling, sort_keys=True))
        if key not in self._reference:
            if key[0] not in self._offline:
                self._offline[key[0]] = LLM(key[0], dtype="float32", block_size=4,
                                            num_kv_blocks=256)
            llm = self._offline[key[0]]
            params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0,
                                                              "ignore_eos": True, **sampling})
            outs = llm.generate(prompts, params, use_tqdm=False)
            self._reference[key] = [o.token_ids for o in outs]
        return self._reference[key]

    @staticmethod
    def generate_all(target: str, prompts: list[list[int]], max_tokens: int, **sampling):
        """Send every prompt at once through gRPC (greedy, ``sampling``: more keywords of
        the client's, as ``reference`` takes them); results in prompt order."""
        import asyncio

        from pdserve.api.client import AsyncPdserveClient

        async def main():
            async with AsyncPdserveClient(target, timeout=60) as client:
                return await asyncio.gather(*(
                    client.generate(p, max_tokens=max_tokens, **{"temperature": 0.0,
                                                                 "ignore_eos": True,
                                                                 **sampling})
                    for p in prompts))

        return asyncio.run(main())

    @staticmethod
    def cancel_then_deadline(target: str):
        """Cancel one stream mid-stream, then let a deadline expire mid-stream; returns (the
        deadline's status code, the chunks that arrived before it). The deadline is set from
        the first stream's speed (its first chunk's latency, then tokens per second), so it
        falls about a quarter of the way into the second stream on any machine."""
        import asyncio
        import time

        from pdserve.api.client import AsyncPdserveClient, PdserveError

        async def main():
            async with AsyncPdserveClient(target) as client:
                start = time.monotonic()
                stream = client.generate_stream([5, 6, 7, 8] * 5, max_tokens=1000,
                                                temperature=0.0, ignore_eos=True, timeout=60)
                tokens, first = 0, None
                async for chunk in stream:
                    assert chunk.token_ids
                    first = first or time.monotonic()
                    tokens += len(chunk.token_ids)
                    if tokens >= 64:
                        break  # cancel mid-stream
                await stream.aclose()
                per_token = (time.monotonic() - first) / max(tokens - 1, 1)
                deadline = 2 * (first - start) + 500 * per_token  # of up to 2000 tokens
                got = []
                try:
                    async for chunk in client.generate_stream([9, 10, 11], max_tokens=2000,
                                                              temperature=0.0, ignore_eos=True,
                                                              timeout=deadline):
                        got.append(chunk)
                except PdserveError as err:
                    return err.code, got
                return None, got

        return asyncio.run(main())

    @staticmethod
    def wait_for(predicate, timeout: float = WAIT_S, what: str = "a condition",
                 interval: float = POLL_S):
        """``pdserve.testing.waits.wait_for`` (the one polling helper), looking every
        ``POLL_S`` unless told otherwise."""
        return wait_for(predicate, timeout, what, interval)

    @staticmethod
    def used_blocks(cluster: EmbeddedCluster) -> dict[str, int]:
        return {wid: s.used_blocks for wid, s in cluster.worker_stats().items()}

    def wait_idle(self, cluster: EmbeddedCluster) -> dict[str, int]:
        """Poll worker stats until every worker owns no block; returns them (all 0)."""
        def idle():
            used = self.used_blocks(cluster)
            return used if used and not any(used.values()) else False

        return wait_for(idle, WAIT_S, "every worker's blocks back to 0", POLL_S)


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint):
    """The default e2e checkpoint (a test module may override it)."""
    return hf_checkpoint("qwen2", max_position_embeddings=2048)


@pytest.fixture(scope="session")
def chat_model(hf_checkpoint, tmp_path_factory):
    """The default e2e checkpoint plus a ChatML chat_template.jinja that shows tools the
    Hermes way (served as qwen2-chat)."""
    folder = tmp_path_factory.mktemp("chat-model") / "qwen2-chat"
    shutil.copytree(hf_checkpoint("qwen2", max_position_embeddings=2048), folder)
    (folder / "chat_template.jinja").write_text(CHATML_WITH_TOOLS)
    return folder


@pytest.fixture(scope="session")
def e2e() -> Helpers:
    return Helpers()


HERE = Path(__file__).parent
RAY = [sys.executable, "-P", "-c", "from ray.scripts.scripts import main; main()"]
NODE_START_S = 120.0  # bound on one Ray node coming up
STOP_GRACE_S = 8.0  # RayNodes.stop: SIGTERM to SIGKILL, for every node together


class RayNodes:
    """A head and joined nodes as local processes (``ray start --block``), stopped by pid.
    ``RAY`` runs a head; ``join_command`` a node that joins it over loopback (ray_node.py)."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # One token for every process of this cluster (the head turns token auth on).
        self.env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "RAY_raylet_start_wait_time_s": "120"}
        self.nodes: dict[str, subprocess.Popen] = {}  # name -> its `ray start` process
        self._seen: set[int] = set()  # every process of theirs seen, for the teardown

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        log = Path(self.tmp, f"{name}.log")
        common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
                  "--dashboard-agent-listen-port", str(free_port())]
        proc = subprocess.Popen([*command, *common], env=self.env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = proc
        deadline = time.monotonic() + NODE_START_S
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.remember()
        return proc

    def head(self) -> None:
        self.start("head", [*RAY, "start", "--head", "--port", str(self.port), "--num-cpus",
                            "0", "--include-dashboard", "false", "--temp-dir",
                            str(Path(self.tmp, "ray"))])

    def join_command(self) -> list[str]:
        """``ray start`` for a node joining over loopback (add ``--address`` and the rest)."""
        return [sys.executable, "-P", str(HERE / "ray_node.py"), "start"]

    def join(self, name: str, resources: dict) -> None:
        self.start(name, [*self.join_command(), "--address", self.address, "--num-cpus", "1",
                          "--resources", json.dumps(resources)])

    def remember(self) -> None:
        for proc in self.nodes.values():
            try:
                self._seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass

    def tree(self, name: str) -> set[int]:
        """Every live process under node ``name``'s ``ray start``."""
        return {p.pid for p in psutil.Process(self.nodes[name].pid).children(recursive=True)}

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the joined nodes' process groups and wait for them, then the head's
        ``ray start --block`` (which stops its own processes); after ``grace_s`` for them all,
        SIGKILL whatever of theirs is left. A joined node's ``ray start`` alone, SIGTERMed,
        outlasted the whole grace every time; with its raylet and agents SIGTERMed too, it
        stops at once, and so does the head once they are gone."""
        self.remember()
        deadline = time.monotonic() + grace_s
        self._terminate([p for name, p in self.nodes.items() if name != "head"], deadline,
                        group=True)
        self._terminate([p for name, p in self.nodes.items() if name == "head"], deadline,
                        group=False)
        for pid in self._seen:
            if is_running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @staticmethod
    def _terminate(procs: list[subprocess.Popen], deadline: float, group: bool) -> None:
        """SIGTERM each process (with ``group``, its whole process group), wait until
        ``deadline``, SIGKILL it if it still runs."""
        for proc in procs:
            if proc.poll() is None:
                try:
                    if group:
                        os.killpg(proc.pid, signal.SIGTERM)
                    else:
                        proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="session")
def ray_node_processes() -> type[RayNodes]:
    return RayNodes
