"""Placement by pool on a real multi-node Ray cluster, on this machine: a head (``ray start
--head``) and two more nodes (``ray start --address``, see ``ray_node.py``), each its own
process tree on loopback, one advertising ``pdserve_prefill``, the other ``pdserve_decode``.
``pdserve serve --ray-address`` (the real CLI, in a subprocess: the first test of that path)
must place each pool on its node, pair the nodes' workers for KV transfer, serve the offline
engine's greedy tokens, and on SIGTERM leave the three nodes running with no actor left.

Every Ray process is stopped by pid in the fixture's teardown, on failure too."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pdserve.cluster.launcher import is_running

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
RAY = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
START_S = 120.0  # bound on one Ray node, or the served cluster, coming up
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNodes:
    """A head and joined nodes as local processes (``ray start --block``), stopped by pid."""

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
        deadline = time.monotonic() + START_S
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

    def join(self, name: str, resources: dict) -> None:
        self.start(name, [sys.executable, str(HERE / "ray_node.py"), "start", "--address",
                          self.address, "--num-cpus", "1", "--resources",
                          json.dumps(resources)])

    def remember(self) -> None:
        for proc in self.nodes.values():
            try:
                self._seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass

    def tree(self, name: str) -> set[int]:
        """Every live process under node ``name``'s ``ray start``."""
        return {p.pid for p in psutil.Process(self.nodes[name].pid).children(recursive=True)}

    def stop(self) -> None:
        """SIGTERM every node (its ``ray start --block`` stops its own processes), then
        SIGKILL whatever of theirs is left."""
        self.remember()
        for proc in reversed(list(self.nodes.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.nodes.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in self._seen:
            if is_running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def ray_view(nodes: RayNodes) -> dict:
    """{"nodes": [resources of each live node], "actors": [named actors]}, asked by a new
    driver process (this one may hold the test session's own Ray)."""
    code = (f"import json, ray; ray.init(address={nodes.address!r}, logging_level=40); "
            "print(json.dumps({'nodes': [n['Resources'] for n in ray.nodes() if n['Alive']], "
            "'actors': ray.util.list_named_actors(all_namespaces=True)}))")
    out = subprocess.run([sys.executable, "-c", code], env=nodes.env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_nodes():
    tmp = tempfile.mkdtemp(prefix="pdnodes-", dir="/tmp")  # short: Ray's socket paths
    nodes = RayNodes(tmp)
    try:
        nodes.head()
        nodes.join("prefill-node", {"pdserve_prefill": 1})
        nodes.join("decode-node", {"pdserve_decode": 1})
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def pdserve(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_serve_on_a_joined_cluster_places_each_pool_on_its_node(ray_nodes, model_dir, e2e,
                                                               tmp_path):
    view = ray_view(ray_nodes)
    assert len(view["nodes"]) == 3 and view["actors"] == []
    port = free_port()
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--ray-address",
         ray_nodes.address, "--model", str(model_dir), "--port", str(port), "--metrics-port",
         "0", "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "128",
         "--max-num-batched-tokens", "32", "--heartbeat-s", "0.5", "--registry-ttl-s", "3"],
        env=ray_nodes.env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
        start_new_session=True)
    target = f"127.0.0.1:{port}"
    try:
        e2e.wait_for(lambda: "Ctrl-C" in log.read_text() or serve.poll() is not None, START_S,
                     "pdserve serve to report serving")
        assert serve.poll() is None, log.read_text()[-3000:]
        status = json.loads(pdserve("status", "--target", target, "--json",
                                    env=ray_nodes.env).stdout)
        workers = {w["role"]: w for w in status["workers"]}
        assert set(workers) == {"prefill", "decode"}
        for role, node in (("prefill", "prefill-node"), ("decode", "decode-node")):
            w = workers[role]
            assert w["state"] == "ready" and w["device"] == "cpu" and w["torch_threads"] == 1
            assert w["pid"] in ray_nodes.tree(node), f"{role} worker is not on {node}"
        worker_pids = {w["pid"] for w in workers.values()}

        prompts = e2e.prompts(seed=3, n=4)
        outs = e2e.generate_all(target, prompts, MAX_TOKENS)
        assert [o.token_ids for o in outs] == e2e.reference(model_dir, prompts, MAX_TOKENS)
        metrics_url = next(word.rstrip(",") for word in log.read_text().split()
                           if word.startswith("http://") and word.rstrip(",").endswith(
                               "/metrics"))
        import urllib.request

        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        sent = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("pdserve_kv_transfer_bytes_total{")]
        assert sent and sum(sent) > 0  # KV crossed from the prefill node to the decode node
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            raise
    assert code == 0, log.read_text()[-3000:]
    assert all(proc.poll() is None for proc in ray_nodes.nodes.values())  # nodes still run
    e2e.wait_for(lambda: not any(is_running(p) for p in worker_pids), 30, "workers to exit")
    view = ray_view(ray_nodes)
    assert len(view["nodes"]) == 3 and view["actors"] == []  # clean: no actor left
