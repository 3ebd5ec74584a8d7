"""Chart smoke run: the default Helm chart, rendered, then run on this machine as the pods it
describes would run, every command and environment read from the rendered manifests.

There is no Kubernetes API server here. What a cluster would run, this test runs as local
processes on loopback:

* the Secrets: their values are what ``secretKeyRef`` resolves to;
* Redis: the StatefulSet's container command (a shell line), with its env, its data volume a
  folder here (it must hold the append-only file afterwards);
* the RayCluster: the head's ``ray start --head`` with its ``rayStartParams`` turned into flags
  the way KubeRay does (``--key=value`` on the bash line it runs), and with KubeRay's GCS fault
  tolerance settings (``RAY_REDIS_ADDRESS``, ``--redis-password``); then one ``ray start
  --address`` node per replica of every worker group, with that group's parameters;
* the controller: the Deployment's ``pdserve serve`` args and env (``$(VAR)`` expanded as the
  kubelet does).

Only what cannot exist on one machine is replaced, all in :func:`on_this_machine`: the
Services' DNS names become 127.0.0.1, every port a pod listens on becomes a free port (pods
each have their own network; here they share one), and the image's paths become local ones
(the model folder, the executables). A broken command, flag, env or parameter in the chart
fails this test.

Then a greedy request through the router's gRPC port must equal the offline engine, and
everything stops (processes by pid; never ``ray stop``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from pdserve.cluster.redis_server import find_redis_server, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
RELEASE, NAMESPACE = "pd", "serving"
# The default values, with one engine setting that fits this machine's memory (the chart's
# own engineArgs path, so it is exercised too).
VALUES = {"prefill": {"engineArgs": {"num-kv-blocks": 256}},
          "decode": {"engineArgs": {"num-kv-blocks": 256}}}
START_S = 180.0
MAX_TOKENS = 8


@dataclass
class Machine:
    """What stands in for the cluster's network and image on this machine."""

    addresses: dict[str, str] = field(default_factory=dict)  # "service:port" -> "127.0.0.1:P"
    ports: dict[str, dict[int, int]] = field(default_factory=dict)  # pod -> {port: free one}
    paths: dict[str, str] = field(default_factory=dict)  # image path -> local path


def on_this_machine(text: str, pod: str, machine: Machine) -> str:
    """``text`` (a flag, an env value, a shell line) of ``pod`` as it runs here: Service
    addresses to loopback ones, the pod's listening ports (alone or after ``=``) to free
    ports, 0.0.0.0 (a pod's own interfaces) to 127.0.0.1, the image's paths to local ones.
    Nothing else changes."""
    for address, local in machine.addresses.items():
        text = text.replace(address, local)
    for port, local in machine.ports.get(pod, {}).items():
        text = re.sub(rf"(?<![\w.:]){port}(?![\w.])", str(local), text)
    for path, local in machine.paths.items():
        text = re.sub(rf"(?<![\w/.-]){re.escape(path)}(?![\w.-])", local, text)
    return text.replace("0.0.0.0", "127.0.0.1")


def kubelet_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's env as the kubelet builds it: secretKeyRef values, then ``$(VAR)``
    expanded from the variables defined before it."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            env[item["name"]] = expand(item["value"], env)
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)


def kuberay_flags(params: dict[str, str]) -> list[str]:
    """``rayStartParams`` as KubeRay hands them to ``ray start``: ``--key=value`` on the bash
    line the container runs, so bash's quoting applies."""
    return [word for key, value in params.items() for word in shlex.split(f"--{key}={value}")]


class Rendered:
    def __init__(self, files: dict[str, str]):
        self.objects = [doc for name, text in sorted(files.items()) if name.endswith(".yaml")
                        for doc in yaml.safe_load_all(text) if doc]

    def one(self, kind: str, suffix: str = "") -> dict:
        (found,) = [o for o in self.objects
                    if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
        return found

    def secrets(self) -> dict[str, dict[str, str]]:
        return {s["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                        for k, v in s["data"].items()}
                for s in self.objects if s["kind"] == "Secret"}


def pod_container(template: dict) -> dict:
    return template["spec"]["containers"][0]


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    return Rendered(chart.render(VALUES, name=RELEASE, namespace=NAMESPACE))


def test_chart_smoke_run(rendered, ray_node_processes, model_dir, e2e, tmp_path):
    secrets = rendered.secrets()
    cluster = rendered.one("RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    controller = pod_container(rendered.one("Deployment", "-controller")["spec"]["template"])
    redis_set = rendered.one("StatefulSet", "-redis")
    redis_service = rendered.one("Service", "-redis")
    router_service = rendered.one("Service", "-router")
    gcs_port = int(head["rayStartParams"]["port"])
    client_port = int(head["rayStartParams"]["ray-client-server-port"])
    redis_port = redis_service["spec"]["ports"][0]["port"]
    router_ports = {p["name"]: p["port"] for p in router_service["spec"]["ports"]}

    tmp = tempfile.mkdtemp(prefix="pdchart-", dir="/tmp")  # short: Ray's socket paths
    nodes = ray_node_processes(tmp)
    [redis_data] = pod_container(redis_set["spec"]["template"])["volumeMounts"]  # its claim
    (tmp_path / "redis-data").mkdir()
    head_service = f"{cluster['metadata']['name']}-head-svc"
    machine = Machine(
        addresses={f"{head_service}:{gcs_port}": nodes.address,
                   f"{head_service}:{client_port}": f"127.0.0.1:{free_port()}",
                   f"{redis_service['metadata']['name']}:{redis_port}":
                       f"127.0.0.1:{free_port()}"},
        paths={controller_arg(controller, "--model"): str(model_dir),
               "redis-server": find_redis_server(),
               redis_data["mountPath"]: str(tmp_path / "redis-data")})
    machine.ports = {
        "head": {gcs_port: nodes.port, client_port: port_of(machine, head_service, client_port)},
        "redis": {redis_port: port_of(machine, redis_service["metadata"]["name"], redis_port)},
        "router": {port: free_port() for port in router_ports.values()}}

    redis = None
    serve = None
    try:
        redis = start_redis(redis_set, secrets, machine, tmp_path)
        head_env = kubelet_env(pod_container(head["template"]), secrets)
        nodes.env.update(head_env)  # the Ray token every Ray container gets
        start_ray(nodes, cluster, secrets, machine)
        serve = start_controller(controller, secrets, machine, tmp_path, nodes.env)
        target = f"127.0.0.1:{machine.ports['router'][router_ports['grpc']]}"
        log = tmp_path / "controller.log"
        e2e.wait_for(lambda: "Ctrl-C" in log.read_text() or serve.poll() is not None,
                     START_S, "the controller's pdserve serve to report serving")
        assert serve.poll() is None, log.read_text()[-4000:] + ray_client_logs(nodes.tmp)

        prompts = e2e.prompts(seed=5, n=2)
        outs = e2e.generate_all(target, prompts, MAX_TOKENS)
        assert [o.token_ids for o in outs] == e2e.reference(model_dir, prompts, MAX_TOKENS)
        # Redis kept its data in an append-only file on its volume
        assert [p.name for p in (tmp_path / "redis-data").iterdir()
                if p.name.startswith("appendonly")]
    finally:
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        nodes.stop()
        if redis is not None and redis.poll() is None:
            os.killpg(redis.pid, signal.SIGKILL)
            redis.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def ray_client_logs(tmp: str) -> str:
    """The head's Ray client server logs (the proxy and each client's own server), which say
    why a ``ray://`` connection failed."""
    logs = sorted(Path(tmp, "ray").glob("session_*/logs/ray_client_server*"))
    return "".join(f"\n--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs)


def controller_arg(container: dict, flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


def port_of(machine: Machine, service: str, port: int) -> int:
    return int(machine.addresses[f"{service}:{port}"].rsplit(":", 1)[1])


def start_redis(statefulset: dict, secrets, machine: Machine, tmp_path) -> subprocess.Popen:
    """The Redis container's command, as its shell runs it."""
    import redis

    container = pod_container(statefulset["spec"]["template"])
    command = [on_this_machine(w, "redis", machine)
               for w in [*container["command"], *container["args"]]]
    env = {**os.environ, **kubelet_env(container, secrets)}
    proc = subprocess.Popen(command, env=env, stdout=(tmp_path / "redis.log").open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    port = next(iter(machine.ports["redis"].values()))
    client = redis.Redis(host="127.0.0.1", port=port, password=env["REDIS_PASSWORD"])
    from pdserve.testing.waits import wait_for

    wait_for(lambda: proc.poll() is None and client.ping(), 20, "the chart's Redis")
    client.close()
    return proc


def start_ray(nodes, cluster: dict, secrets, machine: Machine) -> None:
    """The head, then each worker group's replicas, as KubeRay starts them."""
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    flags = kuberay_flags(head["rayStartParams"])
    gcs = spec.get("gcsFaultToleranceOptions")
    common = dict(nodes.env)
    if gcs is not None:  # KubeRay: the head's GCS keeps its tables in that Redis
        ref = gcs["redisPassword"]["valueFrom"]["secretKeyRef"]
        nodes.env["RAY_REDIS_ADDRESS"] = on_this_machine(gcs["redisAddress"], "head", machine)
        nodes.env["RAY_external_storage_namespace"] = cluster["metadata"]["name"]
        flags.append(f"--redis-password={secrets[ref['name']][ref['key']]}")
    ray_cli = [sys.executable, "-P", "-c", "from ray.scripts.scripts import main; main()"]
    nodes.start("head", [*ray_cli, "start", "--head", "--temp-dir", str(Path(nodes.tmp, "ray")),
                         *[on_this_machine(f, "head", machine) for f in flags]])
    nodes.env = common  # the head's own settings stay the head's
    head_address = f"{cluster['metadata']['name']}-head-svc:{head['rayStartParams']['port']}"
    for group in spec["workerGroupSpecs"]:
        pod = "router" if "router" in group["groupName"] else group["groupName"]
        flags = [f"--address={head_address}", *kuberay_flags(group["rayStartParams"])]
        for index in range(group["replicas"]):
            nodes.start(f"{group['groupName']}-{index}",
                        [*nodes.join_command(), *[on_this_machine(f, pod, machine)
                                                  for f in flags]])


def start_controller(container: dict, secrets, machine: Machine, tmp_path,
                     ray_env: dict) -> subprocess.Popen:
    """The image's entrypoint (pdserve) with the Deployment's args and env. Its routers bind
    in the router group's Ray node, which here shares this machine's loopback."""
    env = dict(ray_env)
    env.update({k: on_this_machine(v, "controller", machine)
                for k, v in kubelet_env(container, secrets).items()})
    args = [on_this_machine(expand(a, env), "router", machine) for a in container["args"]]
    pdserve = [sys.executable, "-m", "pdserve.cli.main"]  # the image's `pdserve`
    (tmp_path / "controller.args").write_text(json.dumps(args))
    return subprocess.Popen([*pdserve, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=(tmp_path / "controller.log").open("w"),
                            start_new_session=True)
