"""What a worker asks Ray for (``pdserve.cluster.node_placement``), without Ray."""

from __future__ import annotations

import pytest

from pdserve.cluster.actors import WorkerSpec, worker_actor_options
from pdserve.cluster.node_placement import (
    WorkerResources,
    actor_resources,
    resolve_device,
    worker_resources,
)
from pdserve.engine.config import EngineConfig

POOL_NODES = {"CPU": 4.0, "pdserve_prefill": 2.0, "pdserve_decode": 2.0}


def test_a_cuda_worker_asks_for_its_gpu_and_a_cpu_worker_for_its_threads():
    gpu = worker_resources("cuda", worker_cpus=1)
    assert (gpu.num_gpus, gpu.num_cpus, gpu.torch_threads) == (1.0, 1.0, 1)
    cpu = worker_resources("cpu", worker_cpus=2)
    assert (cpu.num_gpus, cpu.num_cpus, cpu.torch_threads) == (0.0, 2.0, 2)
    shared = worker_resources("cpu", worker_cpus=0)  # asks for nothing, runs one thread
    assert (shared.num_cpus, shared.torch_threads) == (0.0, 1)
    with pytest.raises(ValueError, match="worker_cpus"):
        worker_resources("cpu", worker_cpus=-1)


def test_auto_resolves_to_cuda_only_where_the_cluster_has_a_gpu():
    assert resolve_device("auto", {"CPU": 8.0, "GPU": 2.0}) == "cuda"
    assert resolve_device("auto", {"CPU": 8.0}) == "cpu"
    assert resolve_device("cpu", {"GPU": 1.0}) == "cpu"
    with pytest.raises(ValueError, match="no GPU"):
        resolve_device("cuda", {"CPU": 8.0})


@pytest.mark.parametrize("placement, cluster, wanted", [
    ("auto", POOL_NODES, {"pdserve_prefill": 1.0}),  # nodes advertise it: only there
    ("auto", {"CPU": 2.0}, {}),  # embedded default: the pools share the node
    ("auto", {"CPU": 2.0, "pdserve_decode": 1.0}, {}),  # only the other pool has nodes
    ("require", {"CPU": 2.0}, {"pdserve_prefill": 1.0}),  # waits for such a node
    ("any", POOL_NODES, {}),
])
def test_a_pool_lands_on_nodes_advertising_its_resource(placement, cluster, wanted):
    resources = WorkerResources(num_cpus=1.0, placement=placement)
    assert actor_resources(resources, "prefill", cluster) == \
        {"num_cpus": 1.0, "num_gpus": 0.0, "resources": wanted}


def test_the_actor_options_carry_the_resources():
    spec = WorkerSpec("decode-3", "decode", EngineConfig(model="m"), "redis://x", "c",
                      resources=worker_resources("cuda", 1))
    options = worker_actor_options(spec, detached=True, cluster_resources=POOL_NODES)
    assert options["num_gpus"] == 1.0 and options["num_cpus"] == 1.0
    assert options["resources"] == {"pdserve_decode": 1.0}
    assert options["name"] == "decode-3" and options["lifetime"] == "detached"
    with pytest.raises(ValueError, match="pool_placement"):
        WorkerResources(placement="nodes")


def test_kv_moves_from_gpu_prefill_to_cpu_decode_not_back():
    from pdserve.cluster.node_placement import check_pool_devices

    for ok in ({"prefill": "cuda", "decode": "cpu"}, {"prefill": "cuda", "decode": "cuda"},
               {"prefill": "cpu", "decode": "cpu"}, {"prefill": "auto", "decode": "cuda"}):
        check_pool_devices(ok)
    with pytest.raises(ValueError, match="prefill on cpu, decode on cuda.*--prefill-device"):
        check_pool_devices({"prefill": "cpu", "decode": "cuda"})


def test_cuda_pools_larger_than_the_local_gpus_fail_with_the_fix_named():
    from pdserve.cluster.options import ClusterOptions

    ClusterOptions(num_prefill=1, num_decode=1).check_local_gpus(2)  # one GPU each
    with pytest.raises(ValueError, match=r"need 2 GPUs and this machine has 1: lower "
                                         r"worker_gpus to 0.5"):
        ClusterOptions(num_prefill=1, num_decode=1).check_local_gpus(1)
    ClusterOptions(num_prefill=1, num_decode=1, worker_gpus=0.5).check_local_gpus(1)
    # a GPU prefill pool feeding CPU decode workers: only the prefill workers need GPUs
    ClusterOptions(num_prefill=1, num_decode=3).check_local_gpus(1, ["prefill"])
    with pytest.raises(ValueError, match="1 workers of 2 tensor parallel ranks need 2 GPUs"):
        ClusterOptions(num_prefill=1, num_decode=3,
                       prefill_tensor_parallel_size=2).check_local_gpus(1, ["prefill"])
    assert worker_resources("cuda", 1, worker_gpus=0.5).num_gpus == 0.5
    assert worker_resources("cpu", 1, worker_gpus=0.5).num_gpus == 0.0
    with pytest.raises(ValueError, match="worker_gpus"):
        ClusterOptions(worker_gpus=0.0)
