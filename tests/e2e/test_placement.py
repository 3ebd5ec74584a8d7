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
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from pdserve.cluster.processes import is_running
from pdserve.cluster.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]

START_S = 120.0  # bound on the served cluster coming up
MAX_TOKENS = 16


def ray_view(nodes) -> dict:
    """{"nodes": [resources of each live node], "actors": [named actors]}, asked by a new
    driver process (this one may hold the test session's own Ray)."""
    code = (f"import json, ray; ray.init(address={nodes.address!r}, logging_level=40); "
            "print(json.dumps({'nodes': [n['Resources'] for n in ray.nodes() if n['Alive']], "
            "'actors': ray.util.list_named_actors(all_namespaces=True)}))")
    out = subprocess.run([sys.executable, "-P", "-c", code], env=nodes.env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_nodes(ray_node_processes):
    tmp = tempfile.mkdtemp(prefix="pdnodes-", dir="/tmp")  # short: Ray's socket paths
    nodes = ray_node_processes(tmp)
    try:
        nodes.head()
        nodes.join("prefill-node", {"pdserve_prefill": 1})
        nodes.join("decode-node", {"pdserve_decode": 1})
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def pdserve(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_serve_on_a_joined_cluster_places_each_pool_on_its_node(ray_nodes, model_dir, e2e,
                                                               tmp_path):
    view = ray_view(ray_nodes)
    assert len(view["nodes"]) == 3 and view["actors"] == []
    port = free_port()
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli.main", "serve", "--ray-address",
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
