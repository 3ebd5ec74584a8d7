"""The Helm chart, without a Kubernetes API server: Helm's linter (strict) and renderer for
every values file under helm/pdserve/ci/, every core object validated against the pinned
Kubernetes schema (strict), the RayCluster against KubeRay's CRD schema, and assertions on
what the objects say (helm-unittest style). The chart smoke run (tests/e2e/
test_chart_smoke.py) then runs the rendered commands on this machine."""

from __future__ import annotations

import base64
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
KUBERNETES = "1.31.0"  # the Kubernetes version the objects are validated against
CI_FILES = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*.yaml"))
NOT_CORE = ("ray.io/", "monitoring.coreos.com/")  # validated against their own CRDs


def pod_specs(rendered) -> dict[str, dict]:
    """component -> pod spec, for every pod the release runs (RayCluster groups included)."""
    specs = {}
    for obj in rendered.objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            specs[obj["metadata"]["name"]] = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "RayCluster":
            specs["ray-head"] = obj["spec"]["headGroupSpec"]["template"]["spec"]
            for group in obj["spec"]["workerGroupSpecs"]:
                specs[group["groupName"]] = group["template"]["spec"]
    return specs


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def group(rendered, name: str) -> dict:
    cluster = rendered.one("RayCluster")
    return next(g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def controller_args(rendered) -> list[str]:
    return rendered.one("Deployment", "-controller")["spec"]["template"]["spec"][
        "containers"][0]["args"]


def controller_options(args: list[str]):
    """The ClusterOptions ``pdserve serve`` builds from the controller's arguments."""
    from pdserve.cli.main import build_parser
    from pdserve.cli.settings import options_from_args
    from pdserve.cluster.options import ClusterOptions

    return options_from_args(build_parser().parse_args(args), ClusterOptions())


@pytest.mark.parametrize("name", CI_FILES)
def test_lint_strict(name, values_files):
    import helm_python

    report = helm_python.lint(str(CHART), values_files[name], strict=True,
                              kube_version=f"v{KUBERNETES}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("name", CI_FILES)
def test_core_objects_validate_strictly(name, values_files, render):
    import kubernetes_validate

    rendered = render(values_files[name])
    core = [o for o in rendered.objects if not o["apiVersion"].startswith(NOT_CORE)]
    assert {"Deployment", "Service", "Secret", "PodDisruptionBudget"} <= {o["kind"]
                                                                          for o in core}
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", CI_FILES)
def test_raycluster_validates_against_kuberay_crd(name, values_files, render, kuberay_schema):
    import jsonschema

    cluster = render(values_files[name]).one("RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    jsonschema.validate(cluster, kuberay_schema)


@pytest.fixture(scope="module")
def kuberay_schema(kuberay_crd) -> dict:
    """The CRD's v1 schema (read once: the file is large)."""
    crd = yaml.load(kuberay_crd.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(version["schema"]["openAPIV3Schema"])


def _strict(schema):
    """The CRD's schema with unknown fields refused (what the API server prunes), so a
    misspelt field fails here instead of vanishing."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if out.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_raycluster_shape(render):
    cluster = render().one("RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no worker or router on the head
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode", "router"}
    for role in ("prefill", "decode", "router"):
        params = groups[role]["rayStartParams"]
        resources = json.loads(shlex.split(params["resources"])[0])  # as bash hands it to Ray
        assert resources == {f"pdserve_{role}": 1}
    gcs = cluster["spec"]["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] == "pd-pdserve-redis:6379"
    assert gcs["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "pd-pdserve-redis"


def test_replicas_and_resources_follow_values(render):
    values = {"prefill": {"replicas": 3, "minReplicas": 2, "maxReplicas": 5,
                          "resources": {"limits": {"cpu": "3", "memory": "5Gi"}}},
              "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 7},
              "router": {"replicas": 2}, "workerCpus": 2}
    rendered = render(values)
    prefill, decode, router = (group(rendered, n) for n in ("prefill", "decode", "router"))
    assert (prefill["replicas"], prefill["minReplicas"], prefill["maxReplicas"]) == (3, 2, 5)
    assert (decode["replicas"], decode["minReplicas"], decode["maxReplicas"]) == (2, 1, 7)
    assert router["replicas"] == router["minReplicas"] == router["maxReplicas"] == 2
    assert prefill["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"cpu": "3", "memory": "5Gi"}, "requests": {"cpu": "1", "memory": "4Gi"}}
    assert prefill["rayStartParams"]["num-cpus"] == "2"
    args = " ".join(controller_args(rendered))
    for flags in ("--prefill 3", "--decode 2", "--routers 2", "--worker-cpus 2",
                  "--pool-placement require"):
        assert flags in args


def test_a_pool_may_have_its_own_worker_cpus(render):
    rendered = render({"workerCpus": 2, "prefill": {"workerCpus": 4}})
    assert group(rendered, "prefill")["rayStartParams"]["num-cpus"] == "4"
    assert group(rendered, "decode")["rayStartParams"]["num-cpus"] == "2"
    args = controller_args(rendered)
    options = controller_options(args)
    assert [options.worker_cpus_of(role) for role in ("prefill", "decode")] == [4, 2]
    assert "--decode-worker-cpus" not in args


def test_gpu_prefill_pods_may_feed_cpu_decode_pods(render):
    rendered = render({"prefill": {"resources": {"limits": {"nvidia.com/gpu": 1}}}})
    assert group(rendered, "prefill")["rayStartParams"]["num-gpus"] == "1"
    assert "num-gpus" not in group(rendered, "decode")["rayStartParams"]
    options = controller_options(controller_args(rendered))
    assert [options.device_of(role, options.engine["device"])
            for role in ("prefill", "decode")] == ["cuda", "cpu"]


def test_a_pool_may_run_tensor_parallel_workers(render):
    """prefill.tensorParallelSize 2: its pods advertise two ranks' CPUs (and need two GPUs),
    the controller passes the pool's flag, and pdserve reads it back as that pool's size."""
    rendered = render({"workerCpus": 3, "prefill": {"tensorParallelSize": 2}})
    assert group(rendered, "prefill")["rayStartParams"]["num-cpus"] == "6"
    assert group(rendered, "decode")["rayStartParams"]["num-cpus"] == "3"
    args = controller_args(rendered)
    options = controller_options(args)
    assert [options.ranks_of(role) for role in ("prefill", "decode")] == [2, 1]
    assert "--decode-tensor-parallel-size" not in args
    gpus = {"limits": {"nvidia.com/gpu": 2}}
    on_gpus = render({"prefill": {"tensorParallelSize": 2, "resources": gpus},
                      "decode": {"resources": gpus}})
    assert group(on_gpus, "prefill")["rayStartParams"]["num-gpus"] == "2"


def test_gpu_values_give_gpu_limits_and_workers_that_ask_ray_for_them(values_files, render):
    rendered = render(values_files["gpu"])
    for role in ("prefill", "decode"):
        g = group(rendered, role)
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
        assert g["rayStartParams"]["num-gpus"] == "1"  # the pod's Ray node has the GPU
        assert g["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    args = controller_args(rendered)
    assert args[args.index("--device") + 1] == "cuda"  # so each worker asks Ray for one
    assert "num-gpus" not in group(rendered, "router")["rayStartParams"]
    assert "--device" not in controller_args(render())


def test_engine_args_merge_and_pdserve_accepts_the_controller_flags(values_files, render):
    from pdserve.cli.main import build_parser
    from pdserve.cli.settings import options_from_args
    from pdserve.cluster.options import ClusterOptions

    args = controller_args(render(values_files["gpu"]))
    assert args[0] == "serve"
    parsed = build_parser().parse_args(args)
    options = options_from_args(parsed, ClusterOptions())
    assert options.engine == {"dtype": "bfloat16", "max_num_batched_tokens": 8192,
                              "kv_cache_dtype": "int8", "device": "cuda"}
    assert (options.num_prefill, options.num_decode, options.num_routers) == (1, 2, 1)
    assert options.ray_address == "ray://pd-pdserve-head-svc:10001"
    assert (options.host, options.port, options.http_port, options.metrics_port) == (
        "0.0.0.0", 50051, 8000, 9400)


def test_lora_values_reach_pdserve(render):
    values = {"prefill": {"engineArgs": {"enable-lora": True, "max-lora-rank": 32}},
              "decode": {"engineArgs": {"enable-lora": True, "max-lora-rank": 32}},
              "router": {"args": {"lora-modules": ["sql=/models/sql", "chat=/models/chat"]}}}
    options = controller_options(controller_args(render(values)))
    assert options.engine == {"enable_lora": True, "max_lora_rank": 32}
    assert options.lora_modules == ("sql=/models/sql", "chat=/models/chat")


def test_autoscaling_values_are_a_file_pdserve_reads(values_files, render, tmp_path):
    from pdserve.cluster.autoscale.config import config_file_values

    rendered = render(values_files["autoscaling"])
    text = rendered.one("ConfigMap", "-autoscale")["data"]["autoscale.yaml"]
    (tmp_path / "autoscale.yaml").write_text(text)
    values = config_file_values(tmp_path / "autoscale.yaml")
    assert values["enabled"] is True and values["predictive"] is True
    assert (values["min_prefill"], values["max_prefill"]) == (1, 3)
    assert (values["min_decode"], values["max_decode"]) == (1, 6)
    assert values["ttft_slo_ms"] == 500
    args = controller_args(rendered)
    assert args[args.index("--autoscale-config") + 1] == "/etc/pdserve/autoscale.yaml"
    assert rendered.one("RayCluster")["spec"]["enableInTreeAutoscaling"] is True
    assert rendered.one("ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    assert not render().of("ConfigMap") and not render().of("ServiceMonitor")


def test_external_redis(values_files, render):
    rendered = render(values_files["external-redis"])
    assert not rendered.of("StatefulSet")
    assert {s["metadata"]["name"] for s in rendered.of("Secret")} == {"pd-pdserve-ray-token"}
    env = {e["name"]: e for e in rendered.one("Deployment", "-controller")["spec"]["template"][
        "spec"]["containers"][0]["env"]}
    assert env["PDSERVE_REDIS_URL"]["value"] == \
        "redis://:$(REDIS_PASSWORD)@redis-master.data.svc:6379/2"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "shared-redis", "key": "redis-password"}
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-key"
    gcs = rendered.one("RayCluster")["spec"]["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] == "redis-master.data.svc:6379"


def test_redis_keeps_an_append_only_file_on_a_volume_claim_unless_told_not_to(render):
    redis = render().one("StatefulSet", "-redis")
    [line] = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--appendonly yes --appendfsync everysec" in line and "--dir /data" in line
    assert "volumes" not in redis["spec"]["template"]["spec"]  # the claim is the data volume
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in claim["spec"]  # the cluster's default
    sized = render({"redis": {"persistence": {"size": "5Gi", "storageClass": "fast"}}})
    [claim] = sized.one("StatefulSet", "-redis")["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    off = render({"redis": {"persistence": {"enabled": False}}}).one("StatefulSet", "-redis")
    assert "volumeClaimTemplates" not in off["spec"]
    assert off["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert "--appendonly no" in off["spec"]["template"]["spec"]["containers"][0]["args"][0]


def test_keys_come_from_secrets_as_env_or_files_and_pdserve_reads_them(values_files, render,
                                                                       tmp_path):
    from pdserve.cli.main import build_parser
    from pdserve.cli.settings import options_from_args
    from pdserve.cluster.credentials import resolve_secrets
    from pdserve.cluster.options import ClusterOptions

    rendered = render(values_files["external-redis"])
    spec = rendered.one("Deployment", "-controller")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["PDSERVE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "pdserve-admin-key", "key": "key"}
    args = controller_args(rendered)
    path = args[args.index("--priority-api-key-file") + 1]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "pdserve-priority-keys" and mount["readOnly"]
    assert volume["secret"]["items"] == [{"key": "keys", "path": path.rsplit("/", 1)[1]}]
    monitor = rendered.one("ServiceMonitor")["spec"]["endpoints"][0]
    assert monitor["authorization"] == {"type": "Bearer", "credentials": {
        "name": "pdserve-admin-key", "key": "key"}}
    # What pdserve serve makes of it, with the Secrets' values where the kubelet puts them.
    keys = tmp_path / "keys"
    keys.write_text("prio-1\nprio-2\n")
    args[args.index("--priority-api-key-file") + 1] = str(keys)
    options = options_from_args(build_parser().parse_args(args), ClusterOptions())
    options = resolve_secrets(options, {"PDSERVE_API_KEY": "api", "PDSERVE_ADMIN_API_KEY":
                                        "admin", "PDSERVE_REDIS_URL": "redis://h:1/2",
                                        "PDSERVE_REDIS_PASSWORD": "pw"})
    assert (options.api_key, options.admin_api_key, options.priority_api_keys) == (
        "api", "admin", ("prio-1", "prio-2"))
    assert not any(re.search(r"api-key |password", a) for a in args)


@pytest.mark.parametrize("name", CI_FILES)
def test_no_literal_secret_in_any_env(name, values_files, render):
    rendered = render(values_files[name])
    secrets = {base64.b64decode(v).decode() for s in rendered.of("Secret")
               for v in s.get("data", {}).values()}
    text = yaml.safe_dump(rendered.objects)
    for obj in rendered.objects:
        if obj["kind"] != "Secret":
            assert not any(secret in yaml.safe_dump(obj) for secret in secrets), obj["kind"]
    for spec in pod_specs(rendered).values():
        for container in containers(spec):
            for env in container.get("env", []):
                if re.search(r"PASSWORD|TOKEN|KEY", env["name"]):
                    assert "valueFrom" in env, (container["name"], env["name"])
                if "value" in env:
                    assert "$(" in env["value"] or not re.search(r"://:[^$]", env["value"])
    assert "stringData" not in text


@pytest.mark.parametrize("name", CI_FILES)
def test_every_container_is_non_root_with_probes(name, values_files, render):
    for component, spec in pod_specs(render(values_files[name])).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, component
        assert spec["securityContext"]["runAsUser"] > 0, component
        for container in containers(spec):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, (component, container["name"])
            assert context["allowPrivilegeEscalation"] is False, component
            assert context["capabilities"]["drop"] == ["ALL"], component
        for container in spec["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, component


def test_router_service_and_grpc_health(render, values_files):
    rendered = render()
    service = rendered.one("Service", "-router")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50051, "http": 8000, "metrics": 9400}
    router = group(rendered, "router")
    labels = router["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    container = router["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    assert {p["name"] for p in container["ports"]} == {"grpc", "http", "metrics"}
    two = render(values_files["two-routers"])
    assert two.one("Service", "-router")["spec"]["type"] == "LoadBalancer"
    assert group(two, "router")["replicas"] == 2
    assert "--routers" in controller_args(two) and "2" in controller_args(two)
    pdbs = {p["metadata"]["name"] for p in rendered.of("PodDisruptionBudget")}
    assert pdbs == {"pd-pdserve-prefill", "pd-pdserve-decode", "pd-pdserve-router"}
    assert len(rendered.of("NetworkPolicy")) == 2


@pytest.mark.parametrize("values, message", [
    ({"prefill": {"engineArgs": {"dtype": "float16"}},
      "decode": {"engineArgs": {"dtype": "bfloat16"}}}, "differ"),
    ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "not the other way"),
    ({"decode": {"workerCpus": 0}}, "workerCpus"),
    ({"decode": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"prefill": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
      "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
     "prefill.tensorParallelSize \\(2\\) needs a GPU per rank"),
    ({"prefill": {"replicas": 0}}, "replicas"),
    ({"router": {"servce": {}}}, "servce"),
    ({"redis": {"enabled": False}}, "url"),
    ({"redis": {"persistence": {"size": "lots"}}}, "size"),
    ({"router": {"args": {"api-key": "k"}}}, "secrets never go in pdserve's arguments"),
    ({"prefill": {"engineArgs": {"redis-url": "redis://:pw@h:1"}}}, "secrets never go"),
    ({"kvTiers": {"cpuGib": -1, "diskGib": 0, "dir": "/x"}}, "cpuGib"),
    ({"kvTiers": {"cpuGib": 0, "diskGib": 10, "dir": "relative"}}, "dir"),
])
def test_bad_values_fail_with_a_message(values, message):
    import helm_python

    with pytest.raises(helm_python.HelmError, match=message):
        helm_python.Chart.load(str(CHART)).render(values, name="pd", namespace="serving")


def test_kv_tier_values_reach_pdserve_and_give_workers_a_disk(render):
    rendered = render({"kvTiers": {"cpuGib": 8, "diskGib": 100, "dir": "/var/cache/kv",
                                   "int8": True}})
    options = controller_options(controller_args(rendered))
    assert options.engine == {"kv_offload_cpu_gib": 8.0, "kv_offload_disk_gib": 100.0,
                              "kv_offload_dir": "/var/cache/kv", "kv_offload_int8": True}
    (cluster,) = rendered.of("RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for role in ("prefill", "decode"):
        spec = groups[role]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "kv-tiers"]
        assert volume["emptyDir"]["sizeLimit"] == "112640Mi"  # 100 GiB + 10 %
        mounts = spec["containers"][0]["volumeMounts"]
        assert {"name": "kv-tiers", "mountPath": "/var/cache/kv"} in mounts
    router_spec = groups["router"]["template"]["spec"]
    assert all(v["name"] != "kv-tiers" for v in router_spec["volumes"])
    plain = render({})  # (off by default: no flags, no volume)
    assert not any(a.startswith("--kv-offload") for a in controller_args(plain))


def test_tracing_values_reach_pdserve(render):
    rendered = render({"tracing": {"otlpEndpoint": "http://otel-collector.obs:4317"}})
    options = controller_options(controller_args(rendered))
    assert options.router.otlp_traces_endpoint == "http://otel-collector.obs:4317"
    assert "--otlp-traces-endpoint" not in controller_args(render({}))  # off by default


def test_a_tracing_endpoint_that_is_no_url_fails_with_a_message():
    import helm_python

    with pytest.raises(helm_python.HelmError, match="otlpEndpoint"):
        helm_python.Chart.load(str(CHART)).render({"tracing": {"otlpEndpoint": "collector:4317"}},
                                                  name="pd", namespace="serving")
